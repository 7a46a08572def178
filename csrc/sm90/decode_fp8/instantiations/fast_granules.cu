// sm90 FP8 tensor-core decode kernel, e4m3 q (fast mode), three or more M tiles, each V^T half in two key granules.
#include "sm90/decode_fp8/launch.cuh"

namespace flashmla_backend::sm90::decode_fp8 {
template void run_decode_kernel<Variant::kFastE4m3QGranules>(const DecodeParams& params, int debug);
}  // namespace flashmla_backend::sm90::decode_fp8
