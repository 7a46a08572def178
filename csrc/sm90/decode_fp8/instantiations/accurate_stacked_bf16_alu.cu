// sm90 FP8 tensor-core decode kernel, bf16 q, both q terms in one stacked Q tile, 3 KV stages (accurate mode), half
// or three quarters of V's widening on the integer pipe (a measurement: FLASHMLA_BACKEND_FP8_DEBUG bits 2048 / 4096;
// traits.h: kWidenAluPairs).
#include "sm90/decode_fp8/launch.cuh"

namespace flashmla_backend::sm90::decode_fp8 {
template void run_decode_kernel<Variant::kAccurateStackedBF16Alu2>(const DecodeParams& params, int debug);
template void run_decode_kernel<Variant::kAccurateStackedBF16Alu3>(const DecodeParams& params, int debug);
}  // namespace flashmla_backend::sm90::decode_fp8
