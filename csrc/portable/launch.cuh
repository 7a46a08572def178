// Host side of the portable decode kernel: argument check, shared-memory attribute, launch.
// Included by the per-dtype instantiation files only.
#pragma once

#include <cuda_runtime.h>

#include "common/check.h"
#include "common/check_params.h"
#include "launch.h"
#include "params.h"
#include "portable/config.h"
#include "portable/decode.h"
#include "portable/kernel.cuh"
#include "portable/traits.h"

namespace flashmla_backend::portable {

// What the kernel needs of its arguments beyond check_decode_params()'s common rules.
inline DecodeRequirements decode_requirements() {
  DecodeRequirements r;
  r.kernel = "portable decode";
  r.formats = kPortableDenseFormats;
  r.pointers_set = true;
  // cp.async moves 16 bytes: Q and KV rows start on 16-byte boundaries (every stride is checked).
  r.q = AccessRule{kCopyBytes, kElemsPerCopy, false};
  r.kv = AccessRule{kCopyBytes, kElemsPerCopy, false};
  // The epilogue stores element pairs (4 bytes) and fp32 pairs (8 bytes).
  r.out = AccessRule{2 * kElemBytes, 2, false};
  r.o_accum = AccessRule{2 * static_cast<int>(sizeof(float)), 1, false};
  return r;
}

template <typename T>
void launch_decode(const DecodeParams& params) {
  check_decode_params(params, decode_requirements());
  const auto kernel = &portable_decode_kernel<T>;
  // Per call (cheap, and correct when several devices are used): the attribute is per device.
  FMLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const dim3 grid(params.num_m_blocks, params.num_heads_kv, params.num_sm_parts);
  kernel<<<grid, kNumThreads, kSmemBytes, static_cast<cudaStream_t>(params.stream)>>>(params);
  FMLA_CHECK_LAUNCH("portable_decode_kernel");
}

}  // namespace flashmla_backend::portable
