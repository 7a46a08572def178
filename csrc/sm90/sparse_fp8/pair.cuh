// The pair plan of the sm90 sparse decode kernel's consumer warpgroups (kernel.cuh), a candidate behind the build
// switch FMLA_SPARSE_PAIR; lead.cuh's plan is the default. Each warpgroup owns two of the four latent groups (warpgroup
// w: groups 2 w and 2 w + 1, O of 256 output columns, V^T half w) and computes the scores and the softmax of every
// other block of a row piece (warpgroup w: the blocks blk with blk % 2 == w), so that one warpgroup's CUDA-core work
// (the folds, the softmax, the words) runs under the other's wgmma. In the lead plan warpgroup 0 issues every
// block's 40 Q K^T products and runs every softmax, and since about eight wgmma can be outstanding in an SM
// (checks/wgmma_issue_probe.cu) its softmax cannot run under its own products: with the producer's work left out its
// chain alone took 149.5 µs at b128 top-k 2048 (docs/perf/journal.md, 2026-12-02), above the 142 µs target.
//
// Per row piece, warpgroup w runs, for its blocks j = w, w + 2, ...:
//   softmax(j) -> [w = 1, j = 1: P V(0)] -> P V(j) -> Q K^T(j + 2) -> P V(j + 1)
// after the Q K^T of its first block; every P V of the row piece is taken in block order (O is rescaled to each
// block's running max before its product), and V^T half w is used by one warpgroup, so a P V's V^T is written by the
// transposer warps while the warpgroup runs the Q K^T between its two P V.
// The running max of block g goes to the other warpgroup through mrun[g % 2] (m_full: the owner's four warps),
// before the block's exponentials; P in fp16 through the lead plan's P slots (p_full: the owner, p_empty: the other
// warpgroup, after its words). Each warpgroup sums the P of its own blocks (at the max of its latest block), and the
// two parts are added once a row piece, at the barrier that also frees the Q tile: both warpgroups read the Q tile,
// so a later tile is made as the first one is, by both (heads 0..31 and 32..63), between two consumer barriers.
// Registers: O of two groups (128), S and one Q K^T temporary (64), the words of a P V (32); the Q K^T of a block is
// therefore issued one group at a time, each folded once it completed (the lead plan's two temporaries do not fit).
#pragma once

#include "sm90/sparse_fp8/lead.cuh"

namespace flashmla_backend::sm90::sparse_fp8 {

constexpr int kPairRegs = 224;
static_assert(kWgThreads * (2 * kPairRegs + kProducerRegs) <= decode_fp8::kCtaRegisters,
              "register split exceeds the CTA's allocation");
constexpr uint32_t kMFullArrivals = 4;  // the owner's four warps, once a block

// S = Q K^T of block g (the rope, then groups 0..3 into one temporary, each folded once complete), after its stage
// landed. The folds are sparse_qk_block's operations in its order, so the scores are the lead plan's bits.
template <class FragS>
__device__ __forceinline__ void pair_qk(LeadStorage& ss, uint32_t g, int tid_in_wg, uint32_t hint, FragS& S,
                                        FragS& t) {
  const int s = int(g % kStages);
  consumer_wait(ss.full[s], (g / kStages) & 1u, hint);
  FMLA_TL(ss, int(threadIdx.x / kWgThreads), kTlFull, tid_in_wg == 0);
  cutlass::arch::fence_view_async_shared();  // the gather's cp.async writes (generic proxy), read by wgmma
  uint8_t* stage = ss.stage[s];
  qk_issue_rope(tid_in_wg, ss.q_rope, stage, S);
#pragma unroll 1
  for (int gr = 0; gr < kGroups; ++gr) {
    qk_issue_group<kQTerms>(tid_in_wg, ss.q_latent, stage, gr, t);
    warpgroup_wait<0>();
    qk_fold_group(tid_in_wg, stage, gr, t, S);
  }
  FMLA_TL(ss, int(threadIdx.x / kWgThreads), kTlQk, tid_in_wg == 0);
}

#if defined(FMLA_SPARSE_PAIR_QK2)
// The candidate order: group 0 straight into S (scaled in place by its tokens' scales once complete) with group 1
// into the temporary in flight beside it, then groups 2 and 3, the rope product accumulated into S with group 3:
// three waits a block instead of four (the sums in another order than sparse_qk_block's, so other bits).
template <class FragS>
__device__ __forceinline__ void pair_qk2(LeadStorage& ss, uint32_t g, int tid_in_wg, uint32_t hint, FragS& S,
                                         FragS& t) {
  const int s = int(g % kStages);
  consumer_wait(ss.full[s], (g / kStages) & 1u, hint);
  FMLA_TL(ss, int(threadIdx.x / kWgThreads), kTlFull, tid_in_wg == 0);
  cutlass::arch::fence_view_async_shared();
  uint8_t* stage = ss.stage[s];
  const float* scales = reinterpret_cast<const float*>(stage + kScalesAt);
  const int lane = tid_in_wg & 31;
  qk_issue_group<kQTerms>(tid_in_wg, ss.q_latent, stage, 0, S);
  qk_issue_group<kQTerms>(tid_in_wg, ss.q_latent, stage, 1, t);
  warpgroup_wait<1>();
  warpgroup_fence_operand(S);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(S); ++i) S(i) *= scales[(8 * (i >> 2) + 2 * (lane & 3) + (i & 1)) * kGroups];
  warpgroup_wait<0>();
  qk_fold_group(tid_in_wg, stage, 1, t, S);
  qk_issue_group<kQTerms>(tid_in_wg, ss.q_latent, stage, 2, t);
  warpgroup_wait<0>();
  qk_fold_group(tid_in_wg, stage, 2, t, S);
  qk_issue_group<kQTerms>(tid_in_wg, ss.q_latent, stage, 3, t);
  qk_issue_rope<true>(tid_in_wg, ss.q_rope, stage, S);
  warpgroup_wait<0>();
  qk_fold_group(tid_in_wg, stage, 3, t, S);
  FMLA_TL(ss, int(threadIdx.x / kWgThreads), kTlQk, tid_in_wg == 0);
}
#endif

