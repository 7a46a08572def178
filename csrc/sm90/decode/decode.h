// Launcher declarations of the sm90 (sm_90a) split-KV MLA decode kernel.
// Definitions: launch.cuh, instantiated per dtype in instantiations/{bf16,fp16}.cu; the dtype switch
// is in dispatch.cu.
#pragma once

#include "params.h"

namespace flashmla_backend {

// Split-KV decode on Hopper (wgmma + TMA). Same contract as run_portable_decode: grid
// (num_m_blocks, num_heads_kv, num_sm_parts), writes out/lse for unsplit requests and
// o_accum/lse_accum for split ones; run_combine must follow on the same stream.
// Requires a device of compute capability 9.0 (the binary holds sm_90a code only).
void run_sm90_decode(const DecodeParams& params);

// Dynamic shared memory one CTA of the sm90 decode kernel requests (bytes).
int sm90_decode_smem_bytes();

namespace sm90::decode {
// One instantiation per element type: cutlass::bfloat16_t (bf16.cu), cutlass::half_t (fp16.cu).
template <typename Element>
void run_decode_kernel(const DecodeParams& params);
template <typename Element>
int decode_smem_bytes();
}  // namespace sm90::decode

}  // namespace flashmla_backend
