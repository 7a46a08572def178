// Consumer warpgroups of the sm90 FP8 tensor-core decode kernel: Q K^T and P V on e4m3 wgmma, the online softmax,
// and the seesaw between the two warpgroups (the schedule of the 16-bit kernel, docs/kernel-design.md).
//
// Blocks of a request piece are taken two at a time: block b0 (even, request-local) is multiplied by Q in
// warpgroup 0, block b0 + 1 in warpgroup 1; warpgroup 0 accumulates output columns [0, 256) of both, warpgroup 1
// columns [256, 512). Unlike the 16-bit kernel no consumer issues copies: the producer warpgroup (producer.cuh)
// refills a KV stage once its owner's Q K^T and the transposer released it (kv_empty), and writes a V^T half into
// its slot once the P V of the slot's previous block completed in the warpgroup that reads that half (vt_empty).
// Warpgroup 0 reads the left half of block b0 mid-step and of b0 + 1 at the end; warpgroup 1 the right half of
// b0 + 1 early and of b0 at the end, so the right half of b0 + 3 is needed soon after b0's is released: the right
// ring is the longer one (launch.cuh).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include <cstdint>

#include "params.h"
#include "sm90/decode/epilogue.cuh"
#include "sm90/decode/softmax.cuh"
#include "sm90/decode/tile_work.cuh"
#include "sm90/decode_fp8/config.h"
#include "sm90/decode_fp8/layout.h"
#include "sm90/decode_fp8/producer.cuh"
#include "sm90/decode_fp8/q_tile.cuh"
#include "sm90/decode_fp8/traits.h"

namespace flashmla_backend::sm90::decode_fp8 {

using namespace cute;
using NamedBarrier = cutlass::arch::NamedBarrier;
using decode::RowInfo;

// A zero the compiler cannot see through (see sm90/decode/mainloop.cuh: it keeps wgmma descriptors from being
// hoisted across the main loop, which would cost registers).
__device__ __forceinline__ uint32_t opaque_zero() {
  uint32_t z;
  asm volatile("mov.u32 %0, 0;" : "=r"(z));
  return z;
}

// One lane of each warp arrives on `bar` once the warp is done with what the barrier guards (its wgmma waited).
template <class Barrier>
__device__ __forceinline__ void warp_arrive(Barrier& bar, int lane) {
  __syncwarp();
  if (lane == 0) bar.arrive();
}

// ------------------------------------------------------------------------------------------------
// Softmax pieces with a per-row scale (the accurate mode's q rows have scales of their own)
// ------------------------------------------------------------------------------------------------
// P = exp2(s sl2 - m + kPScaleLog2) (config.h: the e4m3 range factor rides in the offset), and its row sums.
// kEqualRows (Traits::kStackedTerms, whose two rows a thread holds are one query row): the exponentials of row g,
// copied to row g + 8 (the same values, half the work).
template <bool kEqualRows = false, class Frag>
__device__ __forceinline__ void exp2_rows_scaled(Frag& s, const float (&sl2)[2], const float (&m_use)[2],
                                                 float (&sum)[2]) {
  const float off[2] = {kPScaleLog2 - m_use[0], kPScaleLog2 - m_use[1]};
  sum[0] = 0.f;
  sum[1] = 0.f;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(s); ++i) {
    const int v = (i >> 1) & 1;
    if (kEqualRows && v == 1) {
      s(i) = s(i - 2);
      continue;
    }
    s(i) = fast_exp2(fmaf(s(i), sl2[v], off[v]));
    sum[v] += s(i);
  }
  if (kEqualRows) sum[1] = sum[0];
}

// O *= sc per row, skipped by a warp whose rows all kept their running max (sc == 1, the common case once the
// max has settled): 128 multiplications a thread that take issue slots the other warps need. Skipping a
// multiplication by exactly 1 changes no bit.
template <class Frag>
__device__ __forceinline__ void rescale_o(Frag& o, const float (&sc)[2]) {
  if (__any_sync(0xffffffffu, sc[0] != 1.f || sc[1] != 1.f)) decode::scale_rows(o, sc);
}

// All 256 consumer threads at a request boundary (kernel.cuh: consumer_loop) or between the runs of a piece
// (run_promoted). Each warpgroup runs its own copy of the request loop, so the two reach this barrier at different
// instructions: the barrier is the non-.aligned barrier.sync, which allows that (bar.sync is barrier.sync.aligned,
// every participating thread at the same instruction; compute-sanitizer's synccheck reported it as divergent threads).
__device__ __forceinline__ void consumers_sync() {
  NamedBarrier(kNumConsumerThreads, uint32_t(NamedBarriers::kConsumers)).arrive_and_wait_unaligned();
}

