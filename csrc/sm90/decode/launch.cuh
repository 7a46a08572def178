// Host side of the sm90 decode kernel: KV tensor map, shared-memory attribute, launch.
// Included by the per-dtype instantiation files and by sm90/decode_fp8/launch.cuh (its shared host helpers).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "common/check.h"
#include "common/check_params.h"
#include "common/tensor_map.h"
#include "launch.h"
#include "params.h"
#include "sm90/decode/decode.h"
#include "sm90/decode/kernel.cuh"

namespace flashmla_backend::sm90::decode {

using flashmla_backend::get_encode_tiled;  // common/tensor_map.h

// KV cache [num_pages, 64, h_kv, 576] as a 4-d tensor map with dims (fastest first)
// (576 columns, h_kv, 64 tokens, num_pages): strides grow in this order for a contiguous cache.
// Box = (64 columns, 1 head, 64 tokens, 1 page) = one 8 KB piece with 128B swizzle (the smem piece layout).
// No L2 promotion: a piece row is 128 bytes of a 1152-byte token row, and 256-byte promotion measured
// slower on the memory-bound shapes and no faster on h_q = 128 (figures: docs/perf/journal.md).
template <class T>
CUtensorMap make_kv_tensor_map(const DecodeParams& p) {
  constexpr int64_t kE = kElemBytes;
  constexpr CUtensorMapDataType kDataType = std::is_same_v<typename T::Element, cutlass::bfloat16_t>
                                                ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  CUtensorMap tmap;
  const cuuint64_t dims[4] = {cuuint64_t(kHeadDimK), cuuint64_t(p.num_heads_kv), cuuint64_t(kBlockN),
                              cuuint64_t(p.num_pages)};
  // With one KV head the head stride is never used (coordinate 0); frameworks report various values for it.
  const int64_t stride_h = p.num_heads_kv == 1 ? int64_t(kHeadDimK) : p.kv_stride_h;
  const cuuint64_t strides[3] = {cuuint64_t(stride_h * kE), cuuint64_t(p.kv_stride_token * kE),
                                 cuuint64_t(p.kv_stride_page * kE)};
  const cuuint32_t box[4] = {cuuint32_t(kPieceCols), 1u, cuuint32_t(kBlockN), 1u};
  const cuuint32_t elem_strides[4] = {1u, 1u, 1u, 1u};
  static_assert(kPieceCols * kBlockN * kE == kPieceBytes, "one box = one piece");
  const CUresult res = get_encode_tiled()(&tmap, kDataType, 4, const_cast<void*>(p.kv), dims, strides, box,
                                          elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                          CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  FMLA_HOST_CHECK(res == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed for the KV cache (CUresult "
                                           << int(res) << "; strides in elements: page " << p.kv_stride_page
                                           << ", token " << p.kv_stride_token << ", head " << p.kv_stride_h << ")");
  return tmap;
}

// What the kernel needs of its arguments beyond check_decode_params()'s common rules. Strides of size-1
// dimensions are never used (index 0) and are not checked, except the KV page and token strides, which the
// tensor map encodes. 16 bytes are 8 elements of a 16-bit tensor and 16 of an FP8 one. (The FP8 tensor-core
// kernel starts from these and sets its own; sm90/decode_fp8/launch.cuh.)
inline DecodeRequirements decode_requirements(int q_elem_bytes, int kv_elem_bytes) {
  DecodeRequirements r;
  r.kernel = "sm90 decode";
  r.formats = kSixteenBitFormats;  // the FP8 tensor-core kernel sets its own
  r.min_num_pages = 1;  // the KV tensor map needs a non-empty cache
  // cp.async of Q needs 16-byte aligned rows; TMA needs a 16-byte aligned base and strides.
  r.q = AccessRule{16, 16 / q_elem_bytes, true};
  r.kv = AccessRule{16, 16 / kv_elem_bytes, true};
  // Outputs are written as element pairs (out) and float pairs (o_accum).
  r.out = AccessRule{4, 2, true};
  r.o_accum = AccessRule{8, 1, false};
  return r;
}

// The Traits of each Variant (decode.h): the element type of q, cache and out.
template <Variant V>
struct VariantTraits;
template <>
struct VariantTraits<Variant::kBF16> {
  using type = Traits<cutlass::bfloat16_t>;
};
template <>
struct VariantTraits<Variant::kFP16> {
  using type = Traits<cutlass::half_t>;
};

template <Variant V>
int decode_smem_bytes() {
  return VariantTraits<V>::type::kSmemBytes;
}

// Launches a decode kernel on the decode grid (num_m_blocks, num_heads_kv, num_sm_parts) with `threads` threads and
// `smem` bytes of dynamic shared memory, with programmatic stream serialization when p.pdl; args are the kernel's.
template <class... KernelArgs, class... Args>
void launch_on_decode_grid(void (*kernel)(KernelArgs...), int threads, int smem, const char* name,
                           const DecodeParams& p, Args&&... args) {
  FMLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaLaunchAttribute attrs[1];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = p.pdl ? 1 : 0;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(p.num_m_blocks, p.num_heads_kv, p.num_sm_parts);
  cfg.blockDim = dim3(threads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = static_cast<cudaStream_t>(p.stream);
  cfg.attrs = attrs;
  cfg.numAttrs = 1;
  FMLA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
  FMLA_CHECK_LAUNCH(name);
}

template <Variant V>
void run_decode_kernel(const DecodeParams& p) {
  using T = typename VariantTraits<V>::type;
  check_decode_params(p, decode_requirements(kElemBytes, kElemBytes));  // refuses FP8 caches and q_fp8

  const CUtensorMap tmap = make_kv_tensor_map<T>(p);

  launch_on_decode_grid(&sm90_decode_kernel<T>, kNumThreads, T::kSmemBytes, "sm90_decode_kernel", p, p, tmap);
}

}  // namespace flashmla_backend::sm90::decode
