// sm90 FP8 tensor-core decode kernel, fp16 q (accurate mode), the V-in-registers tile.
#include "sm90/decode_fp8/launch.cuh"

namespace flashmla_backend::sm90::decode_fp8 {
template void run_decode_kernel<Variant::kAccurateVRegsFP16>(const DecodeParams& params, int debug);
}  // namespace flashmla_backend::sm90::decode_fp8
