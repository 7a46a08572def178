// sm90 FP8 tensor-core decode kernel, e4m3 q (fast mode), the V-in-registers tile.
#include "sm90/decode_fp8/launch.cuh"

namespace flashmla_backend::sm90::decode_fp8 {
template void run_decode_kernel<Variant::kFastVRegs>(const DecodeParams& params, int debug);
}  // namespace flashmla_backend::sm90::decode_fp8