// ------------------------------------------------------------------------------------------------
// O in two e4m3 P terms, and its promotion (Traits::kPTerms2; config.h: kPromoteBlocks)
// ------------------------------------------------------------------------------------------------
// A thread's accumulator row g + 8 holds P's second term times V (p_words), so row g's output is
// O_g + O_{g+8} / kPLoFactor (value i of the accumulator is row g + 8 ((i >> 1) & 1)); the epilogue then writes
// row g (kOutRowsPerThread).
template <class FragO>
__device__ __forceinline__ void fold_p_terms(FragO& o) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(o); ++i) {
    if (((i >> 1) & 1) == 0) o(i) = fmaf(o(i + 2), 1.f / kPLoFactor, o(i));
  }
}

// The fp32 copy of O is the piece's own rows of o_accum (params.h: slot w.split_id, which every piece has, split or
// not), in the epilogue's order (sm90/decode/epilogue.cuh: a thread's values of value columns 16 a + 4 t .. + 3),
// so each thread touches only what it alone writes there later: the combine never reads an unsplit piece's slot,
// and a split piece's epilogue overwrites the same addresses from the same thread.
// A piece runs as consecutive runs of kPromoteBlocks blocks (run_promoted): the main loop as for a piece of its own,
// except that the running max and the row sums carry over, with O promoted between runs, outside the step loop (in
// the steps it took the same time and spilled: no register is free there while S is live). The copy stays at the
// running max m_copy of the promotion that stored it (the thread's own shared-memory word: a register held across
// the main loop spilled); later promotions add O times exp2(m - m_copy), with reductions (red.global.add), so that
// the consumers never wait for a load (loading the copy to rescale it held the loads' 64 values in registers the
// consumers do not have, and spilled). Where m has risen past m_copy + kRestartLog2, the copy is negligible beside O
// and the promotion stores instead, as the first does. The address is derived when it is needed from values the
// epilogue keeps anyway, and whether a copy exists from the block count. What it costs (b = 64, h_q 32, one promotion
// a piece: 107 us without any, 118-121 with it; docs/kernel-design.md): the runs' restarts 1 us, the barrier and the
// loads at the piece's end 4-5, the stores 5-6 (writing the copy evict-last in L2 did not change it).
struct OPromotion {
  static constexpr float kRestartLog2 = 64.f;
  const DecodeParams* p;
  int m_block, hk, row, col;  // the thread's tile row and first column
  float* m_copy;              // shared memory: the thread's word of SharedStorage::o_copy_max
  // The thread's row of the piece's slot; null for a row past q_rows (none kept).
  __device__ __forceinline__ float* dst(const RequestPiece& w) const {
    const int r = m_block * int(kBlockM / 2) + row;  // the stacked tile's 32 rows (kPTerms2 is a stacked tile)
    if (r >= p->q_rows) return nullptr;
    return p->o_accum + ((int64_t(w.split_id) * p->num_heads_kv + hk) * p->q_rows + r) * kHeadDimV + col;
  }
};
// Whether O was promoted in a piece of num_blocks blocks: after every run but the last.
__device__ __forceinline__ bool promoted_before(int num_blocks) { return num_blocks > kPromoteBlocks; }

__device__ __forceinline__ void red_add_f32x4(float* addr, const float (&x)[4]) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(addr), "f"(x[0]), "f"(x[1]), "f"(x[2]), "f"(x[3])
               : "memory");
}

// Copy (+)= O (row g, folded), O at the running max m; `first` (the piece's first run) stores. Called with no wgmma
// on O in flight; the next run clears O.
template <class FragO>
__device__ __forceinline__ void promote_o(const FragO& o, const OPromotion& op, const RequestPiece& w, bool first,
                                          float m) {
  float* dst = op.dst(w);
  if (dst == nullptr) return;
  const float m_copy = *op.m_copy;
  // m - m_copy <= kRestartLog2 fails for a first m of -inf (no key yet: O is 0) too, and then the copy is stored.
  const bool store = first || !(m - m_copy <= OPromotion::kRestartLog2);
  const float f = store ? 1.f : fast_exp2(m - m_copy);
  CUTLASS_PRAGMA_UNROLL
  for (int a = 0; a < size(o) / 8; ++a) {
    float x[4];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < 4; ++k) {
      const int i = decode::interleaved_value_index(a, 0, k);  // row g; i + 2 is row g + 8
      x[k] = fmaf(o(i + 2), 1.f / kPLoFactor, o(i)) * f;
    }
    if (store) {
      __stcg(reinterpret_cast<float4*>(dst + 16 * a), make_float4(x[0], x[1], x[2], x[3]));
    } else {
      red_add_f32x4(dst + 16 * a, x);
    }
  }
  if (store) *op.m_copy = m;
}

