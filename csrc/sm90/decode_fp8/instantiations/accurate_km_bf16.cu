// sm90 FP8 tensor-core decode kernel, bf16 q (accurate mode), the keys-on-M tile for at most 16 query rows.
#include "sm90/decode_fp8/launch.cuh"

namespace flashmla_backend::sm90::decode_fp8 {
template void run_decode_kernel<Variant::kAccurateKmBF16R16>(const DecodeParams& params, int debug);
}  // namespace flashmla_backend::sm90::decode_fp8
