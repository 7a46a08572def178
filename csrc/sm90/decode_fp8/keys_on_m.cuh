// The accurate mode's keys-on-M kernel (keys_on_m.h: TraitsKM; docs/kernel-design.md, "The accurate mode for few
// query rows"): the consumer warpgroup, its epilogue and the __global__ function. The producer warpgroup is
// producer.cuh's (KV copies, V widened to fp16).
//
// A thread's accumulators (one warpgroup, w = warp, g = lane / 4, c = lane % 4):
//   S^T (64 keys x 2 R): value i is key 16 w + g + 8 ((i >> 1) & 1) and column 8 (i >> 2) + 2 c + (i & 1); the
//     columns R.. are the lo terms of the columns ..R-1, so the score of (key, row) is value i + value i + R / 2
//     (i < R / 2), and the thread's rows are n(q) = 8 (q >> 1) + 2 c + (q & 1), q = 2 (i >> 2) + (i & 1) < R / 4.
//   O^T (kVParts parts of kPartCols value columns x R): value v of m64 tile t of part p is value column
//     kPartCols p + 64 t + 16 w + g + 8 ((v >> 1) & 1) of row 8 (v >> 2) + 2 c + (v & 1).
// checks/layout_check.cu compares both with CuTe's partitions.
//
// Per block g (S^T of g in registers): the scores (hi + lo), the mask, each row's max over the block's keys (the four
// lanes that share c hold a column's keys in a warp; the four warps meet in shared memory), P = exp2(s scale - m +
// 2^8 range) in fp16, the previous block's P V waited for (its V parts released, O rescaled), P^T written to shared
// memory (one buffer), then the next block's S^T and O^T += V^T P^T part by part: the tensor cores run this block's
// P V while the warps do the softmax of the next block.
#pragma once

#include <cuda_fp16.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include <cstdint>

#include "common/device.cuh"
#include "common/measure.h"
#include "params.h"
#include "sm90/decode/softmax.cuh"    // update_max
#include "sm90/decode/tile_work.cuh"  // RequestPiece
#include "sm90/decode_fp8/config.h"
#include "sm90/decode_fp8/keys_on_m.h"
#include "sm90/decode_fp8/layout.h"
#include "sm90/decode_fp8/mainloop.cuh"  // opaque_zero, warp_arrive
#include "sm90/decode_fp8/producer.cuh"
#include "sm90/decode_fp8/q_tile.cuh"

namespace flashmla_backend::sm90::decode_fp8 {

using namespace cute;

// The row of column slot q (< R / 4) of a thread with c = lane % 4.
__device__ __forceinline__ constexpr int km_row(int q, int c) { return 8 * (q >> 1) + 2 * c + (q & 1); }
// The column slot of accumulator value i (S^T's first R / 2 values, or an O^T tile's values).
__device__ __forceinline__ constexpr int km_slot(int i) { return 2 * (i >> 2) + (i & 1); }

__device__ __forceinline__ void km_sync(KmBarriers id) {
  cutlass::arch::NamedBarrier::sync(kThreadsPerWarpGroup, uint32_t(id));
}

// The Q copy of a request (one commit group): four threads a row, rows 0..R-1. An e4m3 q lands where S^T reads it;
// a 16-bit q where its split puts the terms (q_tile.cuh: issue_q16_row_copy).
template <class T>
__device__ __forceinline__ void km_issue_q_copy(const DecodeParams& p, int req, int hk, uint32_t q_addr, int tid) {
  if (tid < 4 * T::kRows) {
    const int r = tid >> 2, part = tid & 3;
    if constexpr (T::kQFp8) {
      CUTLASS_PRAGMA_NO_UNROLL
      for (int c = part; c < kHeadDimK / 16; c += 4) {
        const auto* src = q_row_src<cutlass::float_e4m3_t>(p, req, 0, hk, r, 16 * c);
        decode::cp_async_16(q_addr + km_q_chunk_offset(T::kQRows, r, c), src != nullptr ? src : p.q, src != nullptr);
      }
    } else {
      issue_q16_row_copy<typename T::QIn>(p, req, 0, hk, r, part, q_addr, km_q_lo_delta(T::kRows),
                                          [](int rr, int c) { return km_q_chunk_offset(T::kQRows, rr, c); });
    }
  }
  decode::cp_async_commit();
}

// S^T = K Q^T of block g (stage g % kStages; a 16-bit q's hi and lo terms in columns of their own); one commit
// group. All nine pieces are waited for before the first wgmma (mainloop.cuh: qk_block says why).
template <class T, class FragS>
__device__ __forceinline__ void km_qk_block(typename T::SharedStorage& ss, int tid, uint32_t g, FragS& tSrS) {
  using E = typename T::Element;
  const int stage = int(stage_of(g, T::kStages));
  wait_kv_block<T>(ss, g);
  typename T::TiledMmaS mma;
  auto thr = mma.get_slice(tid);
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  const uint32_t z = opaque_zero();
  Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<E*>(ss.kv.data() + stage * kTileBytes) + z),
                          typename T::SmemLayoutTile{});
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<E*>(ss.q.data()) + z), typename T::SmemLayoutQ{});
  Tensor tSrK = thr.partition_fragment_A(sK);  // (MMA, 1, 18)
  Tensor tSrQ = thr.partition_fragment_B(sQ);  // (MMA, 1, 18)
  warpgroup_fence_operand(tSrS);
  warpgroup_arrive();
  CUTLASS_PRAGMA_UNROLL
  for (int kb = 0; kb < size<2>(tSrK); ++kb) {
    cute::gemm(mma, tSrK(_, _, kb), tSrQ(_, _, kb), tSrS);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(tSrS);
}

