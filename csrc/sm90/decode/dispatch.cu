// Variant switch of the sm90 decode kernel. Includes no kernel or CuTe code (cheap to compile): the
// kernels live in instantiations/, one translation unit per Variant (decode.h).
#include "common/check.h"
#include "params.h"
#include "sm90/decode/decode.h"
#include "sm90/decode_fp8/decode.h"

namespace flashmla_backend {

void run_sm90_decode(const DecodeParams& params) {
  using sm90::decode::Variant;
  using sm90::decode::run_decode_kernel;
  if (params.kv_format == KvFormat::kFP8E4M3) {  // with an e4m3 (fast mode) or a 16-bit q (accurate mode)
    run_sm90_fp8_decode(params);
    return;
  }
  switch (params.dtype) {
    case DType::kBF16:
      run_decode_kernel<Variant::kBF16>(params);
      return;
    case DType::kFP16:
      run_decode_kernel<Variant::kFP16>(params);
      return;
  }
  FMLA_HOST_CHECK(false, "sm90 decode: unsupported dtype " << int(params.dtype));
}

int sm90_decode_smem_bytes() {
  // Both variants have the same plan.
  return sm90::decode::decode_smem_bytes<sm90::decode::Variant::kBF16>();
}

}  // namespace flashmla_backend
