// sm90 FP8 tensor-core decode kernel, e4m3 q (fast mode), two M tiles as 2-CTA clusters sharing the V transposition
// (launch.cuh: VariantTraits; chosen with FLASHMLA_BACKEND_FP8_DEBUG bit 8 while it is measured).
#include "sm90/decode_fp8/launch.cuh"

namespace flashmla_backend::sm90::decode_fp8 {
template void run_decode_kernel<Variant::kFastE4m3QCluster>(const DecodeParams& params, int debug);
}  // namespace flashmla_backend::sm90::decode_fp8
