// A candidate division of the sparse kernel's consumer work (FMLA_SPARSE_SCORES_TO_WG1=1, not yet run on a GPU):
// warpgroup 0 computes every block's scores and hands them to warpgroup 1, which runs the softmax and hands P back.
//   warpgroup 0: S = Q K^T (all groups, masked), S to warpgroup 1, the next block's Q K^T, then O_0 += P_0 V_0 with
//                P from warpgroup 1
//   warpgroup 1: the softmax of S (P, the rows' factors and sums), P to warpgroup 0, O_g += P_g V_g (g = 1, 2, 3)
// Why (docs/perf/journal.md, 2026-12-03): a warpgroup can have about eight wgmma outstanding and issuing more blocks it
// (checks/wgmma_issue_probe.cu), so warpgroup 0's 40 products a block are on its own path, and in lead.cuh's order its
// softmax, P hand-off and landing test (0.9 µs of a 2.65 µs block with the producer's work left out, at 1.75 GHz) come
// on top; warpgroup 1 meanwhile waits 1.0-1.7 µs a block for warpgroup 0. Here warpgroup 0's chain is its products,
// its folds, its group 0 words and two 16 KB hand-offs; warpgroup 1 takes the softmax into the time it waited. The
// scores cost 16 KB of shared memory (222 KB in all) and the block's time one more hand-off.
//
// Shared memory (lead.cuh: LeadStorage): the S slot (fp32, by thread: 8 chunks of 16 bytes at (chunk, thread), as
// decode_fp8::store_p lays out P) and s_full (warpgroup 0's 4 warps); the P slots, their rows' factors sc and, with a
// row piece's last P, its rows' final sums rsum, now written by warpgroup 1 (p_full, its 4 warps) and read by warpgroup
// 0; the stages, V^T halves and factor slots as in lead.cuh.
// Ordering, beyond lead.cuh's:
// - Neither the S slot nor a P slot needs a barrier for its release: warpgroup 0 writes block g's scores after its
//   wait for P of block g - 1 (and its read of it), which warpgroup 1 wrote after reading the scores of block g - 1;
//   warpgroup 1 writes P of block g after reading block g's scores, which warpgroup 0 wrote after reading P of block
//   g - 1 (so one P slot would do). checks/protocol_model.py plays the order without those waits ("w1").
// - Warpgroup 0 masks S itself and gives the stage back right after the block's Q K^T (its K, scales and mask read):
//   warpgroup 1 reads no stage. Warpgroup 0 still reads the block's group 0 factors and pairs (factor slot g %
//   kStages) at its words, after the release: the transposer warps rewrite that slot for block g + 2 only after their
//   V^T half 0 of block g + 1, which waited for warpgroup 0's P V of group 0 of block g (vt_empty[0]), after its words.
// - The rows' scale (row_scale_log2) is read by warpgroup 1 after its wait for the first block of a row piece:
//   warpgroup 0 wrote it with the row piece's Q tile before that block's Q K^T, and rewrites it for the next row piece
//   only after its wait for the last P of this one.
// - lse is stored by warpgroup 1 (it keeps m and l); warpgroup 0 gets the rows' final sums with the last P.
// qk_issued is not used: the order of the two warpgroups' products on the tensor cores is left to their issue.
// FMLA_SPARSE_SCORES_TO_WG1=2 also has warpgroup 1 build each group's words while the P V before it runs (two word
// sets: 12 bytes of spills at 248 registers), for where warpgroup 1's chain is the longer one.
#pragma once

#include "sm90/sparse_fp8/lead.cuh"

namespace flashmla_backend::sm90::sparse_fp8 {

#if FMLA_SPARSE_SCORES_TO_WG1

constexpr uint32_t kSSlotArrivals = 4;  // s_full: warpgroup 0's 4 warps
static_assert(int(sizeof(LeadStorage::s32)) == 8 * 16 * kWgThreads, "S slot: eight 16-byte chunks a thread");

// A thread's 32 fp32 scores (a 64 x 64 accumulator fragment) to and from the S slot, chunk c = elements 4c .. 4c + 3.
template <class FragS>
__device__ __forceinline__ void store_scores(uint8_t* buf, int tid, const FragS& S) {
  const uint32_t base = cute::cast_smem_ptr_to_uint(buf) + uint32_t(tid * 16);
  CUTLASS_PRAGMA_UNROLL
  for (int c = 0; c < 8; ++c) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(base + uint32_t(c * 2048)), "f"(S(4 * c)),
                 "f"(S(4 * c + 1)), "f"(S(4 * c + 2)), "f"(S(4 * c + 3))
                 : "memory");
  }
}
template <class FragS>
__device__ __forceinline__ void load_scores(const uint8_t* buf, int tid, FragS& S) {
  const uint32_t base = cute::cast_smem_ptr_to_uint(buf) + uint32_t(tid * 16);
  CUTLASS_PRAGMA_UNROLL
  for (int c = 0; c < 8; ++c) {
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(S(4 * c)), "=f"(S(4 * c + 1)), "=f"(S(4 * c + 2)), "=f"(S(4 * c + 3))
                 : "r"(base + uint32_t(c * 2048))
                 : "memory");
  }
}

