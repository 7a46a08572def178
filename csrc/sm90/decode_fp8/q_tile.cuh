// The Q tile of the sm90 FP8 tensor-core decode kernel, loaded by the 256 consumer threads once per request.
//
// Layout: kQTerms term tiles of (64 rows, 576) e4m3, each nine 64B-swizzled 4 KB pieces (traits.h). Row r of the
// tile is query token r / ngroups, head hk * ngroups + r % ngroups; rows past q_rows are zero. With
// Traits::kStackedTerms one tile holds both terms of 32 query rows (layout.h: stacked_term_row).
//   e4m3 q (fast mode): copied as it is with cp.async (16-byte chunks), issued before the previous request's
//   epilogue so that it lands while the epilogue runs.
//   16-bit q (accurate mode): copied with cp.async into the tile's own bytes, issued at the same point, then split
//   in place row by row, q ~ s (hi + lo) with s a power of two such that max |q| / s lies in (224, 448];
//   hi = e4m3(q / s), lo = e4m3(q / s - hi); s goes to SharedStorage::q_scale.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>

#include <cstdint>
#include <type_traits>

#include "common/device.cuh"
#include "params.h"
#include "sm90/decode/copies.cuh"  // cp_async_16 / commit / wait_all (with memory clobbers), e4m3x2_to_f16x2
#include "sm90/decode_fp8/config.h"
#include "sm90/decode_fp8/layout.h"
#include "sm90/decode_fp8/producer.cuh"
#include "sm90/decode_fp8/traits.h"