// The piece w (its first block at g_base in the KV ring) as runs of at most kPromoteBlocks blocks: run(piece, g) is
// the main loop over one run, O promoted after each but the last at the running max m the run ended with. Warpgroup
// 0 reads m from row_max (warpgroup 1's last softmax of the run wrote it before kScale1Ready, which warpgroup 0
// passed) and publishes it in run_max (kRunMax); warpgroup 1 takes it from there, since by the time it is done with
// its last P V, warpgroup 0's next run may have moved row_max. Neither waits for the other's promotion: warpgroup 0
// starts its next run at once (a barrier of all consumers here instead: 0.5-1.5% slower at h_q 32, H200).
// run_max is rewritten only at the end of warpgroup 0's next run, after warpgroup 1 read it: that run's steps wait
// for warpgroup 1's kScale1Ready, which comes after its read. Without Traits::kPTerms2, one run.
template <class T, int kWG, class FragO, class Run>
__device__ __forceinline__ void run_promoted(typename T::SharedStorage& ss, const RequestPiece& w, uint32_t g_base,
                                             const FragO& o, const OPromotion& op, Run&& run) {
  if constexpr (!T::kPTerms2) {
    run(w, g_base);
  } else {
    RequestPiece r = w;
    CUTLASS_PRAGMA_NO_UNROLL
    for (int b = 0;; b += kPromoteBlocks) {
      r.first_page = w.first_page + b;
      r.num_blocks = min(w.num_blocks - b, kPromoteBlocks);
      run(r, g_base + uint32_t(b));
      if (b + kPromoteBlocks >= w.num_blocks) break;
      float m;
      if constexpr (kWG == 0) {
        m = ss.row_max[op.row];
        if ((cutlass::canonical_lane_idx() & 3) == 0) ss.run_max[op.row] = m;  // the four threads of a row hold one m
        NamedBarrier::arrive(kNumConsumerThreads, uint32_t(NamedBarriers::kRunMax));
      } else {
        NamedBarrier::sync(kNumConsumerThreads, uint32_t(NamedBarriers::kRunMax));
        m = ss.run_max[op.row];
      }
      promote_o(o, op, w, b == 0, m);
      // Keeps ptxas from interleaving the next run's start with the promotion: without it the fp16-q tile spilled
      // 12 bytes (168 registers).
      __syncwarp();
    }
  }
}

