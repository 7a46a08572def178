// sm90 FP8 tensor-core decode kernel, e4m3 q (fast mode), pairs of M tiles as 2-CTA clusters with the KV blocks
// multicast into both CTAs (launch.cuh: VariantTraits; chosen with FLASHMLA_BACKEND_FP8_DEBUG bit 8192 while it is
// measured).
#include "sm90/decode_fp8/launch.cuh"

namespace flashmla_backend::sm90::decode_fp8 {
template void run_decode_kernel<Variant::kFastE4m3QMulticast>(const DecodeParams& params, int debug);
}  // namespace flashmla_backend::sm90::decode_fp8
