// sm90 decode kernel, e4m3 KV cache, bf16 Q and out (fp16 operands).
#include "sm90/decode/launch.cuh"

namespace flashmla_backend::sm90::decode {
template void run_decode_kernel<Variant::kFp8KvBF16Q>(const DecodeParams& params);
template int decode_smem_bytes<Variant::kFp8KvBF16Q>();
}  // namespace flashmla_backend::sm90::decode
