// The seesaw plan of the sm90 sparse decode kernel (kernel.cuh; FLASHMLA_BACKEND_SPARSE_DEBUG bit 64 runs it): the
// dense FP8 kernel's schedule (decode_fp8/mainloop.cuh, with the accurate mode's fp16 P hand-off of
// mainloop_f16pv.cuh) on gathered blocks. Blocks are taken in pairs (b0, b0 + 1); warpgroup 0 computes the whole
// Q K^T (four groups, two e4m3 terms of q, the group scales folded; the rope) and the softmax of b0, warpgroup 1 those
// of b0 + 1, against warpgroup 0's running max, so each block's scores, exponentials and fold are computed once
// (the split plan computes its softmax in both warpgroups) and the two warpgroups are half a step apart: one's
// CUDA-core work runs under the other's wgmma. Each hands its P to the other in fp16 (8 KB a direction), and each
// builds the two-term e4m3 words of its own two groups (warpgroup w: groups 2 w, 2 w + 1, V^T half w) for both
// blocks, in block order (one V^T slot a half):
//   warpgroup 0: O_L = (O_L sc0 + P0 V0L) sc1 + P1 V1L
//   warpgroup 1: O_R = O_R sc0 sc1 + (P0 sc1) V0R + P1 V1R
// with sc0 = exp2(m - m0), sc1 = exp2(m0 - m1) and each group's factor ratio applied where it went down.
// The tokens' scales go to a ring of their own (kScaleSlots blocks, released once both warpgroups built their words
// of the block), so that a KV stage is free as soon as its owner's Q K^T and the transposition are done. A row piece
// with an odd number of blocks gets one more, gathered past its counted entries (zeros, an empty mask).
// Written after the GPU time of the session that measured the split plan; not yet run on a GPU.
#pragma once

#include <cuda_fp16.h>

#include "sm90/sparse_fp8/common.cuh"

