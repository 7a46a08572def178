// The consumer warpgroups of the sm90 sparse decode kernel (kernel.cuh), and its shared memory: warpgroup 0 leads,
// warpgroup 1 follows. Warpgroup 0 computes every block's whole scores (four groups, two e4m3 terms of q, the group
// scales folded; the rope), the softmax, and P V of group 0; it hands P to warpgroup 1 in fp16 with the rows' factor
// of the block, through a ring of two slots, and warpgroup 1 builds the words of groups 1, 2 and 3 from it and
// multiplies them by their V^T. The group factors and the words' s F pairs come from the transposer warps (common.cuh:
// block_group_factors). Nothing is computed twice (a split plan that ran the softmax in both warpgroups and exchanged
// 16 KB of scores a block and direction measured 12% slower, and was removed), and the two warpgroups are not locked
// into one phase: warpgroup 1's words of a block are built while warpgroup 0 computes the next block's scores, and its
// P V run once that Q K^T is issued (qk_issued, below).
//   warpgroup 0: S = Q K^T (all groups), P = 2^(S sl2 - m + 8), O_0 = O_0 sc + P_0 V_0
//   warpgroup 1: O_g = O_g sc + P_g V_g (g = 1, 2, 3), P and sc from warpgroup 0
// Warpgroup 0 was the critical path with two groups a warpgroup (docs/perf/journal.md: it issued 1.3 times warpgroup
// 1's instructions a block, and warpgroup 1 waited for P half of its time), so it keeps one group's O (64 registers),
// and with them the room for two Q K^T temporaries (qk.cuh: group g + 1's product under group g's fold), which let the
// next block's first two group products run under this block's softmax (lead_loop), and its P V under the next
// block's last two. With O of two groups
// either made ptxas serialize the kernel's wgmma for want of registers (C7512) even at 248 a thread. Warpgroup 1 holds
// O of three groups (192) and builds each group's words from P and the pairs read a 16-byte chunk at a time; it is now
// the busier of the two (its words, and its three P V waited for one by one).
// The gather and transposer warps are common.cuh's.
#pragma once

#include <cuda_fp16.h>

#include "sm90/sparse_fp8/common.cuh"

namespace flashmla_backend::sm90::sparse_fp8 {

// Whether `x` holds in any thread of warpgroup 0 (all 128 threads call it; a barrier reduction on warpgroup 0's own
// named barrier, kBarLeadQ, whose other use is by the same 128 threads).
__device__ __forceinline__ bool warpgroup_any(bool x) {
  uint32_t r;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.b32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(r)
      : "r"(uint32_t(x)), "n"(kBarLeadQ + cutlass::arch::NamedBarrier::ReservedNamedBarrierCount), "n"(kWgThreads)
      : "memory");
  return r != 0;
}

constexpr int kPSlots = 2;                             // blocks of P in flight from warpgroup 0 to warpgroup 1
constexpr int kP16Words = 16;                          // a thread's 64 x 64 P in fp16: word k = (P(2 k), P(2 k + 1))
constexpr int kP16Bytes = kP16Words * 4 * kWgThreads;  // 8 KB
constexpr int kLeadRegs = 208;
constexpr int kFollowRegs = 240;
static_assert(kWgThreads * (kLeadRegs + kFollowRegs + kProducerRegs) <= decode_fp8::kCtaRegisters,
              "register split exceeds the CTA's allocation");

// The kernel's shared memory (206 KB with the launch's alignment slack).
struct alignas(1024) LeadStorage {
  // What the gather and transposer warps (common.cuh) ask of the storage: mask and scales of block g in stage
  // g % kStages, V^T half h of every block in slot h (block g's half is the slot's use g). A ring of two slots for
  // half 0 (16 KB more) measured no faster (docs/perf/journal.md, 2026-12-01). Nor did one for half 1 (block g's in
  // slot 1 + g % 2, so that the transposer warps' half 1 of block g waits for warpgroup 1's P V of block g - 2 and the
  // stage goes back sooner; the factors then in four slots of their own): level in the same run, 191.6-192.5 against
  // 192.4-193.3 µs at b128 top-k 2048, 1% faster at h_q 64, 0.5% slower at b = 1 (journal, 2026-12-03). With the
  // factors made after the wait for half 0 instead (in the stage's slots) it was 7% slower: they lay on warpgroup 0's
  // path.
  static __device__ __forceinline__ uint32_t mask_slot(uint32_t g) { return g % uint32_t(kStages); }
  static constexpr int kVtSlots = 2;