// At the end of a piece: row g of O (fold_p_terms) plus the copy; m: the final running max.
template <class FragO>
__device__ __forceinline__ void finish_o(FragO& o, const OPromotion& op, const RequestPiece& w, float m) {
  fold_p_terms(o);
  float* dst = op.dst(w);
  if (promoted_before(w.num_blocks) && dst != nullptr) {
    const float m_copy = *op.m_copy;
    const float f = m_copy == m ? 1.f : fast_exp2(m_copy - m);  // equal: also both -inf (then the copy is 0)
    CUTLASS_PRAGMA_UNROLL
    for (int a = 0; a < size(o) / 8; ++a) {
      const float4 y = __ldcg(reinterpret_cast<const float4*>(dst + 16 * a));
      const float yk[4] = {y.x, y.y, y.z, y.w};
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < 4; ++k) {
        float& x = o(decode::interleaved_value_index(a, 0, k));
        x = fmaf(yk[k], f, x);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// P as the e4m3 A fragment
// ------------------------------------------------------------------------------------------------
// The accumulator value i of a 64 x 64 S (row g + 8 ((i >> 1) & 1), key 8 (i >> 2) + 2 (l % 4) + (i & 1)) and the
// A fragment of a k32 slice (word q: row g + 8 (q & 1), k' 16 (q >> 1) + 4 (l % 4) .. + 3) meet without moving data
// between threads when k' = 4 t + i holds key 2 t + (i & 1) + 8 (i >> 1) (+ 16 for the upper half): word q of slice
// kk takes values 16 kk + 8 (q >> 1) + 2 (q & 1) + {0, 1, 4, 5}, in that byte order. V^T is written in that key
// order (producer.cuh: producer_loop).
// Each value is e4m3(x), with x = s(i) * f[row] (kScaled) or s(i).
// kPTerms2 (Traits::kPTerms2, the stacked Q tile, whose rows g and g + 8 are one query row): the words of row g + 8
// (q odd) hold the second term of row g's values instead, lo = e4m3((x - e4m3(x)) kPLoFactor) (q_tile.cuh:
// split_e4m3x2).
template <bool kScaled, bool kPTerms2 = false, class Frag>
__device__ __forceinline__ void p_words(const Frag& s, const float (&f)[2], int kk, uint32_t (&words)[4]) {
  CUTLASS_PRAGMA_UNROLL
  for (int q = 0; q < 4; ++q) {
    if (kPTerms2 && (q & 1)) continue;  // written with word q - 1
    const float fr = kScaled ? f[q & 1] : 1.f;
    const auto at = [&](int i) { return kScaled ? s(p_source_index(kk, q, i)) * fr : s(p_source_index(kk, q, i)); };
    if constexpr (kPTerms2) {
      uint32_t hi01, lo01, hi23, lo23;
      // x <= 2^8 (config.h: P's scale); rounded to fp16 (11 significant bits) before the difference, more than the
      // two terms' 8.
      static_assert(kPLoFactor == 16.f, "split_e4m3x2<true>'s factor");
      split_e4m3x2<true>(at(0), at(1), hi01, lo01);
      split_e4m3x2<true>(at(2), at(3), hi23, lo23);
      words[q] = hi01 | (hi23 << 16);
      words[q + 1] = lo01 | (lo23 << 16);
    } else {
      words[q] = f32x4_to_e4m3x4(at(0), at(1), at(2), at(3));
    }
  }
}
// P's own fragment (no row factor).
template <bool kPTerms2 = false, class Frag>
__device__ __forceinline__ void p_fragment(const Frag& s, uint32_t (&words)[8]) {
  const float none[2] = {1.f, 1.f};
  CUTLASS_PRAGMA_UNROLL
  for (int kk = 0; kk < 2; ++kk) {
    uint32_t w[4];
    p_words<false, kPTerms2>(s, none, kk, w);
    CUTLASS_PRAGMA_UNROLL
    for (int q = 0; q < 4; ++q) words[4 * kk + q] = w[q];
  }
}

// P as the fp16 A fragment: the A fragment of a 16-bit rs wgmma holds the S accumulator's values in the
// accumulator's own register order (as in sm90/decode/mainloop.cuh), so word k is (s(2 k), s(2 k + 1)), row
// g + 8 (k & 1) of the thread. kEqualRows: row g + 8's words are row g's (exp2_rows_scaled).
template <bool kEqualRows = false, class Frag>
__device__ __forceinline__ void p16_fragment(const Frag& s, uint32_t (&words)[16]) {
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < 16; ++k) {
    if (kEqualRows && (k & 1)) {
      words[k] = words[k - 1];
      continue;
    }
    const __half2 h = __floats2half2_rn(s(2 * k), s(2 * k + 1));
    words[k] = *reinterpret_cast<const uint32_t*>(&h);
  }
}
// A P tile handed to the other warpgroup: thread t's kWords words (8: the e4m3 fragment, 16: the fp16 one) as
// 16-byte chunks at (chunk, t).
template <int kWords>
__device__ __forceinline__ void store_p(uint8_t* buf, int tid, const uint32_t (&words)[kWords]) {
  const uint32_t base = cute::cast_smem_ptr_to_uint(buf);
  CUTLASS_PRAGMA_UNROLL
  for (int c = 0; c < kWords / 4; ++c) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(base + c * 2048 + tid * 16), "r"(words[4 * c]),
                 "r"(words[4 * c + 1]), "r"(words[4 * c + 2]), "r"(words[4 * c + 3]));
  }
}
// The e4m3 fragment of P times the row factor f, computed and stored one k32 slice at a time (four words live at
// once).
template <bool kPTerms2 = false, class Frag>
__device__ __forceinline__ void store_p_fragment(const Frag& s, const float (&f)[2], uint8_t* buf, int tid) {
  const uint32_t base = cute::cast_smem_ptr_to_uint(buf);
  CUTLASS_PRAGMA_UNROLL
  for (int kk = 0; kk < 2; ++kk) {
    uint32_t w[4];
    p_words<true, kPTerms2>(s, f, kk, w);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(base + (kk * 128 + tid) * 16), "r"(w[0]),
                 "r"(w[1]), "r"(w[2]), "r"(w[3]));
  }
}
// Chunk c of a thread's words (words 4 c .. 4 c + 3) of a tile stored by store_p; base: the tile's shared address
// plus 16 tid (p_chunk_base).
__device__ __forceinline__ uint32_t p_chunk_base(const uint8_t* buf, int tid) {
  return cute::cast_smem_ptr_to_uint(buf) + tid * 16;
}
__device__ __forceinline__ void load_p_chunk(uint32_t base, int c, uint32_t (&w)[4]) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
               : "r"(base + c * 2048));
}
template <int kWords>
__device__ __forceinline__ void load_p(const uint8_t* buf, int tid, uint32_t (&words)[kWords]) {
  const uint32_t base = p_chunk_base(buf, tid);
  CUTLASS_PRAGMA_UNROLL
  for (int c = 0; c < kWords / 4; ++c) {
    uint32_t w[4];
    load_p_chunk(base, c, w);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 4; ++i) words[4 * c + i] = w[i];
  }
}

// The A fragment of the P V product: T::kPWords words per thread (the registers the rs wgmma reads, in its order),
// viewed as the fragment the CuTe MMA expects (32 e4m3 or fp16 values).
template <class T>
struct PFrag {
  static constexpr int kWords = T::kPWords;
  using E = typename T::PvElement;
  using Mma = typename T::TiledMmaPV;
  using ALayout = decltype(make_layout(partition_shape_A(Mma{}, Shape<Int<kBlockM>, Int<kBlockN>>{})));
  static_assert(cosize_v<ALayout> * int(sizeof(E)) == 4 * kWords, "the words are the thread's whole A fragment");
  uint32_t w[kWords];
  __device__ __forceinline__ auto tensor() { return make_tensor(make_rmem_ptr<E>(reinterpret_cast<E*>(&w[0])), ALayout{}); }
  __device__ __forceinline__ void set(const uint32_t (&words)[kWords]) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kWords; ++i) w[i] = words[i];
  }
  __device__ __forceinline__ void fence() {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kWords; ++i) asm volatile("" : "+r"(w[i]));
  }
};