// The running max of block g (the other warpgroup's), from mrun once its owner published it.
__device__ __forceinline__ void pair_read_max(LeadStorage& ss, uint32_t g, const int (&row_in_tile)[2], uint32_t hint,
                                              float (&mx)[2]) {
  const int c = int(g % 2);
  consumer_wait(ss.m_full[c], (g / 2) & 1u, hint);
  mx[0] = ss.mrun[c][row_in_tile[0]];
  mx[1] = ss.mrun[c][row_in_tile[1]];
}

__device__ __forceinline__ void pair_loop(const DecodeParams& p, LeadStorage& ss, const SchedMetaRow& meta,
                                          int begin_req, int end_req, int m_block, int wg, int tid, int debug) {
  const int tid_in_wg = tid % kWgThreads;
  const int lane = tid & 31;
  const uint32_t hint = suspend_hint(debug);
  int row_in_tile[2], rows[2];
  thread_rows(tid_in_wg, m_block, row_in_tile, rows);
  const int slot = wg * kWgThreads + tid_in_wg;  // the Q tile's slot this thread makes (heads 32 wg ..)

  typename QkTypes::TiledMmaLatent mma_s;
  typename PvTypes::TiledMma mma_o;
  first_q_tile_slot(p, ss, begin_req, m_block, slot);
  NamedBarrier(kNumConsumerThreads, kBarFirstQ).arrive_and_wait_unaligned();
  FMLA_TL(ss, wg, kTlFirstQ, tid_in_wg == 0);
  uint32_t g0 = 0;  // the row piece's first block, counted over the CTA's blocks (slots and phases)
  for (int req = begin_req; req <= end_req; ++req) {
    const decode::RequestPiece w = decode::make_request_piece(p, meta, req, m_block);
    const float sl2[2] = {ss.row_scale_log2[row_in_tile[0]], ss.row_scale_log2[row_in_tile[1]]};
    const bool next = req < end_req;

    Tensor oa = partition_fragment_C(mma_o, Shape<Int<kTileRows>, Int<128>>{});  // O of group 2 wg
    Tensor ob = partition_fragment_C(mma_o, Shape<Int<kTileRows>, Int<128>>{});  // O of group 2 wg + 1
    clear(oa);
    clear(ob);
    float F[2] = {0.f, 0.f};                // the groups' running factors (pv.cuh), from the last block's
    float lsum[2] = {0.f, 0.f};             // this warpgroup's part of the row sums: its blocks' P, at max mL
    float mL[2] = {-INFINITY, -INFINITY};
    float mO[2] = {-INFINITY, -INFINITY};   // the running max O is at: the block before the next P V's

    int stop;
    const int nblk = counted_blocks(p, w, stop);
    Tensor S = partition_fragment_C(mma_s, Shape<Int<kTileRows>, Int<kBlockTokens>>{});
    Tensor t = partition_fragment_C(mma_s, Shape<Int<kTileRows>, Int<kBlockTokens>>{});

    // O_g += P_g V_g of block blk for this warpgroup's two groups, mx the block's running max: O rescaled to it (and
    // by the groups' ratios), the words from P in its slot (the other warpgroup's P once p_full; this warpgroup's own
    // as its threads stored it), both products waited for and V^T half wg released (one arrival a warp and group).
    const auto pv = [&](int blk, const float (&mx)[2], bool own) CUTLASS_LAMBDA_FUNC_INLINE {
      const uint32_t g = g0 + uint32_t(blk);
      const int s = int(g % kStages);
      const int c = int(g % kPSlots);
      if (!own) consumer_wait(ss.p_full[c], (g / kPSlots) & 1u, hint);
      FMLA_TL(ss, wg, kTlPFull, tid_in_wg == 0 && !own);
      consumer_wait(ss.vt_full[wg], g & 1u, hint);  // publishes the block's factors and pairs too
      FMLA_TL(ss, wg, kTlVt0, tid_in_wg == 0);
      const float4 f = *reinterpret_cast<const float4*>(&ss.gfac[s][2 * wg][0]);  // (ratio, F) of both groups
      const float ratio_a[1] = {f.x}, ratio_b[1] = {f.z};
      F[0] = f.y;
      F[1] = f.w;
      float sc[2];
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < 2; ++v) {
        const float m_use = mx[v] == -INFINITY ? 0.f : mx[v];
        sc[v] = fast_exp2(mO[v] - m_use);  // decode::update_max's factor: the same bits as the lead plan's
        mO[v] = mx[v];
      }
      if (rescale_needed(sc, ratio_a)) rescale_group(oa, sc, ratio_a[0]);
      if (rescale_needed(sc, ratio_b)) rescale_group(ob, sc, ratio_b[0]);
      const uint32_t p_base = decode_fp8::p_chunk_base(ss.p16[c], tid_in_wg);
      const auto p_chunk = [&](int k, uint32_t (&p4)[4])
                               CUTLASS_LAMBDA_FUNC_INLINE { decode_fp8::load_p_chunk(p_base, k, p4); };
      uint32_t wa[kPTerms][8], wb[kPTerms][8];
      uint8_t* vt = ss.vt[wg];
#if defined(FMLA_SPARSE_PAIR_WOVL)
      build_words(p_chunk, &ss.sf[s][2 * wg][0][0], lane, debug, wa);
      sparse_pv_group<kPTerms>(tid_in_wg, wa, vt, oa);
      build_words(p_chunk, &ss.sf[s][2 * wg + 1][0][0], lane, debug, wb);
      if (!own) warp_arrive(ss.p_empty[c], lane);
      sparse_pv_group<kPTerms>(tid_in_wg, wb, vt + decode_fp8::kVtHalfBytes / 2, ob);
#else
      build_words(p_chunk, &ss.sf[s][2 * wg][0][0], lane, debug, wa);
      build_words(p_chunk, &ss.sf[s][2 * wg + 1][0][0], lane, debug, wb);
      if (!own) warp_arrive(ss.p_empty[c], lane);
      sparse_pv_group<kPTerms>(tid_in_wg, wa, vt, oa);
      sparse_pv_group<kPTerms>(tid_in_wg, wb, vt + decode_fp8::kVtHalfBytes / 2, ob);
#endif
      warpgroup_wait<0>();
      warpgroup_fence_operand(oa);
      warpgroup_fence_operand(ob);
      keep_words(wa);
      keep_words(wb);
      FMLA_TL(ss, wg, kTlBlockDone, tid_in_wg == 0);
      warp_arrive(ss.vt_empty[wg], lane);
      warp_arrive(ss.vt_empty[wg], lane);
    };
    // The softmax of this warpgroup's block blk (S = its scores): the running max after the block before (the other
    // warpgroup's, none at blk 0) and this block's published (m_full) before the exponentials; P into S and to its
    // slot (p_full), once the other warpgroup has read the slot's block before (p_empty); the stage released (its
    // Q K^T and mask read). m: the block's running max; m_before: the block before's (kept: its mrun slot is the
    // other warpgroup's to rewrite once this block's max is published).
    const auto softmax = [&](int blk, float (&m)[2], float (&m_before)[2]) CUTLASS_LAMBDA_FUNC_INLINE {
      const uint32_t g = g0 + uint32_t(blk);
      const int s = int(g % kStages);
      const int c = int(g % kPSlots);
      m_before[0] = m_before[1] = -INFINITY;
      if (blk > 0) pair_read_max(ss, g - 1, row_in_tile, hint, m_before);
      mask_block(S, ss.mask[ss.mask_slot(g)], lane);
      float mx[2], m_use[2];
      block_row_max(S, mx);
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < 2; ++v) {
        float sc_unused;
        decode::update_max(m_before[v], mx[v], sl2[v], m[v], m_use[v], sc_unused);
      }
      if ((lane & 3) == 0) {
        ss.mrun[g % 2][row_in_tile[0]] = m[0];
        ss.mrun[g % 2][row_in_tile[1]] = m[1];
      }
      warp_arrive(ss.m_full[g % 2], lane);
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < 2; ++v) {
        lsum[v] *= fast_exp2(mL[v] - m_use[v]);  // mL -inf: 0 (the sum is 0 then)
        mL[v] = m[v];
      }
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(S); ++i) {
        const int v = (i >> 1) & 1;
        S(i) = fast_exp2(fmaf(S(i), sl2[v], decode_fp8::kPScaleLog2 - m_use[v]));
        lsum[v] += S(i);
      }
      FMLA_TL(ss, wg, kTlSoftmax, tid_in_wg == 0);
      if (g >= uint32_t(kPSlots)) consumer_wait(ss.p_empty[c], ((g / kPSlots) - 1) & 1u, hint);
      uint32_t p16[kP16Words];
      decode_fp8::p16_fragment(S, p16);
      decode_fp8::store_p(ss.p16[c], tid_in_wg, p16);
      warp_arrive(ss.p_full[c], lane);
      warp_arrive(ss.empty[s], lane);
      FMLA_TL(ss, wg, kTlPHanded, tid_in_wg == 0);
    };

