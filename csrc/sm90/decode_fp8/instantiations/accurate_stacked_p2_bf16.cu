// sm90 FP8 tensor-core decode kernel, bf16 q (accurate mode), the stacked Q tile with P V on e4m3 tensor cores and P in
// two e4m3 terms (launch.cuh: VariantTraits; dispatch.cu: where it runs).
#include "sm90/decode_fp8/launch.cuh"

namespace flashmla_backend::sm90::decode_fp8 {
template void run_decode_kernel<Variant::kAccurateStackedP2BF16>(const DecodeParams& params, int debug);
}  // namespace flashmla_backend::sm90::decode_fp8
