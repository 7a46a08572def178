// The consumer warpgroups of the sm90 sparse decode kernel (kernel.cuh), and its shared memory: warpgroup 0 leads,
// warpgroup 1 follows, the division of work of FlashMLA's Hopper sparse kernel. Warpgroup 0 computes every block's
// whole scores (four groups, two e4m3 terms of q, the group scales folded; the rope), the softmax, and P V of groups 0
// and 1; it hands P to warpgroup 1 in fp16 with the rows' factor of the block, through a ring of two slots, and
// warpgroup 1 only builds the words of groups 2 and 3 from it and multiplies them by its V^T half. The group factors
// and the words' s F pairs come from the transposer warps (common.cuh: block_group_factors). Nothing is computed twice
// (a split plan that ran the softmax in both warpgroups and exchanged 16 KB of scores a block and direction measured
// 12% slower, and was removed), and the two warpgroups are not locked into one phase: warpgroup 1's words and P V of a
// block run while warpgroup 0 computes the next block's scores. (Warpgroup 0 issuing the next Q K^T right behind its
// own P V, before waiting for it, made ptxas serialize the kernel's wgmma for want of registers, C7512, even at 248 a
// thread: the P V's words, O, S and the product's temporary live at once.)
//   warpgroup 0: S = Q K^T (all groups), P = 2^(S sl2 - m + 8), O_01 = O_01 sc + P_g V_g (g = 0, 1)
//   warpgroup 1: O_23 = O_23 sc + P_g V_g (g = 2, 3), P and sc from warpgroup 0
// The gather and transposer warps are common.cuh's. Registers: warpgroup 0 holds O (128), S and the product's
// temporary (64) or S and the words of its two groups (64); warpgroup 1 holds O, P in fp16 (16) and words (32);
// the setmaxnreg split gives warpgroup 0 a little more.
#pragma once

#include <cuda_fp16.h>

#include "sm90/sparse_fp8/common.cuh"

namespace flashmla_backend::sm90::sparse_fp8 {

constexpr int kPSlots = 2;                             // blocks of P in flight from warpgroup 0 to warpgroup 1
constexpr int kP16Words = 16;                          // a thread's 64 x 64 P in fp16: word k = (P(2 k), P(2 k + 1))
constexpr int kP16Bytes = kP16Words * 4 * kWgThreads;  // 8 KB
constexpr int kLeadRegs = 232;
constexpr int kFollowRegs = 216;
static_assert(kWgThreads * (kLeadRegs + kFollowRegs + kProducerRegs) <= decode_fp8::kCtaRegisters,
              "register split exceeds the CTA's allocation");

// The kernel's shared memory (206 KB with the launch's alignment slack).
struct alignas(1024) LeadStorage {
  // What the gather and transposer warps (common.cuh) ask of the storage: mask and scales of block g in stage
  // g % kStages, V^T half h of every block in slot h.
  static __device__ __forceinline__ uint32_t mask_slot(uint32_t g) { return g % uint32_t(kStages); }
  static __device__ __forceinline__ uint32_t vt_slot(int h, uint32_t) { return uint32_t(h); }
  static __device__ __forceinline__ uint32_t vt_use(int, uint32_t g) { return g; }