  alignas(1024) uint8_t q_latent[kQTerms * kLatentBytes];
  alignas(1024) uint8_t q_rope[kRopeBytes];
  alignas(1024) uint8_t stage[kStages][kStageBytes];        // block g in stage g % kStages (layout.h)
  alignas(1024) uint8_t vt[kVtSlots][decode_fp8::kVtHalfBytes];  // V^T halves
  alignas(16) uint8_t p16[kPSlots][kP16Bytes];              // P of block g in slot g % kPSlots, by thread
  float sc[kPSlots][kTileRows];                             // the rows' factor of block g: exp2(m_before - m_after)
  float rsum[kPSlots][kTileRows];                           // the rows' final sums, with a row piece's last block
  uint64_t mask[kStages];                                   // block g's mask in slot mask_slot(g)
  float row_scale_log2[kTileRows];
  // The block in stage s (common.cuh: block_group_factors): its words' s F pairs of group g, [g][q][a] (f16x2), and
  // (ratio, F) of group g.
  alignas(16) uint32_t sf[kStages][kGroups][4][8];
  alignas(16) float gfac[kStages][kGroups][2];
  // full: the gather's. empty: warpgroup 0's 4 warps after its words and the transposer warps (kLeadEmptyArrivals).
  // p_full[c]: warpgroup 0 wrote P slot c (4 warps). p_empty[c]: warpgroup 1 read it (4 warps). vt_full / vt_empty:
  // a V^T half written (the transposer warps) / each of its two groups read by a P V (4 warps a group). qk_issued:
  // block g's phase is completion g / 2 of qk_issued[g % 2], when warpgroup 0 (4 warps) has issued the tensor work
  // that follows block g's P, i.e. the next block's whole Q K^T, or its P V of group 0 at a row piece's last block.
  cutlass::arch::ClusterBarrier full[kStages];
  cutlass::arch::ClusterBarrier empty[kStages];
  cutlass::arch::ClusterBarrier p_full[kPSlots];
  cutlass::arch::ClusterBarrier p_empty[kPSlots];
  cutlass::arch::ClusterBarrier vt_full[kVtSlots];
  cutlass::arch::ClusterBarrier vt_empty[kVtSlots];
  cutlass::arch::ClusterBarrier qk_issued[2];
#if defined(FMLA_SPARSE_TIMELINE)
  Timeline tl;  // timeline.cuh
#endif
};
static_assert(int(sizeof(LeadStorage)) + 1024 <= decode_fp8::kMaxSmemPerBlock, "shared memory plan exceeds 227 KB");

// A stage is released by warpgroup 0 (Q K^T, the mask, group 0's factors and pairs read) and the transposer warps.
// Warpgroup 1 reads the block's factors and pairs (ss.gfac / ss.sf of the stage's index) until group 3's words, but
// does not hold the stage: the transposer warps rewrite them for block g + 2 only after their V^T half 1 of block
// g + 1, which waited for warpgroup 1's group 3 P V of block g (checks/protocol_model.py plays it). Holding the stage
// until warpgroup 1's last words kept warpgroup 0 waiting for its next gathered block a fifth of its time (ncu).
constexpr uint32_t kLeadEmptyArrivals = 4 + kTransposeWarps;
constexpr uint32_t kPSlotArrivals = 4;
// Warpgroup 1 issues a block's P V only once warpgroup 0 has issued the next block's Q K^T (qk_issued). The tensor
// cores take the two warpgroups' wgmma in the order they were issued, so warpgroup 1's three P V of a block (768 of the
// block's 2,176 tensor-core cycles) issued as soon as their words were ready landed between warpgroup 0's Q K^T
// products, on warpgroup 0's path (its chain is the kernel's); behind the whole Q K^T they run during its softmax:
// 3.5-4% faster at top-k 2048 in a measurement build, under 1% in a default build (docs/perf/journal.md, 2026-12-01 and
// 2026-12-02); in the present order the wait left out is 5% slower at b128 top-k 2048 (202.4 against 192.1 µs), 5-5.5%
// at s_q 2 and b64, 2-3% at h_q 64, b32 and top-k 512, the same bits (2026-12-03 12:05). Warpgroup 0's own P V of group
// 0 is issued among that Q K^T's products (after the first two and the rope, before the last two) and waited for before
// the last two folds; issued after all of them (and waited for in the next softmax) it measured 3-6% slower.
// Two barriers by turns, so that the parity wait holds however far warpgroup 0 can get ahead: it cannot get three
// blocks ahead of warpgroup 1's wait, since its arrival for block g follows its P of block g, written once warpgroup 1
// released the P slot of block g - 2 (p_empty), after its wait for block g - 2's phase. (With V^T half 0 in one slot it
// cannot get two ahead either, and one barrier would do; with half 0 in a ring of two, measured and dropped, it could:
// the protocol model found that parity wait passing on the wrong phase. checks/protocol_model.py plays it.)
constexpr uint32_t kQkIssuedArrivals = 4;

