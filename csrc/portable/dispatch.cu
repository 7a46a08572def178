// dtype switch of the portable decode kernel (the entry points declared in csrc/launch.h). Includes no
// kernel code: the kernels live in instantiations/{bf16,fp16}.cu, one translation unit each.
#include "common/check.h"
#include "launch.h"
#include "portable/decode.h"
#include "portable/traits.h"

namespace flashmla_backend {

void run_portable_decode(const DecodeParams& params) {
  switch (params.dtype) {
    case DType::kBF16:
      portable::launch_decode<__nv_bfloat16>(params);
      return;
    case DType::kFP16:
      portable::launch_decode<__half>(params);
      return;
  }
  FMLA_HOST_CHECK(false, "portable decode: unsupported dtype code " << static_cast<int>(params.dtype));
}

int portable_decode_smem_bytes() { return portable::kSmemBytes; }

}  // namespace flashmla_backend