namespace flashmla_backend::sm90::decode_fp8 {


// 16-bit q: the 16-column groups of a row that each of its four consumer threads copies and splits.
constexpr int kQGroupsPerThread = kHeadDimK / 16 / 4;  // 9

// Source address of element column `col` (a multiple of 8 for 16-bit q, of 16 for e4m3) of row r of M tile m_block
// (kTileRows query rows a tile), or null for a row past q_rows. Columns 0..511 come from q, 512..575 from q_pe.
template <class QIn, int kTileRows = kBlockM>
__device__ __forceinline__ const QIn* q_row_src(const DecodeParams& p, int req, int m_block, int hk, int r, int col) {
  const int row = m_block * kTileRows + r;
  if (row >= p.q_rows) return nullptr;
  const int s = row / p.ngroups;
  const int h = hk * p.ngroups + (row - s * p.ngroups);
  if (col < kHeadDimV) {
    return reinterpret_cast<const QIn*>(p.q) + int64_t(req) * p.q_stride_b + int64_t(s) * p.q_stride_s +
           int64_t(h) * p.q_stride_h + col;
  }
  return reinterpret_cast<const QIn*>(p.q_pe) + int64_t(req) * p.q_pe_stride_b + int64_t(s) * p.q_pe_stride_s +
         int64_t(h) * p.q_pe_stride_h + (col - kHeadDimV);
}

// 16-bit q: the copy of row r's groups part, part + 4, ... (16 columns, 32 bytes each): the two 16-byte halves of a
// group go where the split puts its hi and lo terms (chunk_offset(r, c) and that + lo_delta), so that the Q region
// holds the 16-bit q exactly (two terms of e4m3 are as many bytes). The thread that copies a group splits it
// (split_q16_row): it reads and overwrites only its own bytes, so the split needs no barrier before it. No commit.
template <class QIn, int kTileRows = kBlockM, class ChunkOffset>
__device__ __forceinline__ void issue_q16_row_copy(const DecodeParams& p, int req, int m_block, int hk, int r,
                                                   int part, uint32_t q_addr, uint32_t lo_delta,
                                                   ChunkOffset&& chunk_offset) {
  static_assert(kHeadDimV % 64 == 0 && kHeadDimK - kHeadDimV == 64, "groups 0..7 of a thread in q, 8 in q_pe");
  // The thread's row in q and in q_pe, found once (the loop stays small: at b = 1 a CTA runs this code once, and
  // instruction fetch is a third of the kernel's stalls there).
  const QIn* q_src = q_row_src<QIn, kTileRows>(p, req, m_block, hk, r, 16 * part);
  const QIn* pe_src = q_row_src<QIn, kTileRows>(p, req, m_block, hk, r, kHeadDimV + 16 * part);
  const bool valid = q_src != nullptr;
#pragma unroll 1
  for (int k = 0; k < kQGroupsPerThread; ++k) {
    const QIn* src = !valid ? reinterpret_cast<const QIn*>(p.q) : k < kQGroupsPerThread - 1 ? q_src + 64 * k : pe_src;
    const uint32_t dst = q_addr + chunk_offset(r, part + 4 * k);
    decode::cp_async_16(dst, src, valid);
    decode::cp_async_16(dst + lo_delta, src + 8, valid);
  }
}

// 16-bit q: where the split puts row r's terms, hi at q16_chunk_offset<T>(r, c) and lo kQ16LoDelta<T> bytes after
// it: two term tiles, or both terms in the stacked tile's rows (Traits::kStackedTerms, layout.h). Four consumer
// threads a row, rows 0 .. T::kTileRows - 1 (q16_row_thread).
template <class T>
__device__ __forceinline__ uint32_t q16_chunk_offset(int r, int c) {
  if constexpr (T::kStackedTerms) {
    return tile_chunk_offset(stacked_term_row(r, 0), c);
  } else {
    return tile_chunk_offset(r, c);
  }
}
template <class T>
constexpr uint32_t kQ16LoDelta = T::kStackedTerms ? kStackedLoDelta : uint32_t(kTileBytes);
template <class T>
__device__ __forceinline__ bool q16_row_thread(int tid) {
  return 4 * T::kTileRows >= kNumConsumerThreads || tid < 4 * T::kTileRows;
}

// The copy of the tile's q, one commit group, issued when the tile is free (before the first request, and after the
// previous request's last wgmma) so that it lands while the previous request's epilogue runs.
//   e4m3 q: the tile's 2304 16-byte chunks, 9 per consumer thread, where the product reads them. The caller waits
//   (cp_async_wait_all), fences the async proxy and synchronizes the consumers before the first wgmma.
//   16-bit q: issue_q16_row_copy, thread tid into row tid / 4 where the split puts its terms (q16_chunk_offset).
template <class T>
__device__ __forceinline__ void issue_q_copy(const DecodeParams& p, int req, int m_block, int hk, uint32_t q_addr,
                                             int tid) {
  if constexpr (T::kQFp8) {
    constexpr int kChunksPerRow = kHeadDimK / 16;  // 36
    CUTLASS_PRAGMA_NO_UNROLL
    for (int idx = tid; idx < kBlockM * kChunksPerRow; idx += kNumConsumerThreads) {
      const int r = idx / kChunksPerRow, c = idx % kChunksPerRow;
      const auto* src = q_row_src<cutlass::float_e4m3_t>(p, req, m_block, hk, r, 16 * c);
      decode::cp_async_16(q_addr + tile_chunk_offset(r, c), src != nullptr ? src : p.q, src != nullptr);
    }
  } else {
    static_assert(T::kQTerms == 2, "the 16-bit q's bytes fill two terms");
    if (q16_row_thread<T>(tid)) {
      issue_q16_row_copy<typename T::QIn, T::kTileRows>(p, req, m_block, hk, tid >> 2, tid & 3, q_addr,
                                                        kQ16LoDelta<T>,
                                                        [](int r, int c) { return q16_chunk_offset<T>(r, c); });
    }
  }
  decode::cp_async_commit();
}

// Two floats to two e4m3 (x0 in the low byte), satfinite, round to nearest even.
__device__ __forceinline__ uint32_t f32x2_to_e4m3x2(float x0, float x1) {
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(x1), "f"(x0));
  return uint32_t(d);
}
// Four floats to four e4m3 bytes of one word (x0 in the lowest byte).
__device__ __forceinline__ uint32_t f32x4_to_e4m3x4(float x0, float x1, float x2, float x3) {
  return f32x2_to_e4m3x2(x0, x1) | (f32x2_to_e4m3x2(x2, x3) << 16);
}
// The two e4m3 terms of y0, y1 (q / s, so |y| <= 448): hi = e4m3(y), lo = e4m3(y - hi), y0's in the low byte of each.
// y - hi is taken in fp16, where it is exact for a 16-bit q: y has at most 11 significant bits (8 for bf16) and hi is
// y to 4, so the difference needs at most 7 bits above y's last one; y itself is exact in fp16 down to 2^-14, and
// below that both terms are zero either way. The same terms as the fp32 difference for every bf16 and fp16 value at
// every power-of-two scale, but for the sign of a zero lo (checked on the CPU with torch's e4m3 and fp16 rounding), in
// two instructions a pair fewer (no widening of hi back to fp32).
// kLoTimes16: lo = e4m3((y - hi) 16) instead (P's second term, mainloop.cuh: p_words; config.h: kPLoFactor), the
// product exact in fp16.
template <bool kLoTimes16 = false>
__device__ __forceinline__ void split_e4m3x2(float y0, float y1, uint32_t& hi, uint32_t& lo) {
  uint16_t h, l;
  uint32_t y16, hb, d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(y1), "f"(y0));
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(y16) : "f"(y1), "f"(y0));
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hb) : "h"(h));
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(y16), "r"(hb));
  if constexpr (kLoTimes16) asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(d), "r"(0x4C004C00u));  // 16.0 a half
  asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(l) : "r"(d));
  hi = h;
  lo = l;
}

