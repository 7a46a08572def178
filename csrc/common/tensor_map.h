// cuTensorMapEncodeTiled through the runtime's driver entry point: the extension does not link libcuda. Resolved
// once per process. Used by the sm90 kernels' launchers (their KV and q tensor maps) and by the probes that check a
// tensor map's layout on a GPU.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "common/check.h"

namespace flashmla_backend {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiledFn get_encode_tiled() {
  static EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
    FMLA_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                                     &status));
    FMLA_HOST_CHECK(status == cudaDriverEntryPointSuccess && ptr != nullptr,
                    "cuTensorMapEncodeTiled is not available from the CUDA driver");
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

}  // namespace flashmla_backend
