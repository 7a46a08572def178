// sm90 FP8 tensor-core decode kernel, bf16 q (accurate mode), each fp16 V half in two key granules.
#include "sm90/decode_fp8/launch.cuh"

namespace flashmla_backend::sm90::decode_fp8 {
template void run_decode_kernel<Variant::kAccurateBF16Granules>(const DecodeParams& params, int debug);
}  // namespace flashmla_backend::sm90::decode_fp8