// ------------------------------------------------------------------------------------------------
// wgmma steps
// ------------------------------------------------------------------------------------------------
// S = Q K^T of block g (stage g % kStages); one commit group. All nine pieces are waited for before the first
// wgmma: with the waits (and their timeout branches) between the wgmma of one batch, ptxas placed S over O and
// moved O through local memory around every wgmma.
template <class T, class FragS>
__device__ __forceinline__ void qk_block(int tid, typename T::SharedStorage& ss, uint32_t g, FragS& tSrS) {
  using E = typename T::Element;
  const int stage = int(stage_of(g, T::kStages));
  wait_kv_block<T>(ss, g);
  typename T::TiledMmaQK mma;
  auto thr = mma.get_slice(tid);
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  const uint32_t z = opaque_zero();
  Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<E*>(ss.kv.data() + stage * kTileBytes) + z),
                          typename T::SmemLayoutTile{});
  Tensor tSrK = thr.partition_fragment_B(sK);  // (MMA, 1, 18)
  warpgroup_fence_operand(tSrS);
  warpgroup_arrive();
  // kPvF16: the small q term first. The e4m3 accumulator keeps fewer bits than fp32 (benchmarks/
  // fp8_accumulation_model.py); summed while the accumulator is small, the small term's products keep theirs, as
  // if accumulated apart and added in fp32 (modeled: 1.7e-3 against 2.1e-3 with the large term first, bf16 output).
  CUTLASS_PRAGMA_UNROLL
  for (int tt = 0; tt < T::kQTiles; ++tt) {
    const int t = T::kPvF16 ? T::kQTiles - 1 - tt : tt;
    Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<E*>(ss.q.data() + t * kTileBytes) + z),
                            typename T::SmemLayoutTile{});
    Tensor tSrQ = thr.partition_fragment_A(sQ);  // (MMA, 1, 18)
    CUTLASS_PRAGMA_UNROLL
    for (int kb = 0; kb < size<2>(tSrQ); ++kb) {
      cute::gemm(mma, tSrQ(_, _, kb), tSrK(_, _, kb), tSrS);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(tSrS);
}

// Traits::kStackedTerms: the thread's accumulator rows g and g + 8 hold the hi and the lo term's scores of one query
// row (layout.h: stacked_term_row); their sum in fp32 (the terms accumulated apart, as the keys-on-M tile's) goes to
// both, and the rest of the step treats them as two equal rows.
template <class T, class Frag>
__device__ __forceinline__ void fold_stacked_terms(Frag& s) {
  if constexpr (T::kStackedTerms) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(s); ++i) {
      if (((i >> 1) & 1) == 0) {
        const float t = s(i) + s(i + 2);
        s(i) = t;
        s(i + 2) = t;
      }
    }
  }
}

// O_half += P V_half of block g (its V^T half kHalf: value columns [256 kHalf, 256 kHalf + 256) in the order of
// layout.h); one commit group.
template <class T, int kHalf, class FragO>
__device__ __forceinline__ void pv_block(int tid, typename T::SharedStorage& ss, uint32_t g, PFrag<T>& P,
                                         FragO& tOrO) {
  using E = typename T::PvElement;
  typename T::TiledMmaPV mma;
  auto thr = mma.get_slice(tid);
  const uint32_t z = opaque_zero();
  Tensor sV = make_tensor(
      make_smem_ptr(reinterpret_cast<E*>(ss.vt.data() + T::vt_slot(kHalf, g) * T::kVSlotBytes) + z),
      typename T::SmemLayoutVHalf{});  // (256, 64)
  Tensor tOrV = thr.partition_fragment_B(sV);  // (MMA, 1, 2): k32 steps (e4m3), (MMA, 1, 4): k16 steps (fp16)
  mma.accumulate_ = GMMA::ScaleOut::One;
  P.fence();
  warpgroup_fence_operand(tOrO);
  warpgroup_arrive();
  Tensor tOrP = P.tensor();
  CUTLASS_PRAGMA_UNROLL
  for (int kb = 0; kb < size<2>(tOrV); ++kb) cute::gemm(mma, tOrP(_, _, kb), tOrV(_, _, kb), tOrO);
  warpgroup_commit_batch();
  warpgroup_fence_operand(tOrO);
  P.fence();
}