// ------------------------------------------------------------------------------------------------
// Pieces of the two consumer loops below
// ------------------------------------------------------------------------------------------------
// The 16-bit q of row piece req's Q tile into the tile by cp.async (warpgroup 0's slots t and t + 128), one commit
// group; split in place (split_next_q_tile) after the row piece before it.
// Every later tile made by both warpgroups as the first one is (each its half: warpgroup 0 at this point or after its
// last P V's issue, warpgroup 1 after its stores; both waiting at kBarFirstQ) measured no faster: top-k 128 1.3%
// faster, b64 and b32 1-2.5% slower, the rest level, the same bits (docs/perf/journal.md, 2026-12-03 12:05). Its
// timeline: splitting one slot took warpgroup 0 3.9 µs, as long as two here, and with the copies moved after the last
// P V its group 0 stores took 6.9 µs instead of 1.5: the row piece's boundary is bound by code that runs once a row
// piece (instruction fetch, as the split's ncu samples said) and by the copies' traffic, not by a thread's share.
__device__ __forceinline__ void copy_next_q_tile(const DecodeParams& p, LeadStorage& ss, int req, int m_block,
                                                 int tid_in_wg) {
  q_slot_copy(p, ss, req, m_block, tid_in_wg);
  q_slot_copy(p, ss, req, m_block, tid_in_wg + kWgThreads);
  decode::cp_async_commit();
}
// The copied tile split in place by warpgroup 0 alone (its slots), after its epilogue, and made visible to its Q K^T.
__device__ __forceinline__ void split_next_q_tile(const DecodeParams& p, LeadStorage& ss, int tid_in_wg) {
  decode::cp_async_wait_all();  // this thread's own copies: the split reads only them
  FMLA_TL(ss, kTlLead, kTlQCopied, tid_in_wg == 0);
#pragma unroll 1
  for (int k = 0; k < 2; ++k) q_slot_split(p, ss, tid_in_wg + k * kWgThreads);
  FMLA_TL(ss, kTlLead, kTlQSplit, tid_in_wg == 0);
  cutlass::arch::fence_view_async_shared();
  NamedBarrier(kWgThreads, kBarLeadQ).arrive_and_wait_unaligned();
  FMLA_TL(ss, kTlLead, kTlNextQ, tid_in_wg == 0);
}
// A P V's words kept in their registers until here (called after the wait for the product, which reads them).
__device__ __forceinline__ void keep_words(uint32_t (&words)[kPTerms][8]) {
  CUTLASS_PRAGMA_UNROLL
  for (int t = 0; t < kPTerms; ++t) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 8; ++i) asm volatile("" : "+r"(words[t][i]));
  }
}
// Warpgroup 1: block g's factors of groups 1..3 (factor slot s; V^T half 0's vt_full published them) into F, and O
// of those groups rescaled by the rows' factors sc and the groups' ratios where any differs from 1.
template <class FragO>
__device__ __forceinline__ void follow_factors(const LeadStorage& ss, int s, const float (&sc)[2], float (&F)[3],
                                               FragO& o1, FragO& o2, FragO& o3) {
  const float2 f1 = *reinterpret_cast<const float2*>(&ss.gfac[s][1][0]);  // (ratio, F) of group 1
  const float4 f23 = *reinterpret_cast<const float4*>(&ss.gfac[s][2][0]);  // of groups 2 and 3
  const float ratio[3] = {f1.x, f23.x, f23.z};
  F[0] = f1.y;
  F[1] = f23.y;
  F[2] = f23.w;
  if (rescale_needed(sc, ratio)) {
    rescale_group(o1, sc, ratio[0]);
    rescale_group(o2, sc, ratio[1]);
    rescale_group(o3, sc, ratio[2]);
  }
}
// Warpgroup 1's stores of a row piece: out of groups 1..3 (common.cuh: inv_out, store_group), l the rows' final sums.
template <class FragO>
__device__ __forceinline__ void follow_store(const DecodeParams& p, const decode::RequestPiece& w,
                                             const int (&rows)[2], int lane, const float (&F)[3], const float (&l)[2],
                                             const FragO& o1, const FragO& o2, const FragO& o3) {
  float inv[2];
  inv_out(F[0], l, inv);
  store_group(p, w, 1, rows, lane, o1, inv);
  inv_out(F[1], l, inv);
  store_group(p, w, 2, rows, lane, o2, inv);
  inv_out(F[2], l, inv);
  store_group(p, w, 3, rows, lane, o3, inv);
}

