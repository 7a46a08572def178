// sm90 FP8 tensor-core decode kernel, fp16 q (accurate mode) with both q terms stacked in one Q tile of 32 query rows
// (traits.h: kStackedTerms); launch.cuh gives the plan, dispatch.cu where it runs.
#include "sm90/decode_fp8/launch.cuh"

namespace flashmla_backend::sm90::decode_fp8 {
template void run_decode_kernel<Variant::kAccurateStackedFP16Left2>(const DecodeParams& params, int debug);
}  // namespace flashmla_backend::sm90::decode_fp8