// V^T half kHalf of block g: wait until it is written; release it once this warpgroup's P V of it completed.
template <class T, int kHalf>
__device__ __forceinline__ void wait_vt(typename T::SharedStorage& ss, uint32_t g) {
  consumer_wait(ss.vt_full[T::vt_slot(kHalf, g)], T::vt_use(kHalf, g) & 1u);
}
// With the shared transposition (Traits::kShareVt) the half of the other cluster rank was copied here by the peer
// CTA, which is told instead (its peer_empty), one arrival per warp.
template <class T, int kHalf>
__device__ __forceinline__ void release_vt(typename T::SharedStorage& ss, uint32_t g, int lane) {
  const uint32_t slot = T::vt_slot(kHalf, g);
  if constexpr (T::kShareVt) {
    if (uint32_t(kHalf) != cluster_rank()) {
      __syncwarp();
      if (lane == 0) arrive_on_peer(ss.share.peer_empty[slot]);
      return;
    }
  }
  warp_arrive(T::vt_empty_of(ss, slot, T::vt_use(kHalf, g)), lane);
}

// ------------------------------------------------------------------------------------------------
// Blocks are taken in pairs. A request piece with an odd number of blocks gets one virtual block at its end
// (padded_blocks): its copies complete without data (producer.cuh), its keys are all masked, so its P is 0, and
// its V^T is zeros. Every step then holds two blocks and there are two step variants: with a next pair (the loop)
// and without (the last). With the 16-bit kernel's four variants (a missing second block, a missing next block of
// either warpgroup) ptxas serialized every wgmma of this kernel and kept O in local memory.
// ------------------------------------------------------------------------------------------------
template <class StepFn>
__device__ __forceinline__ void run_steps(int nblk, StepFn&& step) {
  int b0 = 0;
  CUTLASS_PRAGMA_NO_UNROLL
  for (; b0 + 2 < nblk; b0 += 2) step(cute::true_type{}, b0);
  step(cute::false_type{}, b0);
}

// ------------------------------------------------------------------------------------------------
// The two warpgroups' softmax of a step. Max: how a row's max moves (Max::update, decode::update_max's signature):
// ExactMax, or the V-in-registers tile's LazyMax (mainloop_vregs.cuh).
// ------------------------------------------------------------------------------------------------
struct ExactMax {
  static __device__ __forceinline__ void update(float m_old, float blk_max, float scale_log2, float& m_new,
                                                float& m_use, float& rescale) {
    decode::update_max(m_old, blk_max, scale_log2, m_new, m_use, rescale);
  }
};

// Warpgroup 0's softmax of block b0 (first key tok0): mask and row max, m0 and sc0 = exp2(m - m0) published
// (kScale0Ready), P0 = exp2(S0 sl2 - m0) in S, and the row sums taken to m0.
template <class T, class Max = ExactMax, class SS, class FragS>
__device__ __forceinline__ void softmax_block0(SS& ss, const RequestPiece& w, const RowInfo& ri, int lane, int tok0,
                                               const float (&sl2)[2], FragS& tSrS, float (&row_sum)[2],
                                               float (&sc0)[2]) {
  fold_stacked_terms<T>(tSrS);
  if (tok0 < w.start || tok0 + kBlockN > w.min_row_end) decode::mask_scores(tSrS, tok0, w.start, ri.row_end, lane);
  float mx[2], m_new[2], m_use[2], sum[2];
  decode::row_max_quad(tSrS, mx);
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < 2; ++v) Max::update(ss.row_max[ri.row[v]], mx[v], sl2[v], m_new[v], m_use[v], sc0[v]);
  __syncwarp();
  if ((lane & 3) == 0) {
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) {
      ss.row_max[ri.row[v]] = m_new[v];
      ss.scale0[ri.row[v]] = sc0[v];
    }
  }
  NamedBarrier::arrive(kNumConsumerThreads, uint32_t(NamedBarriers::kScale0Ready));
  exp2_rows_scaled<T::kStackedTerms>(tSrS, sl2, m_use, sum);
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < 2; ++v) row_sum[v] = row_sum[v] * sc0[v] + sum[v];
}

