// Launcher declarations of the sm90 (sm_90a) split-KV MLA decode kernel.
// Definitions: launch.cuh, instantiated per Variant in instantiations/; the switch is in dispatch.cu.
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
// The kernel instantiations, one translation unit each (instantiations/), chosen by dispatch.cu from
// params.dtype / kv_fp8 / q_fp8.
enum class Variant {
  kBF16,          // bf16 q, cache and out
  kFP16,          // fp16 q, cache and out
  kFp8KvBF16Q,    // e4m3 cache, bf16 q and out (fp16 operands)
  kFp8KvFP16Q,    // e4m3 cache, fp16 q and out
  kFp8KvFp8Q,     // e4m3 cache and q, bf16 out
};
template <Variant V>
void run_decode_kernel(const DecodeParams& params);
template <Variant V>
int decode_smem_bytes();
}  // namespace sm90::decode

}  // namespace flashmla_backend