// ------------------------------------------------------------------------------------------------
// Warpgroup 0
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ void w1_lead_loop(const DecodeParams& p, LeadStorage& ss, const SchedMetaRow& meta,
                                             int begin_req, int end_req, int m_block, int tid, int debug) {
  const int tid_in_wg = tid % kWgThreads;
  const int lane = tid & 31;
  const uint32_t hint = suspend_hint(debug);
  int row_in_tile[2], rows[2];
  thread_rows(tid_in_wg, m_block, row_in_tile, rows);

  typename QkTypes::TiledMmaLatent mma_s;
  typename PvTypes::TiledMma mma_o;
  // The first row piece's Q tile: heads 0..31 here, 32..63 in warpgroup 1 (common.cuh: q_slot_split).
  first_q_tile_slot(p, ss, begin_req, m_block, tid_in_wg);
  NamedBarrier(kNumConsumerThreads, kBarFirstQ).arrive_and_wait_unaligned();
  FMLA_TL(ss, kTlLead, kTlFirstQ, tid_in_wg == 0);
  uint32_t g = 0;
  for (int req = begin_req; req <= end_req; ++req) {
    const decode::RequestPiece w = decode::make_request_piece(p, meta, req, m_block);
    Tensor o = partition_fragment_C(mma_o, Shape<Int<kTileRows>, Int<128>>{});  // O of group 0
    clear(o);
    float F = 0.f;
    float l[2] = {0.f, 0.f};  // the rows' final sums, from warpgroup 1 with the row piece's last P (0 without one)

    int stop;
    const int nblk = counted_blocks(p, w, stop);
    Tensor S = partition_fragment_C(mma_s, Shape<Int<kTileRows>, Int<kBlockTokens>>{});
    Tensor t0 = partition_fragment_C(mma_s, Shape<Int<kTileRows>, Int<kBlockTokens>>{});
    Tensor t1 = partition_fragment_C(mma_s, Shape<Int<kTileRows>, Int<kBlockTokens>>{});
    const bool next = req < end_req;
    if (nblk > 0) lead_qk(ss, g, tid_in_wg, hint, S, t0, t1);
    for (int blk = 0; blk < nblk; ++blk, ++g) {
      const int s = int(g % kStages);
      const int c = int(g % kPSlots);
      // ---- block g's scores masked, its stage given back, the scores to warpgroup 1 ----
      mask_block(S, ss.mask[ss.mask_slot(g)], lane);
      warp_arrive(ss.empty[s], lane);
      store_scores(ss.s32, tid_in_wg, S);  // free: block g - 1's P was waited for (header)
      warp_arrive(ss.s_full, lane);
      FMLA_TL(ss, kTlLead, kTlPHanded, tid_in_wg == 0);  // the timeline's p_handed: here the scores handed
      // ---- the next block's scores (S is free), or the next row piece's Q tile (its last Q K^T is complete) ----
      if (blk + 1 < nblk) {
        lead_qk(ss, g + 1, tid_in_wg, hint, S, t0, t1);
      } else if (next) {
        copy_next_q_tile(p, ss, req + 1, m_block, tid_in_wg);
      }
      // ---- O_0 = O_0 sc + P_0 V_0 of block g, P and the rows' factors from warpgroup 1 ----
      consumer_wait(ss.p_full[c], (g / kPSlots) & 1u, hint);
      const float sc[2] = {ss.sc[c][row_in_tile[0]], ss.sc[c][row_in_tile[1]]};
      if (blk + 1 == nblk) {
        l[0] = ss.rsum[c][row_in_tile[0]];
        l[1] = ss.rsum[c][row_in_tile[1]];
      }
      consumer_wait(ss.vt_full[0], g & 1u, hint);
      FMLA_TL(ss, kTlLead, kTlVt0, tid_in_wg == 0);
      const float2 gf = *reinterpret_cast<const float2*>(&ss.gfac[s][0][0]);  // (ratio, F) of group 0
      const float ratio[1] = {gf.x};
      F = gf.y;
      if (rescale_needed(sc, ratio)) rescale_group(o, sc, gf.x);
      uint32_t words[kPTerms][8];
      const uint32_t p_base = decode_fp8::p_chunk_base(ss.p16[c], tid_in_wg);
      build_words([&](int k, uint32_t (&p4)[4]) CUTLASS_LAMBDA_FUNC_INLINE { decode_fp8::load_p_chunk(p_base, k, p4); },
                  &ss.sf[s][0][0][0], lane, debug, words);
      FMLA_TL(ss, kTlLead, kTlWords, tid_in_wg == 0);
      sparse_pv_group<kPTerms>(tid_in_wg, words, ss.vt[0], o);
      warpgroup_wait<0>();
      warpgroup_fence_operand(o);
      keep_words(words);
      warp_arrive(ss.vt_empty[0], lane);
      FMLA_TL(ss, kTlLead, kTlPv0Done, tid_in_wg == 0);
    }

    // ---- epilogue (lse: warpgroup 1), and the next row piece's Q tile, made by this warpgroup alone ----
    if (req == end_req) pdl_launch_dependents();
    float inv[2];
    inv_out(F, l, inv);
    store_group(p, w, 0, rows, lane, o, inv);
    FMLA_TL(ss, kTlLead, kTlEpilogue, tid_in_wg == 0);
    if (next) {
      if (nblk == 0) copy_next_q_tile(p, ss, req + 1, m_block, tid_in_wg);  // no block: not copied yet
      split_next_q_tile(p, ss, tid_in_wg);
    }
  }
  FMLA_TL_FINISH(ss, kTlLead, tid_in_wg == 0);
}

