// dtype switch of the sm90 decode kernel. Includes no kernel or CuTe code (cheap to compile): the
// kernels live in instantiations/{bf16,fp16}.cu, one translation unit each.
#include "common/check.h"
#include "params.h"
#include "sm90/decode/decode.h"

namespace cutlass {
struct bfloat16_t;
struct half_t;
}  // namespace cutlass

namespace flashmla_backend {

void run_sm90_decode(const DecodeParams& params) {
  switch (params.dtype) {
    case DType::kBF16:
      sm90::decode::run_decode_kernel<cutlass::bfloat16_t>(params);
      return;
    case DType::kFP16:
      sm90::decode::run_decode_kernel<cutlass::half_t>(params);
      return;
  }
  FMLA_HOST_CHECK(false, "sm90 decode: unsupported dtype " << int(params.dtype));
}

int sm90_decode_smem_bytes() {
  // The plan holds no dtype-dependent sizes (bf16 and fp16 are both 2 bytes).
  return sm90::decode::decode_smem_bytes<cutlass::bfloat16_t>();
}

}  // namespace flashmla_backend