namespace flashmla_backend::sm90::sparse_fp8 {

constexpr int kScaleSlots = 4;                         // blocks whose scales are held: two steps
constexpr int kP16Words = 16;                          // a thread's 64 x 64 P in fp16: word k = (P(2 k), P(2 k + 1))
constexpr int kP16Bytes = kP16Words * 4 * kWgThreads;  // 8 KB

struct alignas(1024) SeesawStorage {
  alignas(1024) uint8_t q_latent[kQTerms * kLatentBytes];
  alignas(1024) uint8_t q_rope[kRopeBytes];
  alignas(1024) uint8_t stage[kStages][kStageBytes];     // latent and rope of block g in stage g % kStages (layout.h;
                                                         // its scale region unused)
  alignas(1024) uint8_t vt[2][decode_fp8::kVtHalfBytes];  // V^T half h, read by warpgroup h
  alignas(16) uint8_t p16[2][kP16Bytes];                 // P0 (warpgroup 0 -> 1) and P1 (1 -> 0), by thread
  alignas(16) float scales[kScaleSlots][kBlockTokens * kGroups];  // block g's token scales in slot g % kScaleSlots
  uint64_t mask[kScaleSlots];                            // block g's entries that name a token
  float row_scale_log2[kTileRows];
  float row_max[kTileRows];   // running max m (log2 domain), shared by both warpgroups
  float scale0[kTileRows];    // exp2(m - m0) of the current step (warpgroup 0)
  float scale1[kTileRows];    // exp2(m0 - m1) of the current step (warpgroup 1)
  float row_sum[2][kTileRows];
  // full[s]: block landed (the gather warp's lanes and lane 0's mask). empty[s]: the owner warpgroup's Q K^T (4 warps)
  // and the transposer warps (3) are done with stage s. sc_empty[c]: both consumer warpgroups built their words from
  // scale slot c (8 warps). vt_full / vt_empty: as in the split plan.
  cutlass::arch::ClusterBarrier full[kStages];
  cutlass::arch::ClusterBarrier empty[kStages];
  cutlass::arch::ClusterBarrier sc_empty[kScaleSlots];
  cutlass::arch::ClusterBarrier vt_full[2];
  cutlass::arch::ClusterBarrier vt_empty[2];
};
static_assert(int(sizeof(SeesawStorage)) + 1024 <= decode_fp8::kMaxSmemPerBlock, "shared memory plan exceeds 227 KB");

constexpr uint32_t kSeesawFullArrivals = 32 + 1;
constexpr uint32_t kSeesawEmptyArrivals = 4 + kTransposeWarps;
constexpr uint32_t kScaleEmptyArrivals = 8;

// Named barriers (non-.aligned forms, as in the split plan). kScale0Ready: warpgroup 0 wrote m0 and scale0.
// kScale1Ready: warpgroup 1 wrote m1, scale1 and P1. kP0Ready: warpgroup 0 wrote P0. kP0Free: warpgroup 1 read P0, so
// that warpgroup 0 may write the next one (an arrival a step that has a next one, a wait a step after a row piece's
// first).
enum class SeesawBar : uint32_t { kConsumers = kBarConsumers, kScale0Ready = 1, kScale1Ready = 2, kP0Ready = 3,
                                  kP0Free = 4 };

__device__ __forceinline__ void bar_sync(SeesawBar b) {
  NamedBarrier(kNumConsumerThreads, uint32_t(b)).arrive_and_wait_unaligned();
}
__device__ __forceinline__ void bar_arrive(SeesawBar b) {
  NamedBarrier(kNumConsumerThreads, uint32_t(b)).arrive_unaligned();
}

// ------------------------------------------------------------------------------------------------
// Producer: the gather warp (the transposer warps are common.cuh's, with padded pairs)
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ void seesaw_gather_warp(const DecodeParams& p, SeesawStorage& ss, const SchedMetaRow& meta,
                                                   int begin_req, int end_req, int m_block, int lane, int debug) {
  const uint8_t* cache = reinterpret_cast<const uint8_t*>(p.kv);
  uint32_t g = 0;
  for (int req = begin_req; req <= end_req; ++req) {
    const decode::RequestPiece w = decode::make_request_piece(p, meta, req, m_block);
    const int* row = p.indices + int64_t(req) * p.indices_stride;
    int stop;
    const int nblk = padded<true>(counted_blocks(p, w, stop));
    for (int blk = 0; blk < nblk; ++blk, ++g) {
      const int s = int(g % kStages), c = int(g % kScaleSlots);
      if (g >= uint32_t(kStages)) producer_wait(ss.empty[s], ((g / kStages) - 1) & 1u);
      if (g >= uint32_t(kScaleSlots)) producer_wait(ss.sc_empty[c], ((g / kScaleSlots) - 1) & 1u);
      const uint64_t mask =
          (debug & kDebugNoGather)
              ? ~uint64_t(0)
              : gather_block_warp(cute::cast_smem_ptr_to_uint(ss.stage[s]), cute::cast_smem_ptr_to_uint(ss.scales[c]),
                                  cache, p.num_kv_tokens, row, (w.first_page + blk) * kBlockTokens, stop, lane);
      cp_async_arrive_on(cute::cast_smem_ptr_to_uint(&ss.full[s]));
      if (lane == 0) {
        ss.mask[c] = mask;
        ss.full[s].arrive();
      }
    }
  }
  decode::cp_async_wait_all();
}

// ------------------------------------------------------------------------------------------------
// Consumer pieces
// ------------------------------------------------------------------------------------------------
// S = Q K^T of block g (all four groups and the rope), by the warpgroup that owns the block; the stage is released
// once the product completed (its scales stay in their slot).
template <class FragS>
__device__ __forceinline__ void seesaw_qk(SeesawStorage& ss, uint32_t g, int tid_in_wg, int lane, int debug,
                                          FragS& S) {
  const int s = int(g % kStages);
  consumer_wait(ss.full[s], (g / kStages) & 1u);
  cutlass::arch::fence_view_async_shared();  // the gather's cp.async writes (generic proxy), read by wgmma
  {
    typename QkTypes::TiledMmaLatent mma_s;
    Tensor tmp = partition_fragment_C(mma_s, Shape<Int<kTileRows>, Int<kBlockTokens>>{});
    sparse_qk_groups<kQTerms, 0, kGroups, 0, 4>(tid_in_wg, ss.q_latent, ss.q_rope, ss.stage[s],
                                                ss.scales[g % kScaleSlots], S, tmp);
  }
  warp_arrive(ss.empty[s], lane);
}

// P = 2^(S sl2 - m + 8) in place; the thread's partial row sums.
template <class FragS>
__device__ __forceinline__ void exp_block(FragS& S, const float (&sl2)[2], const float (&m_use)[2], float (&sum)[2]) {
  sum[0] = sum[1] = 0.f;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(S); ++i) {
    const int v = (i >> 1) & 1;
    S(i) = fast_exp2(fmaf(S(i), sl2[v], decode_fp8::kPScaleLog2 - m_use[v]));
    sum[v] += S(i);
  }
}

