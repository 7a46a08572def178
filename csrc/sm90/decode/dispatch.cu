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
  if (params.kv_fp8 && sm90_fp8_tensorcore_selected(params.q_fp8)) {
    run_sm90_fp8_decode(params);
    return;
  }
  if (params.q_fp8) {  // check_decode_params: needs kv_fp8 and a bf16 output
    run_decode_kernel<Variant::kFp8KvFp8Q>(params);
    return;
  }
  switch (params.dtype) {
    case DType::kBF16:
      params.kv_fp8 ? run_decode_kernel<Variant::kFp8KvBF16Q>(params) : run_decode_kernel<Variant::kBF16>(params);
      return;
    case DType::kFP16:
      params.kv_fp8 ? run_decode_kernel<Variant::kFp8KvFP16Q>(params) : run_decode_kernel<Variant::kFP16>(params);
      return;
  }
  FMLA_HOST_CHECK(false, "sm90 decode: unsupported dtype " << int(params.dtype));
}

int sm90_decode_smem_bytes() {
  // The largest plan of the variants (the FP8 ones add one float after the barriers).
  return sm90::decode::decode_smem_bytes<sm90::decode::Variant::kFp8KvBF16Q>();
}

}  // namespace flashmla_backend