// O^T_part += V_part^T P^T of block g; one commit group.
template <class T, class FragO>
__device__ __forceinline__ void km_pv_part(typename T::SharedStorage& ss, int tid, int part, uint32_t g, FragO& tOrO) {
  using E = typename T::PvElement;
  typename T::TiledMmaO mma;
  auto thr = mma.get_slice(tid);
  const uint32_t z = opaque_zero();
  Tensor sV = make_tensor(make_smem_ptr(reinterpret_cast<E*>(ss.vt.data() + T::vt_slot(part, g) * T::kVSlotBytes) + z),
                          typename T::SmemLayoutVPart{});  // (kPartCols, 64)
  Tensor sP = make_tensor(make_smem_ptr(reinterpret_cast<E*>(ss.pt.data()) + z),
                          typename T::SmemLayoutPt{});  // (R, 64)
  Tensor tOrV = thr.partition_fragment_A(sV);  // (MMA, kPartCols / 64, k steps: 4 of k16 or 2 of k32)
  Tensor tOrP = thr.partition_fragment_B(sP);  // (MMA, 1, k steps)
  mma.accumulate_ = GMMA::ScaleOut::One;
  warpgroup_fence_operand(tOrO);
  warpgroup_arrive();
  CUTLASS_PRAGMA_UNROLL
  for (int kb = 0; kb < size<2>(tOrV); ++kb) cute::gemm(mma, tOrV(_, _, kb), tOrP(_, _, kb), tOrO);
  warpgroup_commit_batch();
  warpgroup_fence_operand(tOrO);
}

template <class T>
__device__ __forceinline__ void km_wait_v(typename T::SharedStorage& ss, int part, uint32_t g) {
  consumer_wait(ss.vt_full[T::vt_slot(part, g)], T::vt_use(part, g) & 1u);
}
template <class T>
__device__ __forceinline__ void km_release_v(typename T::SharedStorage& ss, int part, uint32_t g, int lane) {
  warp_arrive(T::vt_empty_of(ss, T::vt_slot(part, g), T::vt_use(part, g)), lane);
}

// A step's P V parts: the order it issues them in, and how many of them (the first in that order) the step's end waits
// for with the next S^T, so that their slots go back to the producer a step before the others (the slot rings are
// short). The first step order (kAhead false): parts in order, with quarters the first two (committed before the next
// S^T). The other (keys_on_m.h: kStepAhead): the parts with the shorter ring first (V halves in rings of 2 + 1: the
// second half), half of them early.
template <class T, bool kAhead>
__device__ __forceinline__ constexpr int km_part(int j) {
  return kAhead && T::kVParts == 2 && T::kRingSecond < T::kRingFirst ? T::kVParts - 1 - j : j;
}
template <class T, bool kAhead>
constexpr int km_early_parts = kAhead ? T::kVParts / 2 : (T::kVParts == 4 ? 2 : 0);

// The wait for all of the previous block's P V products, then the release of its parts that the previous step's end
// did not release (km_early_parts). g_prev: the previous block (has_prev: there is one in this piece).
template <class T, bool kAhead>
__device__ __forceinline__ void km_release_done_parts(typename T::SharedStorage& ss, uint32_t g_prev, bool has_prev,
                                                      int lane) {
  warpgroup_wait<0>();
  if (has_prev) {
    CUTLASS_PRAGMA_UNROLL
    for (int j = km_early_parts<T, kAhead>; j < T::kVParts; ++j) {
      km_release_v<T>(ss, km_part<T, kAhead>(j), g_prev, lane);
    }
  }
}