// Eight 16-bit values (one 16-byte chunk) to floats.
template <class QIn>
__device__ __forceinline__ void q16x8_to_f32(const uint4& v, float* x) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<QIn, cutlass::bfloat16_t>) {
      x[2 * i] = __uint_as_float(w[i] << 16);
      x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      const __half2 h = *reinterpret_cast<const __half2*>(&w[i]);
      x[2 * i] = __low2float(h);
      x[2 * i + 1] = __high2float(h);
    }
  }
}

// 16-bit q: the split into two e4m3 terms, in place, after issue_q_copy's copy landed (cp_async_wait_all). Four
// consumer threads per row (tid / 4 = row); thread part tid % 4 handles the 16-column groups part, part + 4, ...
// Two passes over the thread's 18 chunks in shared memory (the row's max, then the split). Before, both passes read
// q from global memory, a few loads in flight a thread, a round trip to L2 each time (the accurate mode's start of a
// request; holding the row's chunks in registers instead made ptxas spill values that live across the main loop).
// Runs when no accumulator is live; the caller fences the async proxy and synchronizes the consumers.
template <class QIn>
__device__ __forceinline__ void load_q16_group(uint32_t addr, uint32_t lo_delta, float (&x)[16]) {
  uint4 v0, v1;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v0.x), "=r"(v0.y), "=r"(v0.z), "=r"(v0.w) : "r"(addr) : "memory");
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v1.x), "=r"(v1.y), "=r"(v1.z), "=r"(v1.w) : "r"(addr + lo_delta) : "memory");
  q16x8_to_f32<QIn>(v0, x);
  q16x8_to_f32<QIn>(v1, x + 8);
}

// Row r's split by its four threads (lanes 4 k .. 4 k + 3 of a warp; part = lane % 4): the row's max over the
// thread's groups and the other three threads', the scale, the terms in place (hi at chunk_offset(r, c), lo at that
// + lo_delta). The scale goes to q_scale[r].
template <class QIn, class ChunkOffset>
__device__ __forceinline__ void split_q16_row(uint32_t q_addr, uint32_t lo_delta, ChunkOffset&& chunk_offset, int r,
                                              int part, float* q_scale) {
  float amax = 0.f;
#pragma unroll 3
  for (int k = 0; k < kQGroupsPerThread; ++k) {
    float x[16];
    load_q16_group<QIn>(q_addr + chunk_offset(r, part + 4 * k), lo_delta, x);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(x[i]));
  }
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  // inv = 2^floor(log2(448 / amax)): max |q| * inv in (224, 448]. A zero row keeps inv = 1; an infinite amax gives
  // inv = 0 and NaN terms (a row with inf in q is NaN, as with NaN). The exponent stops at 126, where 1 / inv is still
  // a normal float: a row with max |q| below 448 x 2^-127 (about 2.6e-36) gets terms below 224, which keep e4m3's
  // precision down to fp32's subnormal values (without the cap inv was infinite and such a row NaN).
  float inv = 1.f;
  if (amax > 0.f) inv = exp2f(fminf(floorf(log2f(kE4m3Max / amax)), 126.f));
  if (part == 0) q_scale[r] = 1.f / inv;
#pragma unroll 3
  for (int k = 0; k < kQGroupsPerThread; ++k) {
    const uint32_t off = q_addr + chunk_offset(r, part + 4 * k);
    float x[16];
    load_q16_group<QIn>(off, lo_delta, x);
    uint32_t hi[4], lo[4];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 4; ++i) {
      uint32_t h0, l0, h1, l1;
      split_e4m3x2(x[4 * i] * inv, x[4 * i + 1] * inv, h0, l0);
      split_e4m3x2(x[4 * i + 2] * inv, x[4 * i + 3] * inv, h1, l1);
      hi[i] = h0 | (h1 << 16);
      lo[i] = l0 | (l1 << 16);
    }
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(off), "r"(hi[0]), "r"(hi[1]), "r"(hi[2]),
                 "r"(hi[3])
                 : "memory");
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(off + lo_delta), "r"(lo[0]), "r"(lo[1]),
                 "r"(lo[2]), "r"(lo[3])
                 : "memory");
  }
}

template <class T>
__device__ __forceinline__ void split_q_tile(uint32_t q_addr, float* q_scale, int tid) {
  static_assert(!T::kQFp8 && T::kQTerms == 2, "16-bit q in two terms only");
  if (q16_row_thread<T>(tid)) {
    split_q16_row<typename T::QIn>(q_addr, kQ16LoDelta<T>, [](int r, int c) { return q16_chunk_offset<T>(r, c); },
                                   tid >> 2, tid & 3, q_scale);
  }
}

}  // namespace flashmla_backend::sm90::decode_fp8
