// Portable decode kernel, bf16 Q / KV cache / output.
#include "portable/launch.cuh"

namespace flashmla_backend::portable {
template void launch_decode<__nv_bfloat16>(const DecodeParams& params);
}  // namespace flashmla_backend::portable
