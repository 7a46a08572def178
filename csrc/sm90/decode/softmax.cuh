// Online softmax of the sm90 decode kernel: masking, row max, exponentials, rescaling, and the row state
// (running max m, row sums l) the two warpgroups share.
//
// Units: scores S are raw Q.K; the running max `m` and every exponent are in the log2 domain
// (m = max(S) * scale_log2); lse outputs are natural log. The running max of the tile lives in shared memory
// (SharedStorage::row_max, shared by both warpgroups, exchanged in mainloop.cuh); each warpgroup keeps the row
// sums of the probabilities it computed in registers and the two halves are added in the epilogue.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include <cstdint>

#include "common/device.cuh"
#include "sm90/decode/config.h"

namespace flashmla_backend::sm90::decode {

using namespace cute;

// Exponentials: common/device.cuh's fast_exp2 (2^-inf = +0).

// Reductions over the four lanes that hold one row of a wgmma accumulator fragment.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ------------------------------------------------------------------------------------------------
// Fragment helpers. Accumulator fragment of a 64xN wgmma (per thread of the warpgroup):
//   element i: row = 16 * warp + lane / 4 + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * (lane % 4) + (i & 1)
// (PTX "wgmma 64xNx16 D fragment"; checked against CuTe by checks/layout_check.cu). The A-operand
// register fragment of a 64x16 k-slice has the same (row, col) order, so a P tile of 64 keys converts
// element by element into the A fragment of the P V product.
// ------------------------------------------------------------------------------------------------
template <class Frag>
__device__ __forceinline__ void mask_scores(Frag& s, int tok0, int start, const int (&row_end)[2], int lane) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(s); ++i) {
    const int t = tok0 + 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
    const int v = (i >> 1) & 1;
    if (t < start || t >= row_end[v]) s(i) = -INFINITY;
  }
}

template <class Frag>
__device__ __forceinline__ void row_max_quad(const Frag& s, float (&mx)[2]) {
  mx[0] = -INFINITY;
  mx[1] = -INFINITY;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(s); ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s(i));
  mx[0] = quad_max(mx[0]);
  mx[1] = quad_max(mx[1]);
}

// s <- exp2(s * scale_log2 - m_use[row]); returns this thread's partial row sums.
template <class Frag>
__device__ __forceinline__ void exp2_rows(Frag& s, float scale_log2, const float (&m_use)[2], float (&sum)[2]) {
  sum[0] = 0.f;
  sum[1] = 0.f;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(s); ++i) {
    const int v = (i >> 1) & 1;
    s(i) = fast_exp2(fmaf(s(i), scale_log2, -m_use[v]));
    sum[v] += s(i);
  }
}

template <class Frag>
__device__ __forceinline__ void scale_rows(Frag& o, const float (&f)[2]) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(o); ++i) o(i) *= f[(i >> 1) & 1];
}

// New running max from the old one and this block's (unscaled) row max; guarded so that a row that
// has seen no key yet keeps m = -inf and gets finite exponents (exp2(-inf - 0) = 0).
__device__ __forceinline__ void update_max(float m_old, float blk_max, float scale_log2, float& m_new,
                                           float& m_use, float& rescale) {
  m_new = fmaxf(m_old, blk_max * scale_log2);
  m_use = m_new == -INFINITY ? 0.f : m_new;
  rescale = fast_exp2(m_old - m_use);  // m_old = -inf -> 0 (the accumulators are 0 then anyway)
}

// End of a request piece: this thread's partial row sums -> the warpgroup's (quad reduction) -> shared memory,
// where the other warpgroup's half is added by final_row_stats() after a CTA barrier.
template <class SharedStorage>
__device__ __forceinline__ void publish_row_sums(SharedStorage& ss, const int (&row)[2], int wg, int lane,
                                                 float (&row_sum)[2]) {
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < 2; ++v) row_sum[v] = quad_sum(row_sum[v]);
  if ((lane & 3) == 0) {
    ss.row_sum[wg][row[0]] = row_sum[0];
    ss.row_sum[wg][row[1]] = row_sum[1];
  }
}

// Final row sum l (both warpgroups) and running max m of the thread's two rows.
template <class SharedStorage>
__device__ __forceinline__ void final_row_stats(const SharedStorage& ss, const int (&row)[2], float (&l)[2],
                                                float (&m)[2]) {
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < 2; ++v) {
    l[v] = ss.row_sum[0][row[v]] + ss.row_sum[1][row[v]];
    m[v] = ss.row_max[row[v]];
  }
}

}  // namespace flashmla_backend::sm90::decode
