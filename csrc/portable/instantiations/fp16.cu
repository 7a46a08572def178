// Portable decode kernel, fp16 Q / KV cache / output.
#include "portable/launch.cuh"

namespace flashmla_backend::portable {
template void launch_decode<__half>(const DecodeParams& params);
}  // namespace flashmla_backend::portable
