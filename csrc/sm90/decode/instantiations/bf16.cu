// sm90 decode kernel, bf16 Q / KV / out.
#include "sm90/decode/launch.cuh"

namespace flashmla_backend::sm90::decode {
template void run_decode_kernel<Variant::kBF16>(const DecodeParams& params);
template int decode_smem_bytes<Variant::kBF16>();
}  // namespace flashmla_backend::sm90::decode