  alignas(1024) uint8_t q_latent[kQTerms * kLatentBytes];
  alignas(1024) uint8_t q_rope[kRopeBytes];
  alignas(1024) uint8_t stage[kStages][kStageBytes];        // block g in stage g % kStages (layout.h)
  alignas(1024) uint8_t vt[2][decode_fp8::kVtHalfBytes];    // V^T half h of every block
  alignas(16) uint8_t p16[kPSlots][kP16Bytes];              // P of block g in slot g % kPSlots, by thread
  float sc[kPSlots][kTileRows];                             // the rows' factor of block g: exp2(m_before - m_after)
  uint64_t mask[kStages];                                   // block g's mask in slot mask_slot(g)
  float row_scale_log2[kTileRows];
  float row_sum[kTileRows];                                 // the rows' final sums (warpgroup 0 -> 1)
  // The block in stage s (common.cuh: block_group_factors): its words' s F pairs of group g, [g][q][a] (f16x2), and
  // (ratio, F) of group g.
  alignas(16) uint32_t sf[kStages][kGroups][4][8];
  alignas(16) float gfac[kStages][kGroups][2];
  // full: the gather's. empty: each warpgroup's 4 warps after its words (warpgroup 0 read the stage for Q K^T, both
  // the block's pairs and factors), and the transposer warps. p_full[c]: warpgroup 0 wrote P slot c (4 warps). p_empty[c]: warpgroup 1 read it (4 warps). vt_full /
  // vt_empty: a V^T half written (the transposer warps) / read by its warpgroup's P V (4 warps).
  cutlass::arch::ClusterBarrier full[kStages];
  cutlass::arch::ClusterBarrier empty[kStages];
  cutlass::arch::ClusterBarrier p_full[kPSlots];
  cutlass::arch::ClusterBarrier p_empty[kPSlots];
  cutlass::arch::ClusterBarrier vt_full[2];
  cutlass::arch::ClusterBarrier vt_empty[2];
};
static_assert(int(sizeof(LeadStorage)) + 1024 <= decode_fp8::kMaxSmemPerBlock, "shared memory plan exceeds 227 KB");

constexpr uint32_t kLeadEmptyArrivals = 8 + kTransposeWarps;
constexpr uint32_t kPSlotArrivals = 4;

// Consumer warpgroup kWG's words of block g (stage s), after its P: the wait for its V^T half, which also publishes
// the block's group factors and pairs (common.cuh: block_group_factors); F and the ratios of groups 2 kWG, 2 kWG + 1
// read, O rescaled by the rows' factors sc and the ratios, the words built; the stage released (the warpgroup's last
// read of it).
template <int kWG, class FragO>
__device__ __forceinline__ void block_words(LeadStorage& ss, uint32_t g, int s, int lane, int debug, uint32_t hint,
                                            const float (&sc)[2], const uint32_t (&p16)[16], FragO& o0, FragO& o1,
                                            float (&F)[2], uint32_t (&words0)[kPTerms][8],
                                            uint32_t (&words1)[kPTerms][8]) {
  consumer_wait(ss.vt_full[kWG], g & 1u, hint);
  const float4 gf = *reinterpret_cast<const float4*>(&ss.gfac[s][2 * kWG][0]);  // (ratio, F) of each group
  const float ratio[2] = {gf.x, gf.z};
  F[0] = gf.y;
  F[1] = gf.w;
  rescale_groups(o0, o1, sc, ratio);
  build_group_words<2 * kWG>(p16, &ss.sf[s][2 * kWG][0][0], lane, debug, words0, words1);
  warp_arrive(ss.empty[s], lane);
}

// ------------------------------------------------------------------------------------------------
// Warpgroup 0
// ------------------------------------------------------------------------------------------------
// S = Q K^T of block g (all four groups, the rope), after its stage landed.
template <class FragS>
__device__ __forceinline__ void lead_qk(LeadStorage& ss, uint32_t g, int tid_in_wg, uint32_t hint, FragS& S) {
  const int s = int(g % kStages);
  consumer_wait(ss.full[s], (g / kStages) & 1u, hint);
  cutlass::arch::fence_view_async_shared();  // the gather's cp.async writes (generic proxy), read by wgmma
  typename QkTypes::TiledMmaLatent mma_s;
  Tensor tmp = partition_fragment_C(mma_s, Shape<Int<kTileRows>, Int<kBlockTokens>>{});
  sparse_qk_block<kQTerms>(tid_in_wg, ss.q_latent, ss.q_rope, ss.stage[s], S, tmp);
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
  uint32_t g = 0;
  for (int req = begin_req; req <= end_req; ++req) {
    const decode::RequestPiece w = decode::make_request_piece(p, meta, req, m_block);
    begin_row_piece(p, ss, req, m_block, tid);
    const float sl2[2] = {ss.row_scale_log2[row_in_tile[0]], ss.row_scale_log2[row_in_tile[1]]};

    Tensor o0 = partition_fragment_C(mma_o, Shape<Int<kTileRows>, Int<128>>{});  // O of group 0
    Tensor o1 = partition_fragment_C(mma_o, Shape<Int<kTileRows>, Int<128>>{});  // O of group 1
    clear(o0);
    clear(o1);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float F[2] = {0.f, 0.f};

    int stop;
    const int nblk = counted_blocks(p, w, stop);
    Tensor S = partition_fragment_C(mma_s, Shape<Int<kTileRows>, Int<kBlockTokens>>{});
    if (nblk > 0) lead_qk(ss, g, tid_in_wg, hint, S);
    for (int blk = 0; blk < nblk; ++blk, ++g) {
      const int s = int(g % kStages);
      const int c = int(g % kPSlots);

      // ---- mask, online softmax: P = 2^(S sl2 - m + 8) ----
      float sc[2];
      online_softmax(S, ss.mask[ss.mask_slot(g)], lane, sl2, m, l, sc);

      // ---- P and the rows' factor to warpgroup 1 (slot c, free once warpgroup 1 read block g - 2) ----
      if (g >= uint32_t(kPSlots)) consumer_wait(ss.p_empty[c], ((g / kPSlots) - 1) & 1u, hint);
      uint32_t p16[kP16Words];  // also this warpgroup's P for its words
      decode_fp8::p16_fragment(S, p16);
      decode_fp8::store_p(ss.p16[c], tid_in_wg, p16);
      if ((lane & 3) == 0) {
        ss.sc[c][row_in_tile[0]] = sc[0];
        ss.sc[c][row_in_tile[1]] = sc[1];
      }
      warp_arrive(ss.p_full[c], lane);

      // ---- V^T half 0 and the groups' factors and pairs (vt_full publishes both); O rescaled, P's words of groups
      // 0 and 1; the block's stage is done with here ----
      uint32_t words0[kPTerms][8], words1[kPTerms][8];
      block_words<0>(ss, g, s, lane, debug, hint, sc, p16, o0, o1, F, words0, words1);

      // ---- O_g += P_g V_g; the next block's Q K^T ----
      sparse_pv_group<kPTerms>(tid_in_wg, words0, ss.vt[0], o0);
      sparse_pv_group<kPTerms>(tid_in_wg, words1, ss.vt[0] + decode_fp8::kVtHalfBytes / 2, o1);
      warpgroup_wait<0>();
      warpgroup_fence_operand(o0);
      warpgroup_fence_operand(o1);
      warp_arrive(ss.vt_empty[0], lane);
      if (blk + 1 < nblk) lead_qk(ss, g + 1, tid_in_wg, hint, S);
    }

    // ---- epilogue: the rows' sums for warpgroup 1 ----
    if (req == end_req) pdl_launch_dependents();
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) l[v] = decode::quad_sum(l[v]);
    if ((lane & 3) == 0) {
      ss.row_sum[row_in_tile[0]] = l[0];
      ss.row_sum[row_in_tile[1]] = l[1];
    }
    consumers_sync();  // row sums written; both warpgroups past their last wgmma of the row
    store_rows<0>(p, w, rows, lane, o0, o1, F, l, m);
    consumers_sync();  // the Q tile and row_sum are rewritten by the next row piece
  }
}