// ------------------------------------------------------------------------------------------------
// Warpgroup 0: Q K0^T, softmax of block 0 (decides m0), O_L += P0 V0L + P1 V1L.
// ------------------------------------------------------------------------------------------------
// With fp16 P V (Traits::kPvF16) P0 goes to warpgroup 1 unscaled, right after the softmax (mainloop_f16pv.cuh says
// why), once warpgroup 1 loaded the previous step's (kP0Free); the rest of this warpgroup's step is the same.
template <class T, class FragO>
__device__ __forceinline__ void mainloop_wg0(typename T::SharedStorage& ss, const RequestPiece& w, const RowInfo& ri,
                                             int tid, uint32_t g_base, FragO& tOrO,
                                             float (&row_sum)[2]) {
  constexpr int kPW = T::kPWords;
  const int lane = tid & 31;
  const int nblk = padded_blocks(w.num_blocks);
  if (nblk == 0) {
    clear(tOrO);
    return;
  }

  typename T::TiledMmaQK mma_qk;
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});  // 32 fp32
  PFrag<T> P;

  qk_block<T>(tid, ss, g_base, tSrS);
  warpgroup_wait<0>();
  warpgroup_fence_operand(tSrS);
  clear(tOrO);  // here, not before the first Q K^T: cleared earlier, ptxas kept O in local memory across it
  release_kv_stage<T>(ss, int(stage_of(g_base, T::kStages)), lane);

  auto step = [&](auto next_c, int b0) CUTLASS_LAMBDA_FUNC_INLINE {
    constexpr bool kNext = decltype(next_c)::value;  // blocks b0 + 2 and b0 + 3 exist
    const uint32_t g0 = g_base + uint32_t(b0);
    const int tok0 = (w.first_page + b0) * kBlockN;
    const float sl2[2] = {ss.row_scale_log2[ri.row[0]], ss.row_scale_log2[ri.row[1]]};

    // ---- softmax of block 0: m0 = max(m, rowmax S0), P0 = exp2(S0 sl2 - m0) ----
    float sc0[2];
    softmax_block0<T>(ss, w, ri, lane, tok0, sl2, tSrS, row_sum, sc0);
    {
      uint32_t words[kPW];
      if constexpr (T::kPvF16) {
        p16_fragment<T::kStackedTerms>(tSrS, words);
      } else {
        p_fragment<T::kPTerms2>(tSrS, words);
      }
      P.set(words);
    }
    if constexpr (T::kPvF16) {
      if (b0 > 0) NamedBarrier::sync(kNumConsumerThreads, uint32_t(NamedBarriers::kP0Free));
      store_p(ss.p[0], tid, P.w);
      NamedBarrier::arrive(kNumConsumerThreads, uint32_t(NamedBarriers::kP0Ready));
    }

    // ---- O_L = O_L sc0 + P0 V0L ----
    rescale_o(tOrO, sc0);
    wait_vt<T, 0>(ss, g0);
    pv_block<T, 0>(tid, ss, g0, P, tOrO);

    // ---- warpgroup 1 decided m1 (and stored P1): P0 sc1 for its P0 V0R ----
    NamedBarrier::sync(kNumConsumerThreads, uint32_t(NamedBarriers::kScale1Ready));
    float sc1[2];
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) sc1[v] = ss.scale1[ri.row[v]];
    // P0 sc1: when no row of the warp changed its max (sc1 == 1, the common case) that is P0's own fragment.
    if constexpr (!T::kPvF16) {
      if (__any_sync(0xffffffffu, sc1[0] != 1.f || sc1[1] != 1.f)) {
        store_p_fragment<T::kPTerms2>(tSrS, {sc1[0], sc1[1]}, ss.p[0], tid);
      } else {
        store_p(ss.p[0], tid, P.w);
      }
      NamedBarrier::arrive(kNumConsumerThreads, uint32_t(NamedBarriers::kP0Ready));
    }

    warpgroup_wait<0>();  // P0 V0L done
    warpgroup_fence_operand(tOrO);
    release_vt<T, 0>(ss, g0, lane);
    rescale_o(tOrO, sc1);
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) row_sum[v] *= sc1[v];

    // ---- O_L += P1 V1L; next S = Q K0^T (block b0 + 2) ----
    {
      uint32_t words[kPW];
      load_p(ss.p[1], tid, words);
      P.set(words);
    }
    wait_vt<T, 0>(ss, g0 + 1);
    pv_block<T, 0>(tid, ss, g0 + 1, P, tOrO);
    // The next Q K^T issued earlier, before the kP0Ready arrival, so that it reaches the tensor cores ahead of
    // warpgroup 1's P0 V0R and next Q K^T (about eight wgmma are outstanding in an SM, taken in issue order:
    // sparse_fp8/checks/wgmma_issue_probe.cu), gave the same bits and measured level in the fast mode (H200, b128 h_q
    // 128: 332-334 against 336-338 us in 25 ms windows, level in 100 ms windows and under the power cap, 0.6% slower
    // there at s_q 2; docs/perf/journal.md, 2026-12-03 14:48): not kept.
    if constexpr (kNext) qk_block<T>(tid, ss, g0 + 2, tSrS);
    warpgroup_wait<kNext ? 1 : 0>();
    warpgroup_fence_operand(tOrO);
    release_vt<T, 0>(ss, g0 + 1, lane);
    if constexpr (kNext) {
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
      release_kv_stage<T>(ss, int(stage_of(g0 + 2, T::kStages)), lane);
    }
  };
  run_steps(nblk, step);
}

