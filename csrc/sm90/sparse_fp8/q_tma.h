// The sparse kernel's Q tile copied by the tensor-memory accelerator instead of cp.async: a candidate for the copy
// of a later row piece's tile, which the lead warpgroup now issues as 36 cp.async a thread at the piece's last block
// (in ncu, 5-7% of the kernel's samples at b128 top-k 128, half of them MIO throttle: docs/perf/journal.md,
// 2026-12-02 afternoon). One thread issues the tile's copies, completing on an mbarrier. Used by the kernel only in a
// build with FMLA_SPARSE_Q_TMA (below); checks/q_tma_probe.cu checks on a GPU that the maps below place q exactly
// where q_slot_copy does.
//
// Where q_slot_copy puts head row r's 16-bit latent channels (common.cuh): channel 64 P + 16 k + 8 h + e (piece P
// 0..7, chunk k 0..3 of the piece, half h 0..1, e 0..7) at byte h * kLatentBytes + tile_chunk_offset(r, 4 P + k) +
// 2 e: the 16 bytes of (P, k, h) are one 16-byte chunk of the 64B-swizzled piece P, half h in the tile's hi or lo
// region. As a tensor of q's rows that is five dimensions, fastest first: e (8 values, the chunk), k (4, 32 bytes
// apart), the row (q's row stride), P (8, 128 bytes apart), h (2, 16 bytes apart); a box of (8, 4, 64, 8, 2) is laid
// out in shared memory as h, P, row, k, e from slowest to fastest, i.e. h * 32 KB + P * 4 KB + row * 64 + k * 16 +
// 2 e, which the 64B swizzle (16-byte chunk k XOR bits 1..2 of the row) turns into tile_chunk_offset. The strides of
// P and h are smaller than the row's, and h's than k's. The two-map form below (one 4-dimensional map a half, the
// second at q + 8) does the same with two copies and without h's dimension; P's stride is still below the row's in
// it. If the driver refuses both (or the swizzle is not a function of the shared-memory address alone), one
// 3-dimensional map (e, k, row) a piece and half, 16 copies, remains. The rope: (64 values, the row) with a box of
// (64, 64) and the 128B swizzle is sw128_offset's tile.
//
// The row dimension runs over every query row of the call (request r's head h is row r * h_q + h), so q's request
// stride must be h_q times its head stride; a tile's rows past the last row of the call are filled with zeros. With
// h_q a multiple of 64 (the kernel's tile) no tile reaches into the next request's heads.
//
// In the kernel (a build with FMLA_SPARSE_Q_TMA=5 for the five-dimensional form, =4 for the two-map form; not yet
// timed, the default build has none of it) warpgroup 0's thread 0 copies every later row piece's tile this way; the
// first tile stays with q_slot_copy (both warpgroups, at the CTA's start).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "common/tensor_map.h"
#include "sm90/sparse_fp8/layout.h"

namespace flashmla_backend::sm90::sparse_fp8 {

constexpr uint32_t kQTmaLatentBytes = 2 * kLatentBytes;  // the tile's two regions, 64 KB
constexpr uint32_t kQTmaRopeBytes = kRopeBytes;          // 8 KB

// The maps a launch passes (the kernel's third parameter in a FMLA_SPARSE_Q_TMA build): latent[0] the
// five-dimensional map, or latent[0] and latent[1] the two halves' maps.
struct QTmaMaps {
  CUtensorMap latent[2];
  CUtensorMap rope;
};

// Whether q (rows of row_stride values, 16-bit) can be read by the maps: 16-byte aligned rows.
inline bool q_tma_fits(const void* q, int64_t row_stride, const void* q_pe, int64_t pe_row_stride) {
  return reinterpret_cast<std::uintptr_t>(q) % 16 == 0 && reinterpret_cast<std::uintptr_t>(q_pe) % 16 == 0 &&
         row_stride > 0 && row_stride % 8 == 0 && pe_row_stride > 0 && pe_row_stride % 8 == 0;
}

// The five-dimensional latent map (header), bf16 values.
inline CUresult encode_q_latent_map(CUtensorMap* map, const void* q, int64_t rows, int64_t row_stride) {
  const cuuint64_t dims[5] = {8u, 4u, cuuint64_t(rows), 8u, 2u};
  const cuuint64_t strides[4] = {32u, cuuint64_t(row_stride) * 2u, 128u, 16u};
  const cuuint32_t box[5] = {8u, 4u, 64u, 8u, 2u};
  const cuuint32_t elem_strides[5] = {1u, 1u, 1u, 1u, 1u};
  return get_encode_tiled()(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 5, const_cast<void*>(q), dims, strides, box,
                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_64B,
                            CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}
// The two-map form: half h's map at q + 8 h (header), four dimensions (e, k, row, P).
inline CUresult encode_q_latent_half_map(CUtensorMap* map, const void* q, int64_t rows, int64_t row_stride, int h) {
  const cuuint64_t dims[4] = {8u, 4u, cuuint64_t(rows), 8u};
  const cuuint64_t strides[3] = {32u, cuuint64_t(row_stride) * 2u, 128u};
  const cuuint32_t box[4] = {8u, 4u, 64u, 8u};
  const cuuint32_t elem_strides[4] = {1u, 1u, 1u, 1u};
  void* base = const_cast<uint16_t*>(static_cast<const uint16_t*>(q)) + 8 * h;
  return get_encode_tiled()(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, base, dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_64B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}
// The rope map: 64 bf16 a row, 128B swizzle.
inline CUresult encode_q_rope_map(CUtensorMap* map, const void* q_pe, int64_t rows, int64_t row_stride) {
  const cuuint64_t dims[2] = {64u, cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(row_stride) * 2u};
  const cuuint32_t box[2] = {64u, 64u};
  const cuuint32_t elem_strides[2] = {1u, 1u};
  return get_encode_tiled()(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(q_pe), dims, strides, box,
                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

#if defined(__CUDACC__)
// The copies of the tile whose first row is row0, completing on the mbarrier at bar (shared addresses; the tile's
// regions 1024-byte aligned). By one thread, after its arrive.expect_tx of kQTmaLatentBytes + kQTmaRopeBytes.
__device__ __forceinline__ void q_tma_latent(const CUtensorMap* map, uint32_t dst, uint32_t bar, int row0) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %3, %4, %3, "
      "%3}], [%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(0), "r"(row0)
      : "memory");
}
__device__ __forceinline__ void q_tma_latent_half(const CUtensorMap* map, uint32_t dst, uint32_t bar, int row0) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %3, %4, "
      "%3}], [%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(0), "r"(row0)
      : "memory");
}
__device__ __forceinline__ void q_tma_rope(const CUtensorMap* map, uint32_t dst, uint32_t bar, int row0) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(0), "r"(row0)
      : "memory");
}
#endif

}  // namespace flashmla_backend::sm90::sparse_fp8
