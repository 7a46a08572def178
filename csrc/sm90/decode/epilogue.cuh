// Epilogue of the sm90 decode kernel: a request piece's output rows. Unsplit requests get O / l (in the output
// dtype) and lse; a split writes its partial O / l (fp32) and lse into o_accum / lse_accum for the combine
// kernel. Each warpgroup stores its own 256 output columns; warpgroup 0 writes lse.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include <cstdint>
#include <type_traits>

#include "common/device.cuh"
#include "params.h"
#include "sm90/decode/config.h"
#include "sm90/decode/tile_work.cuh"

namespace flashmla_backend::sm90::decode {

using namespace cute;

// Interleaved accumulator columns (T::kOutColumnsInterleaved; sm90/decode_fp8/layout.h: vt_row_column): within each
// group of 16, column i < 8 holds value column 2 i and column 8 + i value column 2 i + 1. A thread's values of
// columns 16 a + 2 t + {0, 1} and 16 a + 8 + 2 t + {0, 1} (t = lane % 4) are then the four consecutive value
// columns 16 a + 4 t .. + 3: value column 16 a + 4 t + k of the thread's row v is fragment value
// interleaved_value_index(a, v, k). (decode_fp8/checks/layout_check.cu checks it against CuTe.)
__host__ __device__ __forceinline__ constexpr int interleaved_value_index(int a, int v, int k) {
  return 8 * a + 2 * v + 4 * (k & 1) + (k >> 1);
}
template <class FragO>
__device__ __forceinline__ void interleaved_quad(const FragO& tOrO, int a, int v, float inv, float (&x)[4]) {
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < 4; ++k) x[k] = tOrO(interleaved_value_index(a, v, k)) * inv;
}

// Output rows of a thread's two accumulator rows (g and g + 8): both, unless the Traits say kOutRowsPerThread = 1
// (the FP8 accurate mode's stacked Q tile, whose two rows are one query row computed twice).
template <class T, class = void>
struct OutRowsPerThread : std::integral_constant<int, 2> {};
template <class T>
struct OutRowsPerThread<T, std::void_t<decltype(T::kOutRowsPerThread)>>
    : std::integral_constant<int, T::kOutRowsPerThread> {};

// l: final row sums, m: running max (log2 domain, scaled) of the thread's two rows (softmax.cuh).
// v_scale: with T::KvFormat::kScaled (the e4m3 cache of the FP8 tensor-core kernel), the value scale of this request
// and kv head (V = V_stored * v_scale), applied once here (the split accumulators carry it too, so the combine does
// not see it); unused otherwise.
template <class T, class FragO>
__device__ __forceinline__ void store_output(const DecodeParams& p, const RequestPiece& w, const RowInfo& ri,
                                             int m_block, int hk, int wg, int tid, const FragO& tOrO,
                                             const float (&l)[2], const float (&m)[2], float v_scale) {
  using Element = typename T::Out;
  const int lane = tid & 31;
  const int col0 = wg * kHalfDimV + 2 * (lane & 3);
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < OutRowsPerThread<T>::value; ++v) {
    const int r = m_block * TileRowsOf<T>::value + ri.row[v];
    if (r >= p.q_rows) continue;
    const int s = r / p.ngroups;
    const int h = hk * p.ngroups + (r - s * p.ngroups);
    const bool has_key = row_has_key(l[v]);  // the empty-row rule (common/device.cuh): NaN rows are not empty
    const float inv = has_key ? (T::KvFormat::kScaled ? v_scale / l[v] : 1.f / l[v]) : 0.f;
    if (!w.split) {
      Element* out = reinterpret_cast<Element*>(p.out) + int64_t(w.req) * p.out_stride_b + int64_t(s) * p.out_stride_s +
                     int64_t(h) * p.out_stride_h + col0;
      if constexpr (T::kOutColumnsInterleaved) {
        CUTLASS_PRAGMA_UNROLL
        for (int a = 0; a < size(tOrO) / 8; ++a) {
          float x[4];
          interleaved_quad(tOrO, a, v, inv, x);
          Element quad[4] = {static_cast<Element>(x[0]), static_cast<Element>(x[1]), static_cast<Element>(x[2]),
                             static_cast<Element>(x[3])};
          *reinterpret_cast<uint2*>(out + 16 * a + 2 * (lane & 3)) = *reinterpret_cast<const uint2*>(quad);
        }
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < size(tOrO) / 4; ++c) {
          const int i = 4 * c + 2 * v;
          Element pair[2] = {static_cast<Element>(tOrO(i) * inv), static_cast<Element>(tOrO(i + 1) * inv)};
          *reinterpret_cast<uint32_t*>(out + 8 * c) = *reinterpret_cast<const uint32_t*>(pair);
        }
      }
      if (wg == 0 && (lane & 3) == 0) {
        p.lse[int64_t(w.req) * p.lse_stride_b + int64_t(h) * p.lse_stride_h + s] =
            has_key ? row_lse(m[v], l[v]) : kNoKeyLse;
      }
    } else {
      const int64_t row_id = (int64_t(w.split_id) * p.num_heads_kv + hk) * p.q_rows + r;
      float* oacc = p.o_accum + row_id * kHeadDimV + col0;
      if constexpr (T::kOutColumnsInterleaved) {
        CUTLASS_PRAGMA_UNROLL
        for (int a = 0; a < size(tOrO) / 8; ++a) {
          float x[4];
          interleaved_quad(tOrO, a, v, inv, x);
          *reinterpret_cast<float4*>(oacc + 16 * a + 2 * (lane & 3)) = make_float4(x[0], x[1], x[2], x[3]);
        }
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < size(tOrO) / 4; ++c) {
          const int i = 4 * c + 2 * v;
          *reinterpret_cast<float2*>(oacc + 8 * c) = make_float2(tOrO(i) * inv, tOrO(i + 1) * inv);
        }
      }
      if (wg == 0 && (lane & 3) == 0) {
        p.lse_accum[row_id] = has_key ? row_lse(m[v], l[v]) : kNoKeySplitLse;
      }
    }
  }
}

}  // namespace flashmla_backend::sm90::decode