// ------------------------------------------------------------------------------------------------
// Warpgroup 0
// ------------------------------------------------------------------------------------------------
// S = Q K^T of block g (all four groups, the rope), after its stage landed: a row piece's first block (lead_loop
// overlaps the later ones with the block before).
template <class FragS>
__device__ __forceinline__ void lead_qk(LeadStorage& ss, uint32_t g, int tid_in_wg, uint32_t hint, FragS& S,
                                        FragS& t0, FragS& t1) {
  const int s = int(g % kStages);
  consumer_wait(ss.full[s], (g / kStages) & 1u, hint);
  FMLA_TL(ss, kTlLead, kTlFull, tid_in_wg == 0);
  cutlass::arch::fence_view_async_shared();  // the gather's cp.async writes (generic proxy), read by wgmma
  sparse_qk_block<kQTerms>(tid_in_wg, ss.q_latent, ss.q_rope, ss.stage[s], S, t0, t1);
  FMLA_TL(ss, kTlLead, kTlQk, tid_in_wg == 0);
}

__device__ __forceinline__ void lead_loop(const DecodeParams& p, LeadStorage& ss, const SchedMetaRow& meta,
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
    const float sl2[2] = {ss.row_scale_log2[row_in_tile[0]], ss.row_scale_log2[row_in_tile[1]]};

    Tensor o = partition_fragment_C(mma_o, Shape<Int<kTileRows>, Int<128>>{});  // O of group 0
    clear(o);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float F = 0.f;

    int stop;
    const int nblk = counted_blocks(p, w, stop);
    Tensor S = partition_fragment_C(mma_s, Shape<Int<kTileRows>, Int<kBlockTokens>>{});
    Tensor t0 = partition_fragment_C(mma_s, Shape<Int<kTileRows>, Int<kBlockTokens>>{});
    Tensor t1 = partition_fragment_C(mma_s, Shape<Int<kTileRows>, Int<kBlockTokens>>{});
    if (nblk > 0) lead_qk(ss, g, tid_in_wg, hint, S, t0, t1);
    const bool next = req < end_req;
    // P's words of group 0 (the A operand of the group's P V, read from these registers until the P V completes)
    uint32_t words[kPTerms][8];
    // V^T half 0 released once this warpgroup's P V of group 0 completed (its words kept until then)
    const auto release_half0 = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
      warpgroup_fence_operand(o);
      keep_words(words);
      warp_arrive(ss.vt_empty[0], lane);
    };
    // Block g's softmax (P = 2^(S sl2 - m + 8)), P and the rows' factor to warpgroup 1 (slot c, free once warpgroup 1
    // read block g - 2; with the row piece's last block also the rows' final sums, a quad's parts added, so that
    // warpgroup 1 needs no barrier for them), then V^T half 0 and the block's group factors and pairs (vt_full
    // publishes both): O rescaled, P's words of group 0; the block's stage is done with here.
    // after_softmax: called between the softmax and the P hand-off (the next block's group 1 product is issued there).
    const auto hand_and_words = [&](bool last, auto&& after_softmax) CUTLASS_LAMBDA_FUNC_INLINE {
      const int s = int(g % kStages);
      const int c = int(g % kPSlots);
      float sc[2];
      online_softmax(S, ss.mask[ss.mask_slot(g)], lane, sl2, m, l, sc);
      FMLA_TL(ss, kTlLead, kTlSoftmax, tid_in_wg == 0);
      after_softmax();
      if (g >= uint32_t(kPSlots)) consumer_wait(ss.p_empty[c], ((g / kPSlots) - 1) & 1u, hint);
      uint32_t p16[kP16Words];  // also this warpgroup's P for its words
      decode_fp8::p16_fragment(S, p16);
      decode_fp8::store_p(ss.p16[c], tid_in_wg, p16);
      if ((lane & 3) == 0) {
        ss.sc[c][row_in_tile[0]] = sc[0];
        ss.sc[c][row_in_tile[1]] = sc[1];
      }
      if (last) {  // l is not added to after this
        l[0] = decode::quad_sum(l[0]);
        l[1] = decode::quad_sum(l[1]);
        if ((lane & 3) == 0) {
          ss.rsum[c][row_in_tile[0]] = l[0];
          ss.rsum[c][row_in_tile[1]] = l[1];
        }
      }
      warp_arrive(ss.p_full[c], lane);
      FMLA_TL(ss, kTlLead, kTlPHanded, tid_in_wg == 0);
      consumer_wait(ss.vt_full[0], g & 1u, hint);
      FMLA_TL(ss, kTlLead, kTlVt0, tid_in_wg == 0);
      const float2 gf = *reinterpret_cast<const float2*>(&ss.gfac[s][0][0]);  // (ratio, F) of group 0
      const float ratio[1] = {gf.x};
      F = gf.y;
      if (rescale_needed(sc, ratio)) rescale_group(o, sc, gf.x);
      build_words(
          [&](int k, uint32_t (&p4)[4]) CUTLASS_LAMBDA_FUNC_INLINE {
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < 4; ++i) p4[i] = p16[4 * k + i];
          },
          &ss.sf[s][0][0][0], lane, debug, words);
      FMLA_TL(ss, kTlLead, kTlWords, tid_in_wg == 0);
      warp_arrive(ss.empty[s], lane);
    };
    // Every block but the row piece's last: block g + 1's Q K^T overlaps block g's softmax where it can. If block
    // g + 1's stage has landed, its group 0 product goes into t0 before block g's softmax and its group 1 product into
    // t1 right after it, before the P hand-off (else both after the words, so that a late gather does not hold the
    // softmax: waiting for the stage there, whether landed or not, measured 23% slower at b128 top-k 2048,
    // docs/perf/journal.md).
    // The two groups are issued apart because about eight wgmma can be outstanding in an SM, whichever warpgroup
    // issued them, and issuing more blocks the issuing warpgroup until the oldest complete
    // (checks/wgmma_issue_probe.cu): both groups' 16 products before the softmax held warpgroup 0 0.39-0.48 µs, about
    // their execution time; apart, each group's 8 return at once (0.3-1.3% faster at every shape, medians of three
    // rounds, the same bits: docs/perf/journal.md, 2026-12-03 12:05). S, free once P is made of it, then takes
    // block g + 1's rope product, and the four folds follow in the order of sparse_qk_block, so the scores are its
    // bits. O_0 += P_0 V_0 of block g runs under the products of groups 2 and 3; block g's phase of qk_issued once
    // block g + 1's whole Q K^T is issued (warpgroup 1's P V of block g next).
    for (int blk = 0; blk + 1 < nblk; ++blk, ++g) {
      const int sn = int((g + 1) % kStages);
      uint8_t* stage_n = ss.stage[sn];
      const auto first_group = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
        consumer_wait(ss.full[sn], ((g + 1) / kStages) & 1u, hint);
        FMLA_TL(ss, kTlLead, kTlFull, tid_in_wg == 0);
        cutlass::arch::fence_view_async_shared();  // the gather's cp.async writes (generic proxy), read by wgmma
        qk_issue_group<kQTerms>(tid_in_wg, ss.q_latent, stage_n, 0, t0);
      };
      const auto second_group = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
        qk_issue_group<kQTerms>(tid_in_wg, ss.q_latent, stage_n, 1, t1);
        FMLA_TL(ss, kTlLead, kTlPairIssued, tid_in_wg == 0);
      };
      // Whether block g + 1 has landed: any warp's test (all four issue each wgmma, and a completed phase stays so)
      const bool early = warpgroup_any(ss.full[sn].test_wait(((g + 1) / kStages) & 1u));
      if (early) first_group();
      hand_and_words(false, [&]() CUTLASS_LAMBDA_FUNC_INLINE {
        if (early) second_group();
      });
      if (!early) {
        first_group();
        second_group();
      }
      qk_issue_rope(tid_in_wg, ss.q_rope, stage_n, S);          // S = block g + 1's rope product
      sparse_pv_group<kPTerms>(tid_in_wg, words, ss.vt[0], o);  // O_0 += P_0 V_0 of block g
      warpgroup_wait<1>();  // groups 0 and 1 and the rope product (the P V in flight)
      qk_fold_group(tid_in_wg, stage_n, 0, t0, S);
      qk_fold_group(tid_in_wg, stage_n, 1, t1, S);
      FMLA_TL(ss, kTlLead, kTlFold01, tid_in_wg == 0);
      qk_issue_group<kQTerms>(tid_in_wg, ss.q_latent, stage_n, 2, t0);
      qk_issue_group<kQTerms>(tid_in_wg, ss.q_latent, stage_n, 3, t1);
      warp_arrive(ss.qk_issued[g % 2], lane);  // block g + 1's Q K^T is all issued: warpgroup 1's P V of block g next
      warpgroup_wait<2>();                     // the P V: V^T half 0 released, the words free
      release_half0();
      warpgroup_wait<1>();  // group 2
      qk_fold_group(tid_in_wg, stage_n, 2, t0, S);
      warpgroup_wait<0>();  // group 3
      qk_fold_group(tid_in_wg, stage_n, 3, t1, S);
      FMLA_TL(ss, kTlLead, kTlQk, tid_in_wg == 0);
    }
    if (nblk > 0) {  // the row piece's last block: its Q K^T is complete, the next Q tile's copy goes now (its
                     // latency under this block's work and the epilogue; split in place after the stores)
      if (next) copy_next_q_tile(p, ss, req + 1, m_block, tid_in_wg);
      hand_and_words(true, [] {});
      sparse_pv_group<kPTerms>(tid_in_wg, words, ss.vt[0], o);
      warp_arrive(ss.qk_issued[g % 2], lane);  // block g's phase: its P V of group 0 is the tensor work after its P
      warpgroup_wait<0>();
      release_half0();
      FMLA_TL(ss, kTlLead, kTlPv0Done, tid_in_wg == 0);
      ++g;
    }

    // ---- epilogue, and the next row piece's Q tile, made by this warpgroup alone: warpgroup 1 never reads the
    // tile, so neither waits for the other here (warpgroup 1 finishes its last block while this one starts the next
    // row piece) ----
    if (req == end_req) pdl_launch_dependents();
    float inv[2];  // l: the rows' final sums, added up in the last block (0 without a block)
    inv_out(F, l, inv);
    store_group(p, w, 0, rows, lane, o, inv);
    store_lse(p, w, rows, lane, l, m);
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
// O_g += P_g V_g of block g in stage s for group kG (1..3), P from slot c, its V^T half in slot v: the words (P and
// the pairs a chunk at a time), the product, its wait, and the release of the group's V^T half (one arrival a warp and
// group). after_words: called once the words are built (the last group releases the P slot there).
template <int kG, class FragO, class AfterWords>
__device__ __forceinline__ void follow_group(LeadStorage& ss, int s, int c, uint32_t v, int tid_in_wg, int lane,
                                             int debug, FragO& o, AfterWords&& after_words) {
  uint32_t words[kPTerms][8];
  const uint32_t p_base = decode_fp8::p_chunk_base(ss.p16[c], tid_in_wg);
  build_words([&](int k, uint32_t (&p4)[4]) CUTLASS_LAMBDA_FUNC_INLINE { decode_fp8::load_p_chunk(p_base, k, p4); },
              &ss.sf[s][kG][0][0], lane, debug, words);
  after_words();
  sparse_pv_group<kPTerms>(tid_in_wg, words, ss.vt[v] + (kG % 2) * (decode_fp8::kVtHalfBytes / 2), o);
  warpgroup_wait<0>();
  warpgroup_fence_operand(o);
  warp_arrive(ss.vt_empty[v], lane);
}

