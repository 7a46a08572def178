// sm90 decode kernel, e4m3 KV cache and Q, bf16 out (fp16 operands).
#include "sm90/decode/launch.cuh"

namespace flashmla_backend::sm90::decode {
template void run_decode_kernel<Variant::kFp8KvFp8Q>(const DecodeParams& params);
template int decode_smem_bytes<Variant::kFp8KvFp8Q>();
}  // namespace flashmla_backend::sm90::decode