// The end of the step of block g: with a next block, the wait for its S^T and this block's early parts (their slots
// go back; the others stay in flight), then the next block's KV stage; without one, the wait for everything and
// every part's release.
template <class T, bool kAhead, bool kNext, class FragS, class FragO>
__device__ __forceinline__ void km_step_end(typename T::SharedStorage& ss, uint32_t g, int lane, FragS& tSrS,
                                            FragO (&o)[T::kVParts]) {
  constexpr int kEarlyN = km_early_parts<T, kAhead>;
  if constexpr (kNext) {
    warpgroup_wait<T::kVParts - kEarlyN>();  // the next S^T and the early parts
    warpgroup_fence_operand(tSrS);
    warp_arrive(ss.kv_empty[stage_of(g + 1, T::kStages)], lane);
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kEarlyN; ++j) {
      warpgroup_fence_operand(o[km_part<T, kAhead>(j)]);
      km_release_v<T>(ss, km_part<T, kAhead>(j), g, lane);
    }
  } else {
    warpgroup_wait<0>();
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < T::kVParts; ++k) {
      warpgroup_fence_operand(o[k]);
      km_release_v<T>(ss, k, g, lane);
    }
  }
}

// The fast mode's P^T in e4m3, keys in V^T's order (layout.h: vt_kprime_of_key): within a warp's 16 keys, key
// 2 t + b + 8 h sits at k' 4 t + b + 2 h, so the four bytes at k' 4 t .. + 3 of a row are keys 2 t, 2 t + 1, 2 t + 8,
// 2 t + 9: the values (h = 0, 1) of the lanes with g = 2 t and g = 2 t + 1 (lanes l and l ^ 4). Each lane packs its
// two values of a row slot into 16 bits, the pair of lanes swaps one slot's, and the even lane writes the words of the
// even slots, the odd lane those of the odd ones: word k is row slot 2 k + (g odd).
template <int kSlots>
__device__ __forceinline__ void km_pt8_words(const float (&pv)[kSlots * 2], int lane, uint32_t (&w)[kSlots / 2]) {
  const bool odd = (lane >> 2) & 1;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < kSlots / 2; ++k) {
    // slot q: values i0 = 4 (q >> 1) + (q & 1) (h = 0) and i0 + 2 (h = 1)
    const int q0 = 2 * k, q1 = 2 * k + 1;
    const int i00 = 4 * (q0 >> 1) + (q0 & 1), i10 = 4 * (q1 >> 1) + (q1 & 1);
    const uint32_t own0 = f32x2_to_e4m3x2(pv[i00], pv[i00 + 2]);  // slot q0: (h 0, h 1)
    const uint32_t own1 = f32x2_to_e4m3x2(pv[i10], pv[i10 + 2]);  // slot q1
    const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? own0 : own1, 4);
    // even lane: slot q0, bytes (own h0, partner h0, own h1, partner h1); odd lane: slot q1, the partner's first
    w[k] = odd ? __byte_perm(got, own1, 0x5140) : __byte_perm(own0, got, 0x5140);
  }
}

// O^T rows times sc (per column slot), skipped by a warp whose rows all kept their max.
template <class FragO, int kSlots>
__device__ __forceinline__ void km_rescale(FragO& o, const float (&sc)[kSlots]) {
  bool one = true;
  CUTLASS_PRAGMA_UNROLL
  for (int q = 0; q < kSlots; ++q) one = one && sc[q] == 1.f;
  if (__all_sync(0xffffffffu, one)) return;
  CUTLASS_PRAGMA_UNROLL
  for (int t = 0; t < size<1>(o); ++t) {
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < size<0>(o); ++v) o(v, t, 0) *= sc[km_slot(v)];
  }
}

// Words of P^T a thread stores for a block: fp16 pairs of rows (accurate), or e4m3 quads (fast: km_pt8_words).
template <class T>
constexpr int km_pt_words = T::kQFp8 ? T::kRows / 8 : T::kRows / 4;

