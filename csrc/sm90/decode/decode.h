// Launcher declarations of the sm90 (sm_90a) split-KV MLA decode kernel.
// Definitions: launch.cuh, instantiated per Variant in instantiations/; the switch is in dispatch.cu.
#pragma once

#include "params.h"

namespace flashmla_backend {

// Split-KV decode on Hopper (wgmma + TMA). Same contract as run_portable_decode: grid
// (num_m_blocks, num_heads_kv, num_sm_parts), writes out/lse for unsplit requests and
// o_accum/lse_accum for split ones; run_combine must follow on the same stream.
// Requires a device of compute capability 9.0 (the binary holds sm_90a code only). A 16-bit cache runs the
// kernel of this folder, an e4m3 cache (kv_format fp8_e4m3) the FP8 tensor-core kernel (sm90/decode_fp8/decode.h).
void run_sm90_decode(const DecodeParams& params);

// Dynamic shared memory one CTA of the sm90 16-bit decode kernel requests (bytes).
int sm90_decode_smem_bytes();

namespace sm90::decode {
// The kernel instantiations, one translation unit each (instantiations/), chosen by dispatch.cu from
// params.dtype.
enum class Variant {
  kBF16,  // bf16 q, cache and out
  kFP16,  // fp16 q, cache and out
};
template <Variant V>
void run_decode_kernel(const DecodeParams& params);
template <Variant V>
int decode_smem_bytes();
}  // namespace sm90::decode

}  // namespace flashmla_backend
