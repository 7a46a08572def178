// Launcher declarations of the sm90 FP8 tensor-core MLA decode kernel (e4m3 KV cache, e4m3 wgmma).
// Definitions: launch.cuh, instantiated per Variant in instantiations/; chosen by sm90/decode/dispatch.cu.
#pragma once

#include "params.h"

namespace flashmla_backend {

// True when this build holds the FP8 tensor-core kernel and FLASHMLA_BACKEND_FP8_KERNEL selects it for e4m3
// caches ("tensorcore"; "widen", the default while it is measured, keeps the kernel that widens e4m3 to fp16).
bool sm90_fp8_tensorcore_selected();

// Same contract as run_sm90_decode for a kv_fp8 cache.
void run_sm90_fp8_decode(const DecodeParams& params);

namespace sm90::decode_fp8 {
enum class Variant {
  kFastE4m3Q,    // e4m3 q (one term), P one term, bf16 out
  kAccurateBF16, // bf16 q split in two e4m3 terms, P two terms, bf16 out
  kAccurateFP16, // fp16 q split in two e4m3 terms, P two terms, fp16 out
};
template <Variant V>
void run_decode_kernel(const DecodeParams& params);
}  // namespace sm90::decode_fp8

}  // namespace flashmla_backend