// A block's scores s (hi + lo) masked, and each row's max over the block's keys: the thread's keys, the lanes that
// share c (a column's keys in a warp), then the four warps in shared memory (kColMax). The running max m takes the
// block's (decode::update_max); sc: O's rescale, off: P's exponent offset (P = exp2(s sl2 + off)).
template <class T>
__device__ __forceinline__ void km_block_max(typename T::SharedStorage& ss, const decode::RequestPiece& w, int tok0,
                                             int key_base, const int (&row_end)[T::kRows / 4],
                                             const float (&sl2)[T::kRows / 4], int lane, int warp,
                                             float (&s)[T::kRows / 2], float (&m)[T::kRows / 4],
                                             float (&sc)[T::kRows / 4], float (&off)[T::kRows / 4]) {
  constexpr int kSlots = T::kRows / 4, kVals = T::kRows / 2;
  const int c = lane & 3;
  if (tok0 < w.start || tok0 + kBlockN > w.min_row_end) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kVals; ++i) {
      const int t = tok0 + key_base + 8 * ((i >> 1) & 1);
      if (t < w.start || t >= row_end[km_slot(i)]) s[i] = -INFINITY;
    }
  }
  float mx[kSlots];
  CUTLASS_PRAGMA_UNROLL
  for (int q = 0; q < kSlots; ++q) mx[q] = -INFINITY;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kVals; ++i) mx[km_slot(i)] = fmaxf(mx[km_slot(i)], s[i]);
  CUTLASS_PRAGMA_UNROLL
  for (int q = 0; q < kSlots; ++q) {
    mx[q] = fmaxf(mx[q], __shfl_xor_sync(0xffffffffu, mx[q], 4));
    mx[q] = fmaxf(mx[q], __shfl_xor_sync(0xffffffffu, mx[q], 8));
    mx[q] = fmaxf(mx[q], __shfl_xor_sync(0xffffffffu, mx[q], 16));
  }
  if (lane < 4) {
    CUTLASS_PRAGMA_UNROLL
    for (int q = 0; q < kSlots; ++q) ss.col_max[warp][km_row(q, c)] = mx[q];
  }
  km_sync(KmBarriers::kColMax);
  CUTLASS_PRAGMA_UNROLL
  for (int q = 0; q < kSlots; ++q) {
    const int n = km_row(q, c);
    const float bm = fmaxf(fmaxf(ss.col_max[0][n], ss.col_max[1][n]), fmaxf(ss.col_max[2][n], ss.col_max[3][n]));
    float m_new, m_use;
    decode::update_max(m[q], bm, sl2[q], m_new, m_use, sc[q]);
    m[q] = m_new;
    off[q] = kPScaleLog2 - m_use;
  }
}

// P = exp2(s sl2 - m + 2^8 range) packed for P^T: fp16 (rows n, n + 1 of a key: one word), or e4m3
// (km_pt8_words); the row sums l take the block's (this thread's keys only).
template <class T>
__device__ __forceinline__ void km_block_p(const float (&s)[T::kRows / 2], const float (&sl2)[T::kRows / 4],
                                           const float (&off)[T::kRows / 4], const float (&sc)[T::kRows / 4],
                                           int lane, uint32_t (&pw)[km_pt_words<T>], float (&l)[T::kRows / 4]) {
  constexpr int kSlots = T::kRows / 4, kVals = T::kRows / 2;
  float pv[kVals], sum[kSlots];
  CUTLASS_PRAGMA_UNROLL
  for (int q = 0; q < kSlots; ++q) sum[q] = 0.f;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kVals; ++i) {
    pv[i] = fast_exp2(fmaf(s[i], sl2[km_slot(i)], off[km_slot(i)]));
    sum[km_slot(i)] += pv[i];
  }
  if constexpr (T::kQFp8) {
    km_pt8_words<kSlots>(pv, lane, pw);
  } else {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kVals; i += 2) {
      const __half2 h = __floats2half2_rn(pv[i], pv[i + 1]);
      pw[i / 2] = *reinterpret_cast<const uint32_t*>(&h);
    }
  }
  CUTLASS_PRAGMA_UNROLL
  for (int q = 0; q < kSlots; ++q) l[q] = l[q] * sc[q] + sum[q];
}

// This thread's words of P^T (the caller has made sure no P V reads the buffer any more), fenced for wgmma.
template <class T>
__device__ __forceinline__ void km_store_pt(typename T::SharedStorage& ss, const uint32_t (&pw)[km_pt_words<T>],
                                            int lane, int warp, int c, int key_base) {
  constexpr int R = T::kRows;
  const uint32_t pt = cute::cast_smem_ptr_to_uint(ss.pt.data());
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < km_pt_words<T>; ++k) {
    uint32_t addr;
    if constexpr (T::kQFp8) {
      // Word k: row km_row(2 k + (g odd), c), k' 16 w + 4 (g / 2) .. + 3 (km_pt8_words).
      const int kp = 16 * warp + 4 * ((lane >> 2) >> 1);
      addr = pt + sw64_offset(km_row(2 * k + ((lane >> 2) & 1), c), kp >> 4) + uint32_t(kp & 15);
    } else {
      const int i = 2 * k;
      addr = pt + km_pt_offset(R, 8 * (i >> 2) + 2 * c, key_base + 8 * ((i >> 1) & 1));
    }
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(pw[k]) : "memory");
  }
  cutlass::arch::fence_view_async_shared();  // P^T is read by wgmma
}