// P's fp16 words go to the other warpgroup's buffer as the dense accurate mode hands them over
// (decode_fp8/mainloop.cuh: p16_fragment, store_p, load_p: word k = (P(2 k), P(2 k + 1)), 16-byte chunks at
// (chunk, thread)).
template <class FragS>
__device__ __forceinline__ void store_p16(uint8_t* buf, int tid, const FragS& S) {
  uint32_t w[kP16Words];
  decode_fp8::p16_fragment(S, w);
  decode_fp8::store_p(buf, tid, w);
}
// The rows' new running max and this warpgroup's factor of the step (scale: ss.scale0 or ss.scale1), written by the
// first lane of each quad once the warp's lanes have read the old max.
__device__ __forceinline__ void publish_max(SeesawStorage& ss, float* scale, const int (&rows)[2], int lane,
                                            const float (&m_new)[2], const float (&sc)[2]) {
  __syncwarp();
  if ((lane & 3) == 0) {
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) {
      ss.row_max[rows[v]] = m_new[v];
      scale[rows[v]] = sc[v];
    }
  }
}

// Value idx of a fp16 P fragment (the accumulator's order), as float.
__device__ __forceinline__ float p16_at(const uint32_t (&w)[kP16Words], int idx) {
  const __half2 h = *reinterpret_cast<const __half2*>(&w[idx >> 1]);
  return (idx & 1) ? __high2float(h) : __low2float(h);
}

// O of this warpgroup's two groups += P V of block g (its V^T half kWG), P given by p_at(idx): factors updated first
// (O times ratio, and the row factor r, where they moved), the words built, the scale slot released, the product
// waited for and the V^T slot released.
template <int kWG, class FragO, class PAt>
__device__ __forceinline__ void seesaw_pv(SeesawStorage& ss, uint32_t g, int tid_in_wg, int lane, int debug,
                                          const float (&r)[2], float (&F)[2], FragO& o0, FragO& o1, PAt&& p_at) {
  constexpr int kG0 = 2 * kWG;
  const float* scales = ss.scales[g % kScaleSlots];
  float ratio[2];
  update_group_factors<kG0>(scales, lane, F, ratio);
  rescale_groups(o0, o1, r, ratio);
  uint32_t words0[kPTerms][8], words1[kPTerms][8];
  build_group_words<kG0>(p_at, scales, F, lane, debug, words0, words1);
  warp_arrive(ss.sc_empty[g % kScaleSlots], lane);
  consumer_wait(ss.vt_full[kWG], g & 1u);
  pv_two_groups(tid_in_wg, words0, words1, ss.vt[kWG], o0, o1);
  warp_arrive(ss.vt_empty[kWG], lane);
}