__device__ __forceinline__ void follow_loop(const DecodeParams& p, LeadStorage& ss, const SchedMetaRow& meta,
                                            int begin_req, int end_req, int m_block, int tid, int debug) {
  const int tid_in_wg = tid % kWgThreads;
  const int lane = tid & 31;
  const uint32_t hint = suspend_hint(debug);
  int row_in_tile[2], rows[2];
  thread_rows(tid_in_wg, m_block, row_in_tile, rows);

  typename PvTypes::TiledMma mma_o;
  // Heads 32..63 of the first row piece's Q tile (lead_loop); warpgroup 0 waits for them, this one does not.
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
    float l[2] = {0.f, 0.f};  // the rows' final sums, from the last block's P slot (0 without a block)

    int stop;
    const int nblk = counted_blocks(p, w, stop);
    for (int blk = 0; blk < nblk; ++blk, ++g) {
      const int s = int(g % kStages);
      const int c = int(g % kPSlots);
      // ---- the rows' factor of block g from warpgroup 0 (its P stays in slot c until the last group's words) ----
      consumer_wait(ss.p_full[c], (g / kPSlots) & 1u, hint);
      FMLA_TL(ss, kTlFollow, kTlPFull, tid_in_wg == 0);
      const float sc[2] = {ss.sc[c][row_in_tile[0]], ss.sc[c][row_in_tile[1]]};
      if (blk + 1 == nblk) {
        l[0] = ss.rsum[c][row_in_tile[0]];
        l[1] = ss.rsum[c][row_in_tile[1]];
      }

      // ---- V^T half 0 and the block's group factors and pairs (vt_full publishes all of them); O rescaled ----
      consumer_wait(ss.vt_full[0], g & 1u, hint);
      FMLA_TL(ss, kTlFollow, kTlVt0, tid_in_wg == 0);
      follow_factors(ss, s, sc, F, o1, o2, o3);

      // ---- O_g += P_g V_g, g = 1 (V^T half 0), 2 and 3 (half 1); the first once warpgroup 0 issued its next tensor
      // work (qk_issued) ----
      follow_group<1>(ss, s, c, 0, tid_in_wg, lane, debug, o1, [&]() CUTLASS_LAMBDA_FUNC_INLINE {
        consumer_wait(ss.qk_issued[g % 2], (g / 2) & 1u, hint);
        FMLA_TL(ss, kTlFollow, kTlQkIssued, tid_in_wg == 0);
      });
      consumer_wait(ss.vt_full[1], g & 1u, hint);
      follow_group<2>(ss, s, c, 1, tid_in_wg, lane, debug, o2, [] {});
      follow_group<3>(ss, s, c, 1, tid_in_wg, lane, debug, o3,
                      [&]() CUTLASS_LAMBDA_FUNC_INLINE { warp_arrive(ss.p_empty[c], lane); });  // P read
      FMLA_TL(ss, kTlFollow, kTlBlockDone, tid_in_wg == 0);
    }

    // ---- epilogue ----
    if (req == end_req) pdl_launch_dependents();
    follow_store(p, w, rows, lane, F, l, o1, o2, o3);
    FMLA_TL(ss, kTlFollow, kTlEpilogue, tid_in_wg == 0);
  }
  FMLA_TL_FINISH(ss, kTlFollow, tid_in_wg == 0);
}

}  // namespace flashmla_backend::sm90::sparse_fp8
