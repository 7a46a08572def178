// sm90 FP8 tensor-core decode kernel, bf16 q (accurate mode): the keys-on-M tile for 17..32 query rows with two
// consumer warpgroups over alternate blocks (FLASHMLA_BACKEND_FP8_DEBUG bit 256; keys_on_m.h: kConsumers).
#include "sm90/decode_fp8/launch.cuh"

namespace flashmla_backend::sm90::decode_fp8 {
template void run_decode_kernel<Variant::kAccurateKmBF16R32Two>(const DecodeParams& params, int debug);
}  // namespace flashmla_backend::sm90::decode_fp8
