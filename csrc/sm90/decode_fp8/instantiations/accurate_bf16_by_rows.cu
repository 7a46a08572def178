// sm90 FP8 tensor-core decode kernel, bf16 q (accurate mode), the two-term 64-row tile with V widened by rows, in one
// step or in steps of keys (measurements: FLASHMLA_BACKEND_FP8_DEBUG bits 2048 / 4096; traits.h: kWidenSteps).
#include "sm90/decode_fp8/launch.cuh"

namespace flashmla_backend::sm90::decode_fp8 {
template void run_decode_kernel<Variant::kAccurateBF16ByRows>(const DecodeParams& params, int debug);
template void run_decode_kernel<Variant::kAccurateBF16KeySteps>(const DecodeParams& params, int debug);
}  // namespace flashmla_backend::sm90::decode_fp8