// ------------------------------------------------------------------------------------------------
// Warpgroup 1
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ void follow_loop(const DecodeParams& p, LeadStorage& ss, const SchedMetaRow& meta,
                                            int begin_req, int end_req, int m_block, int tid, int debug) {
  const int tid_in_wg = tid % kWgThreads;
  const int lane = tid & 31;
  const uint32_t hint = suspend_hint(debug);
  int row_in_tile[2], rows[2];
  thread_rows(tid_in_wg, m_block, row_in_tile, rows);

  typename PvTypes::TiledMma mma_o;
  uint32_t g = 0;
  for (int req = begin_req; req <= end_req; ++req) {
    const decode::RequestPiece w = decode::make_request_piece(p, meta, req, m_block);
    begin_row_piece(p, ss, req, m_block, tid);

    Tensor o0 = partition_fragment_C(mma_o, Shape<Int<kTileRows>, Int<128>>{});  // O of group 2
    Tensor o1 = partition_fragment_C(mma_o, Shape<Int<kTileRows>, Int<128>>{});  // O of group 3
    clear(o0);
    clear(o1);
    float F[2] = {0.f, 0.f};

    int stop;
    const int nblk = counted_blocks(p, w, stop);
    for (int blk = 0; blk < nblk; ++blk, ++g) {
      const int s = int(g % kStages);
      const int c = int(g % kPSlots);
      // ---- P of block g and the rows' factor from warpgroup 0 ----
      consumer_wait(ss.p_full[c], (g / kPSlots) & 1u, hint);
      uint32_t p16[kP16Words];
      decode_fp8::load_p(ss.p16[c], tid_in_wg, p16);
      const float sc[2] = {ss.sc[c][row_in_tile[0]], ss.sc[c][row_in_tile[1]]};
      warp_arrive(ss.p_empty[c], lane);

      // ---- V^T half 1 and the groups' factors and pairs of the block (vt_full publishes both); O rescaled, the
      // words of groups 2 and 3 ----
      uint32_t words0[kPTerms][8], words1[kPTerms][8];
      block_words<1>(ss, g, s, lane, debug, hint, sc, p16, o0, o1, F, words0, words1);

      // ---- O_g += P_g V_g ----
      pv_two_groups(tid_in_wg, words0, words1, ss.vt[1], o0, o1);
      warp_arrive(ss.vt_empty[1], lane);
    }

    // ---- epilogue ----
    if (req == end_req) pdl_launch_dependents();
    consumers_sync();  // warpgroup 0 wrote the rows' sums
    float l[2], m_unused[2] = {0.f, 0.f};
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) l[v] = ss.row_sum[row_in_tile[v]];
    store_rows<1>(p, w, rows, lane, o0, o1, F, l, m_unused);
    consumers_sync();
  }
}

}  // namespace flashmla_backend::sm90::sparse_fp8