// One request piece: the blocks g_base .. g_base + padded_blocks - 1 (producer.cuh: for_each_block walks the same).
// m, l: the thread's rows' running max (log2 domain, P's range included) and row sums (this thread's keys only).
template <class T, bool kAhead, class FragO>
__device__ __forceinline__ void km_mainloop(typename T::SharedStorage& ss, const decode::RequestPiece& w,
                                            const int (&row_end)[T::kRows / 4], const float (&sl2)[T::kRows / 4],
                                            int tid, uint32_t g_base, FragO (&o)[T::kVParts],
                                            float (&m)[T::kRows / 4], float (&l)[T::kRows / 4]) {
  constexpr int R = T::kRows, kSlots = R / 4, kVals = R / 2, kParts = T::kVParts;
  // Quarters (first order): the first two parts' P V is committed before the next block's S^T, so that the wait for
  // that S^T also finds them done and their slots go back to the producer a block earlier than the rest (the slots
  // are rings of one). A wait for fewer groups in the middle of the softmax instead made ptxas serialize every wgmma
  // (C7514).
  constexpr int kEarly = km_early_parts<T, false>;
  const int lane = tid & 31, warp = tid >> 5, c = lane & 3;
  const int key_base = 16 * warp + (lane >> 2);  // the thread's keys in a block: key_base and key_base + 8
  const int nblk = padded_blocks(w.num_blocks);
  if (nblk == 0) {
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kParts; ++k) clear(o[k]);
    return;
  }
  typename T::TiledMmaS mma_s;
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockN>, Int<T::kQRows>>{});  // R floats
  km_qk_block<T>(ss, tid, g_base, tSrS);
  warpgroup_wait<0>();
  warpgroup_fence_operand(tSrS);
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < kParts; ++k) clear(o[k]);  // here, not before the first S^T (mainloop.cuh: mainloop_wg0 says why)
  warp_arrive(ss.kv_empty[stage_of(g_base, T::kStages)], lane);

  // A step (block b). The first order: the block's P and P^T, the previous block's P V waited for, then this block's
  // P V with the next S^T among its parts. The other (kAhead): the next block's S^T is issued as soon as this block's
  // row maxima are known and the previous block's P V is done (O rescaled with nothing in flight), so that it runs
  // during this block's P, its P^T store and barriers and its P V issue.
  auto step = [&](auto next_c, int b) CUTLASS_LAMBDA_FUNC_INLINE {
    constexpr bool kNext = decltype(next_c)::value;  // block b + 1 exists
    const uint32_t g = g_base + uint32_t(b);
    const int tok0 = (w.first_page + b) * kBlockN;
    float s[kVals];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kVals; ++i) s[i] = T::kQTerms == 2 ? tSrS(i) + tSrS(i + kVals) : tSrS(i);
    float sc[kSlots], off[kSlots];
    km_block_max<T>(ss, w, tok0, key_base, row_end, sl2, lane, warp, s, m, sc, off);
    uint32_t pw[km_pt_words<T>];

    if constexpr (!kAhead) {
      km_block_p<T>(s, sl2, off, sc, lane, pw, l);
      // ---- the previous block's P V done: its V parts go back, P^T may be rewritten, O takes this block's max ----
      // No wgmma is in flight from here until the next S^T: ptxas serializes every wgmma where O is read while one
      // is (also one of another accumulator: the next S^T issued before the rescale did that), and the wait is not
      // in a branch (at b = 0 nothing is in flight and it returns at once).
      km_release_done_parts<T, false>(ss, g - 1, b > 0, lane);
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kParts; ++k) warpgroup_fence_operand(o[k]);
      // Each warp's share of a wgmma completes on its own (a warp's tensor core reads the whole P^T for its 16 rows
      // of M), so P^T is rewritten only once every warp has waited for the previous block's P V.
      km_sync(KmBarriers::kPvDone);
      km_store_pt<T>(ss, pw, lane, warp, c, key_base);
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kParts; ++k) km_rescale(o[k], sc);
      km_sync(KmBarriers::kPtReady);

      // ---- the next S^T; O^T += V^T P^T, part by part (with quarters the first two before the next S^T) ----
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kEarly; ++k) {
        km_wait_v<T>(ss, k, g);
        km_pv_part<T>(ss, tid, k, g, o[k]);
      }
      if constexpr (kNext) km_qk_block<T>(ss, tid, g + 1, tSrS);
      CUTLASS_PRAGMA_UNROLL
      for (int k = kEarly; k < kParts; ++k) {
        km_wait_v<T>(ss, k, g);
        km_pv_part<T>(ss, tid, k, g, o[k]);
      }
    } else {
      // ---- the previous block's P V done: its late V parts go back, O takes this block's max; the next S^T ----
      km_release_done_parts<T, true>(ss, g - 1, b > 0, lane);
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kParts; ++k) warpgroup_fence_operand(o[k]);
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kParts; ++k) km_rescale(o[k], sc);
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kParts; ++k) warpgroup_fence_operand(o[k]);
      if constexpr (kNext) km_qk_block<T>(ss, tid, g + 1, tSrS);

      // ---- P, P^T (every warp has waited for the previous block's P V: the kPvDone barrier), this block's P V ----
      km_block_p<T>(s, sl2, off, sc, lane, pw, l);
      km_sync(KmBarriers::kPvDone);
      km_store_pt<T>(ss, pw, lane, warp, c, key_base);
      km_sync(KmBarriers::kPtReady);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kParts; ++j) {
        km_wait_v<T>(ss, km_part<T, true>(j), g);
        km_pv_part<T>(ss, tid, km_part<T, true>(j), g, o[km_part<T, true>(j)]);
      }
    }
    km_step_end<T, kAhead, kNext>(ss, g, lane, tSrS, o);
  };
  int b = 0;
  CUTLASS_PRAGMA_NO_UNROLL
  for (; b + 1 < nblk; ++b) step(cute::true_type{}, b);
  step(cute::false_type{}, b);
}