// ------------------------------------------------------------------------------------------------
// The consumer warpgroups
// ------------------------------------------------------------------------------------------------
template <int kWG>
__device__ __forceinline__ void seesaw_consumer_loop(const DecodeParams& p, SeesawStorage& ss, const SchedMetaRow& meta,
                                                     int begin_req, int end_req, int m_block, int tid, int debug) {
  const int tid_in_wg = tid % kWgThreads;
  const int lane = tid & 31;
  const int row_in_tile[2] = {16 * (tid_in_wg / 32) + lane / 4, 16 * (tid_in_wg / 32) + lane / 4 + 8};
  const int rows[2] = {m_block * kTileRows + row_in_tile[0], m_block * kTileRows + row_in_tile[1]};
  const float none[2] = {1.f, 1.f};

  typename QkTypes::TiledMmaLatent mma_s;
  typename PvTypes::TiledMma mma_o;
  uint32_t g_base = 0;
  for (int req = begin_req; req <= end_req; ++req) {
    const decode::RequestPiece w = decode::make_request_piece(p, meta, req, m_block);
    int stop;
    const int nblk = padded<true>(counted_blocks(p, w, stop));
    load_q_tile(p, ss, req, m_block, tid);
    if (tid < kTileRows) ss.row_max[tid] = -INFINITY;
    cutlass::arch::fence_view_async_shared();  // Q written by st.shared, read by wgmma
    consumers_sync();
    const float sl2[2] = {ss.row_scale_log2[row_in_tile[0]], ss.row_scale_log2[row_in_tile[1]]};

    Tensor o0 = partition_fragment_C(mma_o, Shape<Int<kTileRows>, Int<128>>{});  // O of group 2 kWG
    Tensor o1 = partition_fragment_C(mma_o, Shape<Int<kTileRows>, Int<128>>{});  // O of group 2 kWG + 1
    clear(o0);
    clear(o1);
    float row_sum[2] = {0.f, 0.f};
    float F[2] = {0.f, 0.f};
    Tensor S = partition_fragment_C(mma_s, Shape<Int<kTileRows>, Int<kBlockTokens>>{});
    if (nblk > 0) seesaw_qk(ss, g_base + kWG, tid_in_wg, lane, debug, S);

    for (int b0 = 0; b0 < nblk; b0 += 2) {
      const bool next = b0 + 2 < nblk;
      const uint32_t g0 = g_base + uint32_t(b0);
      if constexpr (kWG == 0) {
        // ---- softmax of block b0: m0 = max(m, rowmax S0) ----
        mask_block(S, ss.mask[g0 % kScaleSlots], lane);
        float mx[2], m_new[2], m_use[2], sc0[2], sum[2];
        block_row_max(S, mx);
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < 2; ++v)
          decode::update_max(ss.row_max[row_in_tile[v]], mx[v], sl2[v], m_new[v], m_use[v], sc0[v]);
        publish_max(ss, ss.scale0, row_in_tile, lane, m_new, sc0);
        bar_arrive(SeesawBar::kScale0Ready);
        exp_block(S, sl2, m_use, sum);
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < 2; ++v) row_sum[v] = row_sum[v] * sc0[v] + sum[v];
        if (b0 > 0) bar_sync(SeesawBar::kP0Free);
        store_p16(ss.p16[0], tid_in_wg, S);
        bar_arrive(SeesawBar::kP0Ready);

        // ---- O_L = O_L sc0 + P0 V0L ----
        seesaw_pv<0>(ss, g0, tid_in_wg, lane, debug, sc0, F, o0, o1, [&](int idx) { return S(idx); });

        // ---- warpgroup 1 decided m1: O_L = O_L sc1 + P1 V1L ----
        bar_sync(SeesawBar::kScale1Ready);
        float sc1[2];
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < 2; ++v) {
          sc1[v] = ss.scale1[row_in_tile[v]];
          row_sum[v] *= sc1[v];
        }
        {
          uint32_t p1[kP16Words];
          decode_fp8::load_p(ss.p16[1], tid_in_wg, p1);
          seesaw_pv<0>(ss, g0 + 1, tid_in_wg, lane, debug, sc1, F, o0, o1,
                       [&](int idx) { return p16_at(p1, idx); });
        }
        if (next) seesaw_qk(ss, g0 + 2, tid_in_wg, lane, debug, S);
      } else {
        // ---- softmax of block b0 + 1 against m0: m1 = max(m0, rowmax S1); P1 to warpgroup 0 ----
        mask_block(S, ss.mask[(g0 + 1) % kScaleSlots], lane);
        float mx[2];
        block_row_max(S, mx);
        bar_sync(SeesawBar::kScale0Ready);
        float sc0[2], sc1[2], m_new[2], m_use[2], sum[2];
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < 2; ++v) {
          sc0[v] = ss.scale0[row_in_tile[v]];
          decode::update_max(ss.row_max[row_in_tile[v]], mx[v], sl2[v], m_new[v], m_use[v], sc1[v]);
        }
        publish_max(ss, ss.scale1, row_in_tile, lane, m_new, sc1);
        exp_block(S, sl2, m_use, sum);
        store_p16(ss.p16[1], tid_in_wg, S);
        bar_arrive(SeesawBar::kScale1Ready);
        float sc01[2];
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < 2; ++v) {
          sc01[v] = sc0[v] * sc1[v];
          row_sum[v] = row_sum[v] * sc01[v] + sum[v];
        }

        // ---- O_R = O_R sc0 sc1 + (P0 sc1) V0R ----
        bar_sync(SeesawBar::kP0Ready);
        {
          uint32_t p0[kP16Words];
          decode_fp8::load_p(ss.p16[0], tid_in_wg, p0);
          if (next) bar_arrive(SeesawBar::kP0Free);
          seesaw_pv<1>(ss, g0, tid_in_wg, lane, debug, sc01, F, o0, o1,
                       [&](int idx) { return p16_at(p0, idx) * sc1[(idx >> 1) & 1]; });
        }
        // ---- O_R += P1 V1R (P1 still in S) ----
        seesaw_pv<1>(ss, g0 + 1, tid_in_wg, lane, debug, none, F, o0, o1, [&](int idx) { return S(idx); });
        if (next) seesaw_qk(ss, g0 + 3, tid_in_wg, lane, debug, S);
      }
    }
    g_base += uint32_t(nblk);

    // ---- epilogue: the two warpgroups' row sums, the final max ----
    if (req == end_req) pdl_launch_dependents();
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) row_sum[v] = decode::quad_sum(row_sum[v]);
    if ((lane & 3) == 0) {
      ss.row_sum[kWG][row_in_tile[0]] = row_sum[0];
      ss.row_sum[kWG][row_in_tile[1]] = row_sum[1];
    }
    consumers_sync();  // row sums written, the last m1 written and read; both warpgroups past their last wgmma
    float l[2], m[2];
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) {
      l[v] = ss.row_sum[0][row_in_tile[v]] + ss.row_sum[1][row_in_tile[v]];
      m[v] = ss.row_max[row_in_tile[v]];
    }
    store_rows<kWG>(p, w, rows, lane, o0, o1, F, l, m);
    consumers_sync();  // row_max, row_sum and the Q tile are rewritten by the next row piece
  }
}

}  // namespace flashmla_backend::sm90::sparse_fp8
