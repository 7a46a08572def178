// sm90 FP8 tensor-core decode kernel, bf16 q (accurate mode), two M tiles as 2-CTA clusters sharing the V widening.
#include "sm90/decode_fp8/launch.cuh"

namespace flashmla_backend::sm90::decode_fp8 {
template void run_decode_kernel<Variant::kAccurateClusterBF16>(const DecodeParams& params, int debug);
}  // namespace flashmla_backend::sm90::decode_fp8