// A request piece's output: O / l (q's dtype) and lse, or, for a split, O / l and lse into the accumulators. Two
// lanes of a quad pair (g even and odd: value columns k and k + 1) swap one value so that each writes two
// consecutive columns of one row: the even lane row n, the odd lane row n + 1.
template <class T, class FragO>
__device__ __forceinline__ void km_store_output(const DecodeParams& p, const decode::RequestPiece& w, int hk, int tid,
                                                const FragO (&o)[T::kVParts], const float (&l)[T::kRows / 4],
                                                const float (&m)[T::kRows / 4], float v_scale) {
  using Out = typename T::Out;
  constexpr int kSlots = T::kRows / 4;
  const int lane = tid & 31, warp = tid >> 5, c = lane & 3, g = lane >> 2;
  const bool odd = g & 1;
  float inv[kSlots];
  int64_t row_off[kSlots];  // the row's output element offset (or o_accum row), -1 past q_rows
  CUTLASS_PRAGMA_UNROLL
  for (int q = 0; q < kSlots; ++q) {
    const int n = km_row(q, c);
    inv[q] = row_has_key(l[q]) ? v_scale / l[q] : 0.f;
    row_off[q] = -1;
    if (n < p.q_rows) {
      const int s = n / p.ngroups, h = hk * p.ngroups + (n - s * p.ngroups);
      row_off[q] = w.split ? ((int64_t(w.split_id) * p.num_heads_kv + hk) * p.q_rows + n) * kHeadDimV
                           : int64_t(w.req) * p.out_stride_b + int64_t(s) * p.out_stride_s +
                                 int64_t(h) * p.out_stride_h;
    }
  }
  if constexpr (T::kQFp8) {
    // V^T row m of a half holds value column vt_row_column(m) (layout.h): the thread's rows 16 w + g and + 8 of an m64
    // tile are value columns 16 w + 2 g and + 1 of it, consecutive, for each of its query rows.
    CUTLASS_PRAGMA_UNROLL
    for (int part = 0; part < T::kVParts; ++part) {
      CUTLASS_PRAGMA_UNROLL
      for (int t = 0; t < size<1>(o[part]); ++t) {
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < size<0>(o[part]); v += 4) {
          CUTLASS_PRAGMA_UNROLL
          for (int e = 0; e < 2; ++e) {  // v + e: row slot km_slot(v + e); v + e + 2: the next value column
            const int q = km_slot(v + e);
            if (row_off[q] < 0) continue;
            const float a = o[part](v + e, t, 0) * inv[q], bb = o[part](v + e + 2, t, 0) * inv[q];
            const int col = part * T::kPartCols + 64 * t + 16 * warp + 2 * g;
            if (!w.split) {
              Out* out = reinterpret_cast<Out*>(p.out) + row_off[q] + col;
              const Out pair[2] = {static_cast<Out>(a), static_cast<Out>(bb)};
              *reinterpret_cast<uint32_t*>(out) = *reinterpret_cast<const uint32_t*>(pair);
            } else {
              *reinterpret_cast<float2*>(p.o_accum + row_off[q] + col) = make_float2(a, bb);
            }
          }
        }
      }
    }
  } else {
  CUTLASS_PRAGMA_UNROLL
  for (int part = 0; part < T::kVParts; ++part) {
    CUTLASS_PRAGMA_UNROLL
    for (int t = 0; t < size<1>(o[part]); ++t) {
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < size<0>(o[part]); v += 2) {
        // v: row n = km_row(q, c) (q = km_slot(v)), v + 1: row n + 1; this lane's value column k.
        const int q0 = km_slot(v), q1 = km_slot(v + 1);
        const float x0 = o[part](v, t, 0) * inv[q0], x1 = o[part](v + 1, t, 0) * inv[q1];
        const float other = __shfl_xor_sync(0xffffffffu, odd ? x0 : x1, 4);
        const int k = part * T::kPartCols + 64 * t + 16 * warp + g + 8 * ((v >> 1) & 1);
        const int col = odd ? k - 1 : k;
        const int64_t ro = odd ? row_off[q1] : row_off[q0];  // (not row_off[odd ? q1 : q0]: a local-memory array)
        const float a = odd ? other : x0, bb = odd ? x1 : other;
        if (ro < 0) continue;
        if (!w.split) {
          Out* out = reinterpret_cast<Out*>(p.out) + ro + col;
          const Out pair[2] = {static_cast<Out>(a), static_cast<Out>(bb)};
          *reinterpret_cast<uint32_t*>(out) = *reinterpret_cast<const uint32_t*>(pair);
        } else {
          *reinterpret_cast<float2*>(p.o_accum + ro + col) = make_float2(a, bb);
        }
      }
    }
  }
  }
  if (warp == 0 && g == 0) {
    CUTLASS_PRAGMA_UNROLL
    for (int q = 0; q < kSlots; ++q) {
      const int n = km_row(q, c);
      if (n >= p.q_rows) continue;
      const bool has_key = row_has_key(l[q]);
      if (!w.split) {
        const int s = n / p.ngroups, h = hk * p.ngroups + (n - s * p.ngroups);
        p.lse[int64_t(w.req) * p.lse_stride_b + int64_t(h) * p.lse_stride_h + s] =
            has_key ? row_lse(m[q], l[q]) : kNoKeyLse;
      } else {
        p.lse_accum[(int64_t(w.split_id) * p.num_heads_kv + hk) * p.q_rows + n] =
            has_key ? row_lse(m[q], l[q]) : kNoKeySplitLse;
      }
    }
  }
}