// ------------------------------------------------------------------------------------------------
// Warpgroup 1
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ void w1_follow_loop(const DecodeParams& p, LeadStorage& ss, const SchedMetaRow& meta,
                                               int begin_req, int end_req, int m_block, int tid, int debug) {
  const int tid_in_wg = tid % kWgThreads;
  const int lane = tid & 31;
  const uint32_t hint = suspend_hint(debug);
  int row_in_tile[2], rows[2];
  thread_rows(tid_in_wg, m_block, row_in_tile, rows);

  typename QkTypes::TiledMmaLatent mma_s;
  typename PvTypes::TiledMma mma_o;
  // Heads 32..63 of the first row piece's Q tile; warpgroup 0 waits for them, this one does not.
  first_q_tile_slot(p, ss, begin_req, m_block, kWgThreads + tid_in_wg);
  NamedBarrier(kNumConsumerThreads, kBarFirstQ).arrive_unaligned();
  FMLA_TL(ss, kTlFollow, kTlFirstQ, tid_in_wg == 0);
  uint32_t g = 0;
  for (int req = begin_req; req <= end_req; ++req) {
    const decode::RequestPiece w = decode::make_request_piece(p, meta, req, m_block);
    Tensor o1 = partition_fragment_C(mma_o, Shape<Int<kTileRows>, Int<128>>{});  // O of group 1
    Tensor o2 = partition_fragment_C(mma_o, Shape<Int<kTileRows>, Int<128>>{});  // O of group 2
    Tensor o3 = partition_fragment_C(mma_o, Shape<Int<kTileRows>, Int<128>>{});  // O of group 3
    clear(o1);
    clear(o2);
    clear(o3);
    float F[3] = {0.f, 0.f, 0.f};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float sl2[2] = {0.f, 0.f};

    int stop;
    const int nblk = counted_blocks(p, w, stop);
    for (int blk = 0; blk < nblk; ++blk, ++g) {
      const int s = int(g % kStages);  // the block's factor slot
      const int c = int(g % kPSlots);
      // ---- block g's scores from warpgroup 0: the softmax, P and the rows' factors (and sums) back to it ----
      consumer_wait(ss.s_full, g & 1u, hint);
      FMLA_TL(ss, kTlFollow, kTlPFull, tid_in_wg == 0);  // the timeline's p_full: here the scores arrived
      if (blk == 0) {  // the rows' scale, written with the row piece's Q tile before its first block's scores
        sl2[0] = ss.row_scale_log2[row_in_tile[0]];
        sl2[1] = ss.row_scale_log2[row_in_tile[1]];
      }
      float sc[2];
      {
        Tensor S = partition_fragment_C(mma_s, Shape<Int<kTileRows>, Int<kBlockTokens>>{});
        load_scores(ss.s32, tid_in_wg, S);
        online_softmax(S, ~uint64_t(0), lane, sl2, m, l, sc);  // masked by warpgroup 0
        uint32_t p16[kP16Words];  // the slot is free: warpgroup 0 read block g - 2's P before it wrote these scores
        decode_fp8::p16_fragment(S, p16);
        decode_fp8::store_p(ss.p16[c], tid_in_wg, p16);
      }
      if ((lane & 3) == 0) {
        ss.sc[c][row_in_tile[0]] = sc[0];
        ss.sc[c][row_in_tile[1]] = sc[1];
      }
      if (blk + 1 == nblk) {  // l is not added to after this
        l[0] = decode::quad_sum(l[0]);
        l[1] = decode::quad_sum(l[1]);
        if ((lane & 3) == 0) {
          ss.rsum[c][row_in_tile[0]] = l[0];
          ss.rsum[c][row_in_tile[1]] = l[1];
        }
      }
      warp_arrive(ss.p_full[c], lane);

      // ---- V^T half 0 and the block's group factors and pairs (vt_full publishes all of them); O rescaled ----
      consumer_wait(ss.vt_full[0], g & 1u, hint);
      FMLA_TL(ss, kTlFollow, kTlVt0, tid_in_wg == 0);
      follow_factors(ss, s, sc, F, o1, o2, o3);
      // ---- O_g += P_g V_g, g = 1 (V^T half 0), 2 and 3 (half 1), P from the slot this warpgroup wrote ----
#if FMLA_SPARSE_SCORES_TO_WG1 == 2
      // FMLA_SPARSE_SCORES_TO_WG1=2: each group's words built while the P V before it runs (two word sets; the
      // products read their words from registers until they complete, so a set is rebuilt only after its P V was
      // waited for). The same waits and arrivals as follow_group's, in the same order.
      {
        const uint32_t p_base = decode_fp8::p_chunk_base(ss.p16[c], tid_in_wg);
        const auto words_of = [&](int grp, uint32_t (&wd)[kPTerms][8]) CUTLASS_LAMBDA_FUNC_INLINE {
          build_words(
              [&](int k, uint32_t (&p4)[4]) CUTLASS_LAMBDA_FUNC_INLINE { decode_fp8::load_p_chunk(p_base, k, p4); },
              &ss.sf[s][grp][0][0], lane, debug, wd);
        };
        uint32_t wa[kPTerms][8], wb[kPTerms][8];
        words_of(1, wa);
        sparse_pv_group<kPTerms>(tid_in_wg, wa, ss.vt[0] + (1 % 2) * (decode_fp8::kVtHalfBytes / 2), o1);
        words_of(2, wb);
        warpgroup_wait<0>();
        warpgroup_fence_operand(o1);
        keep_words(wa);
        warp_arrive(ss.vt_empty[0], lane);
        consumer_wait(ss.vt_full[1], g & 1u, hint);
        sparse_pv_group<kPTerms>(tid_in_wg, wb, ss.vt[1] + (2 % 2) * (decode_fp8::kVtHalfBytes / 2), o2);
        words_of(3, wa);
        warpgroup_wait<0>();
        warpgroup_fence_operand(o2);
        keep_words(wb);
        warp_arrive(ss.vt_empty[1], lane);
        sparse_pv_group<kPTerms>(tid_in_wg, wa, ss.vt[1] + (3 % 2) * (decode_fp8::kVtHalfBytes / 2), o3);
        warpgroup_wait<0>();
        warpgroup_fence_operand(o3);
        keep_words(wa);
        warp_arrive(ss.vt_empty[1], lane);
      }
#else
      follow_group<1>(ss, s, c, 0, tid_in_wg, lane, debug, o1, [] {});
      consumer_wait(ss.vt_full[1], g & 1u, hint);
      follow_group<2>(ss, s, c, 1, tid_in_wg, lane, debug, o2, [] {});
      follow_group<3>(ss, s, c, 1, tid_in_wg, lane, debug, o3, [] {});
#endif
      FMLA_TL(ss, kTlFollow, kTlBlockDone, tid_in_wg == 0);
    }

    // ---- epilogue: out of groups 1..3 and the rows' lse ----
    if (req == end_req) pdl_launch_dependents();
    follow_store(p, w, rows, lane, F, l, o1, o2, o3);
    store_lse(p, w, rows, lane, l, m);
    FMLA_TL(ss, kTlFollow, kTlEpilogue, tid_in_wg == 0);
  }
  FMLA_TL_FINISH(ss, kTlFollow, tid_in_wg == 0);
}

#endif  // FMLA_SPARSE_SCORES_TO_WG1

}  // namespace flashmla_backend::sm90::sparse_fp8
