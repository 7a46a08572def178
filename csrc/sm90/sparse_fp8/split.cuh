// The split plan of the sm90 sparse decode kernel (kernel.cuh): each consumer warpgroup owns two latent groups,
// computes their part of every block's scores and hands it to the other warpgroup through shared memory; both then
// hold the same scores and run the same softmax, and each multiplies P by V for its two groups.
#pragma once

#include "sm90/sparse_fp8/common.cuh"

namespace flashmla_backend::sm90::sparse_fp8 {

struct alignas(1024) SplitStorage {
  // What the gather and transposer warps (common.cuh) ask of a plan's storage: mask and scales of block g in stage
  // g % kStages, V^T half h of every block in slot h.
  static __device__ __forceinline__ uint32_t mask_slot(uint32_t g) { return g % uint32_t(kStages); }
  static __device__ __forceinline__ uint32_t vt_slot(int h, uint32_t) { return uint32_t(h); }
  static __device__ __forceinline__ uint32_t vt_use(int, uint32_t g) { return g; }
  alignas(1024) uint8_t q_latent[kQTerms * kLatentBytes];    // term t at t * kLatentBytes (qk.cuh's Q tile)
  alignas(1024) uint8_t q_rope[kRopeBytes];
  alignas(1024) uint8_t stage[kStages][kStageBytes];        // block g in stage g % kStages (layout.h)
  alignas(1024) uint8_t vt[2][decode_fp8::kVtHalfBytes];    // V^T half h (groups 2 h, 2 h + 1), read by warpgroup h
  alignas(16) float sx[2][kTileRows * kTileRows];           // warpgroup w's part of a block's scores
  uint64_t mask[kStages];                                    // the block's entries that name a token (gather.cuh)
  float row_scale_log2[kTileRows];                           // softmax scale (log2) x the row's q split scale
  // full[s]: block landed in stage s (common.cuh: gather_warp, kFullArrivals). empty[s]: the 8 consumer warps
  // (scores and P built) and the transposer warps are done with stage s. vt_full[h]: V^T half h written (the
  // transposer warps). vt_empty[h]: warpgroup h's P V of the half completed (its 4 warps).
  cutlass::arch::ClusterBarrier full[kStages];
  cutlass::arch::ClusterBarrier empty[kStages];
  cutlass::arch::ClusterBarrier vt_full[2];
  cutlass::arch::ClusterBarrier vt_empty[2];
};
static_assert(int(sizeof(SplitStorage)) + 1024 <= decode_fp8::kMaxSmemPerBlock, "shared memory plan exceeds 227 KB");

constexpr uint32_t kSplitEmptyArrivals = 8 + kTransposeWarps;

// Named barriers (IDs relative to CUTLASS's reserved ones), all used in their non-.aligned form: the two consumer
// warpgroups run different instantiations of split_consumer_loop, so they reach each barrier at different instructions
// (decode_fp8/kernel.cuh: consumers_sync says more). kScoresReady: both warpgroups wrote their part of the
// block's scores. kScoresFree + w: warpgroup 1 - w read warpgroup w's part (it arrives), so warpgroup w may write
// the next one (it waits): one arrival a block, one wait a block after the CTA's first and one at the end.
enum class SplitBar : uint32_t { kConsumers = kBarConsumers, kScoresReady = 1, kScoresFree = 2 };

template <int kWG>
__device__ __forceinline__ void split_consumer_loop(const DecodeParams& p, SplitStorage& ss, const SchedMetaRow& meta,
                                                    int begin_req, int end_req, int m_block, int tid, int debug) {
  const int tid_in_wg = tid % kWgThreads;
  const int lane = tid & 31;
  const uint32_t hint = suspend_hint(debug);
  int row_in_tile[2], rows[2];
  thread_rows(tid_in_wg, m_block, row_in_tile, rows);
  constexpr int kG0 = 2 * kWG;  // this warpgroup's groups: kG0, kG0 + 1
  uint8_t* vt_half = ss.vt[kWG];

  typename QkTypes::TiledMmaLatent mma_s;
  typename PvTypes::TiledMma mma_o;
  uint32_t g = 0;
  for (int req = begin_req; req <= end_req; ++req) {
    const decode::RequestPiece w = decode::make_request_piece(p, meta, req, m_block);
    begin_row_piece(p, ss, req, m_block, tid);
    const float sl2[2] = {ss.row_scale_log2[row_in_tile[0]], ss.row_scale_log2[row_in_tile[1]]};

    Tensor o0 = partition_fragment_C(mma_o, Shape<Int<kTileRows>, Int<128>>{});  // O of group kG0
    Tensor o1 = partition_fragment_C(mma_o, Shape<Int<kTileRows>, Int<128>>{});  // O of group kG0 + 1
    clear(o0);
    clear(o1);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float F[2] = {0.f, 0.f};  // the groups' factors; 0: none yet

    int stop;
    const int nblk = counted_blocks(p, w, stop);
    for (int blk = 0; blk < nblk; ++blk, ++g) {
      const int s = int(g % kStages);
      consumer_wait(ss.full[s], (g / kStages) & 1u, hint);
      cutlass::arch::fence_view_async_shared();  // the gather's cp.async writes (generic proxy), read by wgmma
      uint8_t* stage = ss.stage[s];
      Tensor S = partition_fragment_C(mma_s, Shape<Int<kTileRows>, Int<kBlockTokens>>{});
      float thread_max[2];  // the thread's largest scale of each of the two groups (for the factors below)
      {
        Tensor tmp = partition_fragment_C(mma_s, Shape<Int<kTileRows>, Int<kBlockTokens>>{});
        sparse_qk_groups<kQTerms, kG0, 2, 2 * kWG, 2>(tid_in_wg, ss.q_latent, ss.q_rope, stage,
                                                      reinterpret_cast<const float*>(stage + kScalesAt), S, tmp,
                                                      thread_max);
      }
      // ---- the other warpgroup's part of the scores ----
      if (g > 0) NamedBarrier(kNumConsumerThreads, uint32_t(SplitBar::kScoresFree) + kWG).arrive_and_wait_unaligned();
      {
        float4* mine = reinterpret_cast<float4*>(ss.sx[kWG]);
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < size(S) / 4; ++c)
          mine[c * kWgThreads + tid_in_wg] = make_float4(S(4 * c), S(4 * c + 1), S(4 * c + 2), S(4 * c + 3));
      }
      NamedBarrier(kNumConsumerThreads, uint32_t(SplitBar::kScoresReady)).arrive_and_wait_unaligned();
      if (!(debug & kDebugNoExchange)) {
        const float4* other = reinterpret_cast<const float4*>(ss.sx[1 - kWG]);
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < size(S) / 4; ++c) {
          const float4 x = other[c * kWgThreads + tid_in_wg];
          S(4 * c) += x.x;
          S(4 * c + 1) += x.y;
          S(4 * c + 2) += x.z;
          S(4 * c + 3) += x.w;
        }
      }
      NamedBarrier(kNumConsumerThreads, uint32_t(SplitBar::kScoresFree) + (1 - kWG)).arrive_unaligned();

      // ---- mask, online softmax: P = 2^(S sl2 - m + 8) ----
      float sc[2];
      online_softmax(S, ss.mask[s], lane, sl2, m, l, sc);

      // ---- the groups' factors (only ever lowered: O_g times the ratio, a power of two) and P's words ----
      const float* scales = reinterpret_cast<const float*>(stage + kScalesAt);
      float ratio[2];
      update_group_factors(thread_max, F, ratio);
      rescale_groups(o0, o1, sc, ratio);
      uint32_t words0[kPTerms][8], words1[kPTerms][8];
      build_group_words<kG0>([&](int idx) { return S(idx); }, scales, F, lane, debug, words0, words1);
      warp_arrive(ss.empty[s], lane);  // scores, mask and scales read

      // ---- O_g += P_g V_g ----
      consumer_wait(ss.vt_full[kWG], g & 1u, hint);
      pv_two_groups(tid_in_wg, words0, words1, vt_half, o0, o1);
      warp_arrive(ss.vt_empty[kWG], lane);
    }

    // ---- epilogue ----
    if (req == end_req) pdl_launch_dependents();
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) l[v] = decode::quad_sum(l[v]);
    store_rows<kWG>(p, w, rows, lane, o0, o1, F, l, m);
    consumers_sync();  // both warpgroups are past their last wgmma of the row: the Q tile may be rewritten
  }
  // Balance the score hand-off barrier: the other warpgroup arrived once more than this one waited.
  if (g > 0) NamedBarrier(kNumConsumerThreads, uint32_t(SplitBar::kScoresFree) + kWG).arrive_and_wait_unaligned();
}

}  // namespace flashmla_backend::sm90::sparse_fp8