// The consumer warpgroup's request loop.
template <class T, bool kAhead>
__device__ __forceinline__ void km_consumer_loop(const DecodeParams& p, typename T::SharedStorage& ss,
                                                 const SchedMetaRow& meta, int begin_req, int end_req, int hk,
                                                 int tid) {
  constexpr int R = T::kRows, kSlots = R / 4;
  const int lane = tid & 31, warp = tid >> 5, c = lane & 3;
  const uint32_t q_addr = cute::cast_smem_ptr_to_uint(ss.q.data());
  typename T::TiledMmaO mma_o;
  using FragO = decltype(partition_fragment_C(mma_o, Shape<Int<T::kPartCols>, Int<R>>{}));
  FragO o[T::kVParts];  // 4 R floats in all

  km_issue_q_copy<T>(p, begin_req, hk, q_addr, tid);
  uint32_t g_base = 0;
  CUTLASS_PRAGMA_NO_UNROLL
  for (int req = begin_req; req <= end_req; ++req) {
    const decode::RequestPiece w = decode::make_request_piece(p, meta, req, 0);
    int row_end[kSlots];
    CUTLASS_PRAGMA_UNROLL
    for (int q = 0; q < kSlots; ++q) {
      const int n = km_row(q, c);
      int end = w.stop_eff;  // rows past q_rows: any bound that keeps them finite
      if (n < p.q_rows) {
        end = w.stop;
        if (p.causal) end = min(end, w.len - p.seqlen_q + n / p.ngroups + 1);
      }
      row_end[q] = end;
    }
    decode::cp_async_wait_all();
    if constexpr (!T::kQFp8) {
      if (tid < 4 * R) {
        split_q16_row<typename T::QIn>(q_addr, km_q_lo_delta(R),
                                       [](int r, int cc) { return km_q_chunk_offset(T::kQRows, r, cc); }, tid >> 2,
                                       tid & 3, ss.q_scale);
      }
    }
    cutlass::arch::fence_view_async_shared();  // Q written by cp.async / st.shared, read by wgmma
    km_sync(KmBarriers::kWarpGroup);
    if (tid < R) {
      const float dk = descale_k_at(p, w.req, hk);
      ss.row_scale_log2[tid] = p.scale_log2 * dk * (T::kQFp8 ? descale_q_at(p, w.req, hk) : ss.q_scale[tid]);
      if (tid == 0) ss.value_scale = dk;
    }
    km_sync(KmBarriers::kWarpGroup);
    float sl2[kSlots], m[kSlots], l[kSlots];
    CUTLASS_PRAGMA_UNROLL
    for (int q = 0; q < kSlots; ++q) {
      sl2[q] = ss.row_scale_log2[km_row(q, c)];
      m[q] = -INFINITY;
      l[q] = 0.f;
    }
    km_mainloop<T, kAhead>(ss, w, row_end, sl2, tid, g_base, o, m, l);
    g_base += uint32_t(padded_blocks(w.num_blocks));

    // Row sums: the eight lanes of a column slot, then the four warps.
    CUTLASS_PRAGMA_UNROLL
    for (int q = 0; q < kSlots; ++q) {
      l[q] += __shfl_xor_sync(0xffffffffu, l[q], 4);
      l[q] += __shfl_xor_sync(0xffffffffu, l[q], 8);
      l[q] += __shfl_xor_sync(0xffffffffu, l[q], 16);
    }
    if (lane < 4) {
      CUTLASS_PRAGMA_UNROLL
      for (int q = 0; q < kSlots; ++q) ss.row_sum[warp][km_row(q, c)] = l[q];
    }
    // Every warp is past its last wgmma: the Q tile may be overwritten.
    km_sync(KmBarriers::kWarpGroup);
    if (req < end_req) {
      km_issue_q_copy<T>(p, req + 1, hk, q_addr, tid);
    } else {
      pdl_launch_dependents();
    }
    CUTLASS_PRAGMA_UNROLL
    for (int q = 0; q < kSlots; ++q) {
      const int n = km_row(q, c);
      l[q] = (ss.row_sum[0][n] + ss.row_sum[1][n]) + (ss.row_sum[2][n] + ss.row_sum[3][n]);
      m[q] -= kPScaleLog2;  // l carries P's 2^kPScaleLog2 (config.h): lse must not
    }
    km_store_output<T>(p, w, hk, tid, o, l, m, ss.value_scale);
    km_sync(KmBarriers::kWarpGroup);  // row_sum, q_scale, row_scale_log2 reused
  }
}