// Warpgroup 1's softmax of block b0 + 1 (first key tok1) against warpgroup 0's m0, in both P V modes: mask and row
// max, m1 = max(m0, rowmax S1) and sc1 = exp2(m0 - m1) published, P1 = exp2(S1 sl2 - m1) in S, then
// store_p1() (P1 to p[1], in the mode's fragment), kScale1Ready, and the row sums taken to m1: sc01 = sc0 sc1.
template <bool kEqualRows = false, class Max = ExactMax, class SS, class FragS, class StoreP1>
__device__ __forceinline__ void softmax_block1(SS& ss, const RequestPiece& w, const RowInfo& ri, int lane, int tok1,
                                               const float (&sl2)[2], FragS& tSrS, float (&row_sum)[2],
                                               float (&sc1)[2], float (&sc01)[2], StoreP1&& store_p1) {
  float mx[2];
  if (tok1 + kBlockN > w.min_row_end) decode::mask_scores(tSrS, tok1, w.start, ri.row_end, lane);
  decode::row_max_quad(tSrS, mx);
  NamedBarrier::sync(kNumConsumerThreads, uint32_t(NamedBarriers::kScale0Ready));
  float m0[2], sc0[2];
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < 2; ++v) {
    m0[v] = ss.row_max[ri.row[v]];
    sc0[v] = ss.scale0[ri.row[v]];
  }
  float m_new[2], m_use[2], sum[2];
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < 2; ++v) Max::update(m0[v], mx[v], sl2[v], m_new[v], m_use[v], sc1[v]);
  __syncwarp();
  if ((lane & 3) == 0) {
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) {
      ss.row_max[ri.row[v]] = m_new[v];
      ss.scale1[ri.row[v]] = sc1[v];
    }
  }
  exp2_rows_scaled<kEqualRows>(tSrS, sl2, m_use, sum);
  store_p1();
  NamedBarrier::arrive(kNumConsumerThreads, uint32_t(NamedBarriers::kScale1Ready));
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < 2; ++v) {
    sc01[v] = sc0[v] * sc1[v];
    row_sum[v] = row_sum[v] * sc01[v] + sum[v];
  }
}

// ------------------------------------------------------------------------------------------------
// Warpgroup 1: Q K1^T, softmax of block 1 (decides m1), O_R = O_R sc0 sc1 + P1 V1R + (P0 sc1) V0R.
// ------------------------------------------------------------------------------------------------
template <class T, class FragO>
__device__ __forceinline__ void mainloop_wg1(typename T::SharedStorage& ss, const RequestPiece& w, const RowInfo& ri,
                                             int tid, uint32_t g_base, FragO& tOrO,
                                             float (&row_sum)[2]) {
  static_assert(!T::kPvF16, "mainloop_f16pv.cuh");
  const int lane = tid & 31;
  const int nblk = padded_blocks(w.num_blocks);
  if (nblk == 0) {
    clear(tOrO);
    return;
  }

  typename T::TiledMmaQK mma_qk;
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
  PFrag<T> P1, P0;

  auto step = [&](auto next_c, int b0) CUTLASS_LAMBDA_FUNC_INLINE {
    constexpr bool kNext = decltype(next_c)::value;  // blocks b0 + 2 and b0 + 3 exist
    const uint32_t g0 = g_base + uint32_t(b0);
    const int tok1 = (w.first_page + b0 + 1) * kBlockN;
    const float sl2[2] = {ss.row_scale_log2[ri.row[0]], ss.row_scale_log2[ri.row[1]]};

    // ---- softmax of block 1 against m0: m1 = max(m0, rowmax S1); P1 -> p[1] ----
    float sc1[2], sc01[2];
    fold_stacked_terms<T>(tSrS);
    softmax_block1<T::kStackedTerms>(ss, w, ri, lane, tok1, sl2, tSrS, row_sum, sc1, sc01,
                                     [&]() CUTLASS_LAMBDA_FUNC_INLINE {
      uint32_t words[8];
      p_fragment<T::kPTerms2>(tSrS, words);
      store_p(ss.p[1], tid, words);
      P1.set(words);
    });

    // ---- O_R = O_R sc0 sc1 + P1 V1R + (P0 sc1) V0R; then the next S = Q K1^T (block b0 + 3) ----
    rescale_o(tOrO, sc01);
    wait_vt<T, 1>(ss, g0 + 1);
    pv_block<T, 1>(tid, ss, g0 + 1, P1, tOrO);
    NamedBarrier::sync(kNumConsumerThreads, uint32_t(NamedBarriers::kP0Ready));
    // P0 gets registers of its own, so that both products overlap.
    {
      uint32_t words[8];
      load_p(ss.p[0], tid, words);
      P0.set(words);
    }
    wait_vt<T, 1>(ss, g0);
    pv_block<T, 1>(tid, ss, g0, P0, tOrO);
    if constexpr (kNext) qk_block<T>(tid, ss, g0 + 3, tSrS);
    warpgroup_wait<kNext ? 2 : 1>();
    release_vt<T, 1>(ss, g0 + 1, lane);
    warpgroup_wait<kNext ? 1 : 0>();
    warpgroup_fence_operand(tOrO);
    release_vt<T, 1>(ss, g0, lane);
    if constexpr (kNext) {
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
      release_kv_stage<T>(ss, int(stage_of(g0 + 3, T::kStages)), lane);
    }
  };

  qk_block<T>(tid, ss, g_base + 1, tSrS);
  warpgroup_wait<0>();
  warpgroup_fence_operand(tSrS);
  clear(tOrO);
  release_kv_stage<T>(ss, int(stage_of(g_base + 1, T::kStages)), lane);
  run_steps(nblk, step);
}

}  // namespace flashmla_backend::sm90::decode_fp8