#if defined(FMLA_SPARSE_PAIR_QK2)
#define FMLA_PAIR_QK pair_qk2
#else
#define FMLA_PAIR_QK pair_qk
#endif
    if (wg < nblk) FMLA_PAIR_QK(ss, g0 + uint32_t(wg), tid_in_wg, hint, S, t);
    for (int j = wg; j < nblk; j += 2) {
      float mj[2], m_before[2];
      softmax(j, mj, m_before);
      if (j == 1) pv(0, m_before, false);  // warpgroup 1's first block: warpgroup 0's block 0 goes first
      pv(j, mj, true);
      if (j + 2 < nblk) FMLA_PAIR_QK(ss, g0 + uint32_t(j + 2), tid_in_wg, hint, S, t);
      if (j + 1 < nblk) {
        float mn[2];
        pair_read_max(ss, g0 + uint32_t(j + 1), row_in_tile, hint, mn);
        pv(j + 1, mn, false);
      }
    }
    if (wg == 1 && nblk == 1) {  // warpgroup 0's only block
      float m0[2];
      pair_read_max(ss, g0, row_in_tile, hint, m0);
      pv(0, m0, false);
    }

    // ---- epilogue: the row sums added over both warpgroups at the last block's max (mO) ----
    float l[2];
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) {
      const float m_use = mO[v] == -INFINITY ? 0.f : mO[v];
      l[v] = decode::quad_sum(lsum[v] * fast_exp2(mL[v] - m_use));
    }
    if ((lane & 3) == 0) {
      ss.rsum[wg][row_in_tile[0]] = l[0];
      ss.rsum[wg][row_in_tile[1]] = l[1];
    }
    NamedBarrier(kNumConsumerThreads, kBarFirstQ).arrive_and_wait_unaligned();  // also: the Q tile is read
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) l[v] = ss.rsum[0][row_in_tile[v]] + ss.rsum[1][row_in_tile[v]];
    if (req == end_req) pdl_launch_dependents();
    if (next) {
      q_slot_copy(p, ss, req + 1, m_block, slot);
      decode::cp_async_commit();
    }
    float inv[2];
    inv_out(F[0], l, inv);
    store_group(p, w, 2 * wg, rows, lane, oa, inv);
    inv_out(F[1], l, inv);
    store_group(p, w, 2 * wg + 1, rows, lane, ob, inv);
    if (wg == 0) store_lse(p, w, rows, lane, l, mO);
    FMLA_TL(ss, wg, kTlEpilogue, tid_in_wg == 0);
    if (next) {
      decode::cp_async_wait_all();  // this thread's own copies: the split reads only them
      q_slot_split(p, ss, slot);
      cutlass::arch::fence_view_async_shared();
      NamedBarrier(kNumConsumerThreads, kBarFirstQ).arrive_and_wait_unaligned();
      FMLA_TL(ss, wg, kTlNextQ, tid_in_wg == 0);
    }
    g0 += uint32_t(nblk);
  }
  FMLA_TL_FINISH(ss, wg, tid_in_wg == 0);
}

}  // namespace flashmla_backend::sm90::sparse_fp8