template <class T, bool kAhead>
__global__ void __launch_bounds__(T::kNumThreads, 1)
    sm90_fp8_decode_km_kernel(const __grid_constant__ DecodeParams params, const __grid_constant__ CUtensorMap tmap_kv,
                              int debug_arg) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using SharedStorage = typename T::SharedStorage;
  const DecodeParams& p = params;
  const int debug = kMeasureBuild ? debug_arg : 0;  // common/measure.h
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = cute::cast_smem_ptr_to_uint(smem_raw);
  SharedStorage& ss =
      *reinterpret_cast<SharedStorage*>(smem_raw + ((kSmemAlign - (raw_addr % kSmemAlign)) % kSmemAlign));
  const int hk = blockIdx.y;
  const int part = blockIdx.z;
  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid / kThreadsPerWarpGroup, 0);  // warp-uniform
  const int lane = tid & 31;

  pdl_wait_primary();
  decode::CtaRequests cta;
  if (!decode::cta_requests(p, part, cta)) return;
  const SchedMetaRow& meta = cta.meta;
  const int begin_req = cta.begin_req, end_req = cta.end_req;
  if (tid == 0) init_pipeline_barriers<T>(ss, &tmap_kv);
  __syncthreads();

  if (wg == 1) {
    const int warp = (tid - kThreadsPerWarpGroup) / 32;
    producer_warp<T>(p, &tmap_kv, ss, meta, begin_req, end_req, 0, hk, warp, lane, debug);
  } else {
    km_consumer_loop<T, kAhead>(p, ss, meta, begin_req, end_req, hk, tid);
  }
#else
  if (threadIdx.x == 0) printf("flashmla_backend: sm90 FP8 decode kernel was not compiled for sm_90a\n");
  __trap();
#endif
}

}  // namespace flashmla_backend::sm90::decode_fp8
