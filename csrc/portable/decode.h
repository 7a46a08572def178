// Launchers of the portable split-KV MLA decode kernel, one explicit instantiation per element type
// (instantiations/bf16.cu, instantiations/fp16.cu). dispatch.cu picks one from DecodeParams::dtype.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "params.h"

namespace flashmla_backend::portable {

// Launches the decode kernel for element type T (__nv_bfloat16 or __half) on params.stream.
// Asynchronous, allocation-free, CUDA-graph capturable; throws std::runtime_error on bad input or
// a failed launch. Defined in launch.cuh (device code: kernel.cuh).
template <typename T>
void launch_decode(const DecodeParams& params);

extern template void launch_decode<__nv_bfloat16>(const DecodeParams& params);
extern template void launch_decode<__half>(const DecodeParams& params);

}  // namespace flashmla_backend::portable
