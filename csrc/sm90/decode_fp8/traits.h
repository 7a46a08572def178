// Types of the sm90 FP8 tensor-core decode kernel: the e4m3 wgmma tiled MMAs, the 64B-swizzled shared-memory
// layouts, the shared-memory plan and the named barriers.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/float8.h>
#include <cutlass/numeric_types.h>

#include <type_traits>

#include "sm90/decode_fp8/config.h"

namespace flashmla_backend::sm90::decode_fp8 {

using namespace cute;

// The shared transposition's barriers and counters (Traits::kShareVt), SharedStorage's last member: one byte
// otherwise, so that the other plans' shared memory does not grow (it lies in the rounding to kSmemAlign), and last so
// that it moves no other member (a base would put it before the 1024-byte aligned Q tile). peer_empty[s] (a slot of
// this CTA's own half): the other CTA's consumer warpgroup finished the P V of its copy of the slot's last use (remote
// arrivals), so the next use may be written and sent. One barrier a slot, whatever the ring: a pair waits for it
// only after its local vt_empty passed, i.e. after the slot's previous use was read here, so written, so after that
// use's pairs passed their own peer_empty wait; a waiter is never two phases ahead (checks/protocol_model.py:
// run_cluster). vt_pairs_sent[s]: piece pairs of the slot written so far (odd: the second pair's warp sends).
template <bool kShareVt, int kVtSlots>
struct ShareVtState {};
template <int kVtSlots>
struct ShareVtState<true, kVtSlots> {
  cutlass::arch::ClusterBarrier peer_empty[kVtSlots];
  uint32_t vt_pairs_sent[kVtSlots];
};

// The V slots of both kernels' Traits (Traits below, keys_on_m.h's TraitsKM): a block's V in kParts parts of value
// columns (halves: h = 0, 1; quarters: h = 0..3), part h of block g in slot vt_slot(h, g): g modulo the part's ring
// (kRingA for the first half of the parts, kRingB for the others), the rings one after the other. vt_use(h, g): the
// use of that slot block g is (its barriers' completion n = 0, 1, ...).
// The releases of a slot go round kVtEmptyCopies barriers (use u: barrier u % kVtEmptyCopies, its completion
// u / kVtEmptyCopies). A parity wait tells completion n from n + 1 only: it passes at once when the barrier is at
// n - 1, which happens when a producer warp reaches use u of a slot (waiting for the release of u - 1) while use
// u - 2 is still being read. The pairs of V pieces go round-robin over the producer's warps, so a warp may skip uses
// of a slot, and nothing but its KV stage holds it back: the copy of block g waited for the V work of block
// g - kStages, whose use of the slot waited for releases up to kStages / ring uses before. With one barrier per slot
// that was unsafe wherever kStages > ring (the 3-stage fast plan with rings of 2, the rings of one of kPvF16); with
// ceil(kStages / shortest ring) copies each barrier's completions are that many uses apart.
// checks/protocol_model.py plays the parity rule and finds the unsafe schedules with one barrier.
template <int kStages, int kParts, int kRingA, int kRingB>
struct VRings {
  static_assert(kParts == 2 || kParts == 4, "V in halves or quarters");
  static_assert(kRingA >= 1 && kRingB >= 1, "rings of one slot or more");
  static constexpr int kVtSlots = kParts / 2 * (kRingA + kRingB);
  static constexpr int kMinRing = kRingA < kRingB ? kRingA : kRingB;
  static constexpr int kVtEmptyCopies = (kStages + kMinRing - 1) / kMinRing;
  static __host__ __device__ __forceinline__ uint32_t vt_slot(int h, uint32_t g) {
    return h < kParts / 2 ? uint32_t(h * kRingA) + g % uint32_t(kRingA)
                          : uint32_t(kParts / 2 * kRingA + (h - kParts / 2) * kRingB) + g % uint32_t(kRingB);
  }
  static __host__ __device__ __forceinline__ uint32_t vt_use(int h, uint32_t g) {
    return g / uint32_t(h < kParts / 2 ? kRingA : kRingB);
  }
  // The barrier that use u of slot s is released on, and the parity of that release.
  template <class SharedStorage>
  static __device__ __forceinline__ cutlass::arch::ClusterBarrier& vt_empty_of(SharedStorage& ss, uint32_t slot,
                                                                               uint32_t use) {
    return ss.vt_empty[slot][use % uint32_t(kVtEmptyCopies)];
  }
  static __host__ __device__ __forceinline__ uint32_t vt_empty_parity(uint32_t use) {
    return (use / uint32_t(kVtEmptyCopies)) & 1u;
  }
};

// QIn: q's element type in global memory. An e4m3 q (the fast mode: true value = stored x descale_q) is used as
// it is, one term. A 16-bit q (the accurate mode) is split per row into kQTerms e4m3 terms of one power-of-two
// scale: q ~ s (hi + lo) with hi = e4m3(q / s), lo = e4m3(q / s - hi), so Q K^T is kQTerms e4m3 products into one
// accumulator. P is cast to one e4m3 term (the fast mode's P V). kStages: KV blocks in flight;
// kVtLeft / kVtRight: V^T halves in flight for consumer warpgroup 0 / 1 (config.h: each warpgroup reads only its
// half, and the two read them at different points of a step; mainloop.cuh).
// kConsumerRegs / kProducerRegs: the setmaxnreg split (config.h).
// kPvF16 (the accurate mode): P V runs on 16-bit tensor cores instead: P in fp16 (the S accumulator's own register
// layout), V widened by the producer from the e4m3 stage to fp16 in [key][value column] order (the 16-bit kernel's
// MN-major operand, 128B swizzle) instead of transposed, one 32 KB buffer a consumer warpgroup half (rings of 1,
// read in block order: mainloop_f16pv.cuh), fp32 accumulation. Q K^T stays on e4m3 tensor
// cores with the two q terms, the small one first (qk_block).
// kStackedTerms (the accurate mode at most 32 query rows a KV head): both q terms in one 64-row tile (layout.h:
// stacked_term_row), one Q K^T product instead of two; a consumer thread's two accumulator rows are then one query
// row (the hi and lo scores, added in fp32 and kept in both), so with kPvF16 P V computes each output row twice and
// the epilogue writes one of them (kOutRowsPerThread); without it (P V on e4m3 tensor cores, V^T transposed as in
// the fast mode) the second row carries P's second e4m3 term (kPTerms2). The Q tile is 36 KB instead of 72.
// kShareVt: the kernel runs as 2-CTA clusters over pairs of M tiles of the same KV blocks (grid x = 2 k, 2 k + 1):
// CTA rank r transposes only V^T half r of every block and hands a copy to the other CTA with a shared-memory bulk
// copy (producer.cuh: send_vt_half), so that each SM does half the transposition (docs/kernel-design.md).
// kMulticastKv: the same 2-CTA clusters, each CTA transposing all of its V as the one-CTA plan does, but every KV
// block read from L2 once a cluster: each CTA issues every other piece of a block (the odd ninth alternating between
// the ranks by block) as a TMA multicast into both CTAs' stages, so a stage is refilled only once the consumers and
// transposers of both CTAs released it (producer.cuh: copy_loop, release_kv_stage).
template <class QIn_, int kQTerms_, int kStages_, int kVtLeft_ = 2, int kVtRight_ = 2,
          int kConsumerRegs_ = 216, int kProducerRegs_ = 72, bool kShareVt_ = false, bool kPvF16_ = false,
          bool kStackedTerms_ = false, bool kMulticastKv_ = false>
struct Traits : VRings<kStages_, 2, kVtLeft_, kVtRight_> {
  using Rings = VRings<kStages_, 2, kVtLeft_, kVtRight_>;
  using Rings::kVtEmptyCopies;
  using Rings::kVtSlots;
  using QIn = QIn_;
  using Element = cutlass::float_e4m3_t;
  static constexpr bool kQFp8 = std::is_same_v<QIn, cutlass::float_e4m3_t>;
  // The output: bf16 for an e4m3 q, q's type otherwise.
  using Out = std::conditional_t<kQFp8, cutlass::bfloat16_t, QIn>;
  static constexpr int kQTerms = kQTerms_;
  static constexpr int kStages = kStages_;
  // V^T half h of block g lives in slot vt_slot(h, g) (VRings): the left ring, then the right one.
  static constexpr int kVtLeft = kVtLeft_;
  static constexpr int kVtRight = kVtRight_;
  static_assert(std::is_same_v<QIn, cutlass::float_e4m3_t> || std::is_same_v<QIn, cutlass::bfloat16_t> ||
                    std::is_same_v<QIn, cutlass::half_t>,
                "q is e4m3, bf16 or fp16");
  static_assert(!kQFp8 || kQTerms == 1, "an e4m3 q is one term");
  static_assert(kQTerms >= 1 && kQTerms <= 2, "one or two q terms");
  static constexpr bool kPvF16 = kPvF16_;
  static_assert(kStages >= 2, "at least two KV stages");
  static_assert(kPvF16 ? (kVtLeft_ >= 1 && kVtRight_ >= 1) : (kVtLeft_ >= 2 && kVtRight_ >= 2),
                "V^T rings of two halves or more (one or more for the fp16 V of kPvF16)");
  static_assert(!kPvF16 || (!kQFp8 && kQTerms == 2), "fp16 P V is the accurate mode's: a 16-bit q in two terms");
  static constexpr bool kStackedTerms = kStackedTerms_;
  static_assert(!kStackedTerms || (!kQFp8 && kQTerms == 2), "the stacked Q tile holds a 16-bit q's two terms");
  // The stacked Q tile with P V on e4m3 tensor cores: a thread's accumulator row g + 8, which is row g's query row,
  // carries P's second e4m3 term (mainloop.cuh: p_words), and the epilogue adds its O into row g's (kernel.cuh).
  static constexpr bool kPTerms2 = kStackedTerms && !kPvF16;
  static constexpr int kQTiles = kStackedTerms ? 1 : kQTerms;             // (64, 576) e4m3 tiles of Q
  static constexpr int kTileRows = kStackedTerms ? kBlockM / 2 : kBlockM;  // query rows of an M tile
  static constexpr int kOutRowsPerThread = kStackedTerms ? 1 : 2;         // output rows of a thread's accumulator
  static constexpr bool kShareVt = kShareVt_;
  static constexpr bool kKeysOnM = false;  // keys_on_m.h: TraitsKM
  static_assert(!kShareVt || kQFp8, "the shared transposition serves the fast mode");
  static constexpr bool kMulticastKv = kMulticastKv_;
  static_assert(!kMulticastKv || (kQFp8 && !kShareVt), "the multicast copies serve the fast mode's one-CTA plan");
  // Launched as 2-CTA clusters over pairs of M tiles (launch.cuh, kernel.cuh).
  static constexpr bool kClusterPair = kShareVt || kMulticastKv;
  static constexpr int kConsumerRegs = kConsumerRegs_;
  static constexpr int kProducerRegs = kProducerRegs_;
  static_assert(kNumConsumerThreads * kConsumerRegs + kThreadsPerWarpGroup * kProducerRegs <= kCtaRegisters,
                "register split exceeds the CTA's allocation");

  // The P V accumulator's columns are V^T's rows: value columns in the order of layout.h (vt_row_column), which
  // sm90/decode/epilogue.cuh undoes; the widened fp16 V keeps the natural order.
  static constexpr bool kOutColumnsInterleaved = !kPvF16;
  // What sm90/decode/epilogue.cuh asks of the cache format: the value scale is applied to the output.
  struct KvFormat {
    static constexpr bool kScaled = true;
  };

  // S = Q K^T of one warpgroup: (64 rows, 64 keys), k32 steps, both operands K-major in shared memory.
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kBlockN>, Int<kPieceCols>>,
                           GMMA::Major::K, GMMA::Major::K>()));
  // O_half += P V_half: P in registers (the e4m3 A fragment), V^T in shared memory, K-major (keys contiguous); with
  // kPvF16 P is the fp16 A fragment and V the fp16 [key][column] buffer, MN-major.
  using PvElement = std::conditional_t<kPvF16, cutlass::half_t, Element>;
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<PvElement, PvElement, float, Shape<Int<kBlockM>, Int<kHalfDimV>, Int<kBlockN>>,
                           GMMA::Major::K, kPvF16 ? GMMA::Major::MN : GMMA::Major::K>()));
  // P's A fragment a consumer thread holds: kPWords 32-bit words (e4m3: 8, fp16: 16), handed between the warpgroups
  // as kPBytes.
  static constexpr int kPWords = kPvF16 ? 16 : 8;
  static constexpr int kPBytes = kPWords * 4 * kThreadsPerWarpGroup;

  // A Q term tile or a KV block (64 rows, 576): 8 x 64-byte atoms stacked along the rows first, so columns
  // [64 j, 64 j + 64) are one contiguous 4 KB piece, the image of one TMA box with 64B swizzle.
  using SmemLayoutTile = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<Element>{},
                                                Shape<Int<kBlockM>, Int<kHeadDimK>>{}));
  // A V^T half of a block (256 value columns, 64 keys; both in the permuted orders of config.h), one 64-byte row per
  // column.
  using SmemLayoutVtHalf = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<Element>{},
                                                  Shape<Int<kHalfDimV>, Int<kBlockN>>{}));
  // kPvF16: a consumer warpgroup's fp16 V (64 keys, 256 value columns) K-major with 128B swizzle, four 8 KB pieces of
  // 64 columns (layout.h: v16_offset), seen by the P V product as (256 columns, 64 keys) MN-major.
  using SmemLayoutV16Half = decltype(composition(
      tile_to_shape(GMMA::Layout_K_SW128_Atom<cutlass::half_t>{}, Shape<Int<kBlockN>, Int<kHalfDimV>>{}),
      make_layout(Shape<Int<kHalfDimV>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutVHalf = std::conditional_t<kPvF16, SmemLayoutV16Half, SmemLayoutVtHalf>;
  // Bytes of one V buffer slot (a V^T half, or a fp16 V half), and the V piece pairs that fill one (producer.cuh).
  static constexpr int kVSlotBytes = kPvF16 ? kV16HalfBytes : kVtHalfBytes;
  static constexpr int kVSlotPairs = kNumVPieces / 4;
  static_assert(cosize_v<SmemLayoutTile> == kTileBytes, "tile size");
  static_assert(cosize_v<SmemLayoutVtHalf> == kVtHalfBytes, "V^T half size");
  static_assert(cosize_v<SmemLayoutV16Half> * 2 == kV16HalfBytes, "fp16 V half size");

  struct alignas(kSmemAlign) SharedStorage {
    alignas(kSmemAlign) cute::array_aligned<uint8_t, kQTiles * kTileBytes, kSmemAlign> q;    // term tile t at t * 36 KB
    alignas(kSmemAlign) cute::array_aligned<uint8_t, kStages * kTileBytes, kSmemAlign> kv;   // block g: g % kStages
    // slot s at s * kVSlotBytes
    alignas(kSmemAlign) cute::array_aligned<uint8_t, kVtSlots * kVSlotBytes, kSmemAlign> vt;
    // P tiles handed between the consumer warpgroups in A-fragment order: p[0] = P0 * scale1 (warpgroup 0 ->
    // 1; kPvF16: P0, which warpgroup 1 scales), p[1] = P1 (warpgroup 1 -> 0).
    alignas(16) uint8_t p[2][kPBytes];
    float row_max[kTileRows];   // running max m (log2 domain, scaled), shared by both consumer warpgroups
    float scale0[kTileRows];    // exp2(m_prev - m0) of the current step (warpgroup 0)
    float scale1[kTileRows];    // exp2(m0 - m1) of the current step (warpgroup 1)
    float row_sum[kNumConsumerWarpGroups][kTileRows];
    float q_scale[kTileRows];   // a 16-bit q's per-row split scale (q ~ q_scale (hi + lo)); unused for an e4m3 q
    // The current request's softmax scale per row (log2 domain, the scales folded: scale_log2 * descale_k *
    // (descale_q or q_scale)) and the value scale of the epilogue (descale_k). Kept here rather than in
    // registers across the main loop.
    float row_scale_log2[kTileRows];
    float value_scale;
    // kPTerms2: each consumer thread's running max at which its copy of O was stored (mainloop.cuh: OPromotion),
    // here rather than in a register that the main loop does not have.
    float o_copy_max[kPTerms2 ? kNumConsumerThreads : 1];
    // kPTerms2: the running max at the end of a run, published by warpgroup 0 for warpgroup 1 (kRunMax), which
    // cannot read row_max itself then: warpgroup 0's next run may already have moved it.
    float run_max[kPTerms2 ? kTileRows : 1];
    // mbarriers. kv_full[s][j]: piece j of stage s landed (TMA, 4096 transaction bytes). kv_empty[s]: the owner
    // warpgroup's Q K^T (4 warps) and the four piece pairs of the transposition are done with stage s. vt_full[s]:
    // V^T slot s written (its two piece pairs). vt_empty[s][u % kVtEmptyCopies]: the P V of use u of slot s completed
    // in its consumer warpgroup (4 warps); see kVtEmptyCopies.
    cutlass::arch::ClusterTransactionBarrier kv_full[kStages][kNumPieces];
    cutlass::arch::ClusterBarrier kv_empty[kStages];
    cutlass::arch::ClusterBarrier vt_full[kVtSlots];
    cutlass::arch::ClusterBarrier vt_empty[kVtSlots][kVtEmptyCopies];
    ShareVtState<kShareVt, kVtSlots> share;  // last: see ShareVtState
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + kSmemAlign;

  // The V^T half that slot s holds (the left ring first).
  static __host__ __device__ __forceinline__ int vt_half_of_slot(int s) { return s < kVtLeft_ ? 0 : 1; }
  static_assert(kSmemBytes <= kMaxSmemPerBlock, "shared memory plan exceeds 227 KB");
};

// Arrival counts of the mbarriers (per phase). The transposition works in pairs of V pieces (producer.cuh); the
// warp that did a pair arrives once for it, whichever warp that is.
constexpr int kNumTransposeWarps = 3;                       // producer warps 1..3 (producer.cuh)
constexpr int kNumVPairs = kNumVPieces / 2;                 // 4 pairs a block, 2 a V^T half
constexpr uint32_t kKvEmptyArrivals = 4 + kNumVPairs;       // owner warpgroup's warps + the block's pairs
constexpr uint32_t kVtFullArrivals = kNumVPairs / 2;        // the half's pairs
constexpr uint32_t kVtEmptyArrivals = 4;                    // the warps of the consumer warpgroup reading the half
// With the shared transposition (Traits::kShareVt) a CTA transposes the two pairs of its own half of each block; the
// other half's slot is written by the peer CTA's bulk copy, whose sender arrives once (with the expected bytes), and
// peer_empty counts the warps of the peer's consumer warpgroup that read the copy.
constexpr uint32_t kKvEmptyArrivalsShared = 4 + kNumVPairs / 2;
constexpr uint32_t kVtFullArrivalsCopied = 1;
constexpr uint32_t kPeerEmptyArrivals = 4;

// Named barriers among the 256 consumer threads. IDs are relative to CUTLASS's reserved ones (cutlass/arch/barrier.h:
// FirstUserBarrier is hardware barrier 8 in CUTLASS 4.2), so only 0..7 exist: a tile that needs one more reuses the ID
// of a tile kind it never is (an ID of 8 became hardware barrier 0, __syncthreads' own).
enum class NamedBarriers : uint32_t {
  kScale0Ready = 0,  // warpgroup 0 wrote m0, scale0
  kScale1Ready = 1,  // warpgroup 1 wrote m1, scale1 and P1
  kP0Ready = 2,      // warpgroup 0 wrote P0 * scale1
  kConsumers = 3,    // all consumer threads (request boundaries, Q tile, row sums)
  kP0Free = 4,       // kPvF16: warpgroup 1 loaded P0, p[0] may be rewritten (TraitsVR: its P0 V product completed)
  kP1Free = 5,       // TraitsVR: warpgroup 0's P1 V product completed, pt[1] may be rewritten
  kOwnP0 = 6,        // TraitsVR: warpgroup 0's four warps stored P0 (128 threads)
  kOwnP1 = 7,        // TraitsVR: warpgroup 1's four warps stored P1 (128 threads)
  kRunMax = 6,       // kPTerms2 (never TraitsVR): warpgroup 0 published the running max at a run's end (run_max)
};
static_assert(uint32_t(NamedBarriers::kOwnP1) + cutlass::arch::NamedBarrier::ReservedNamedBarrierCount <
                  cutlass::arch::NamedBarrier::HardwareMaxNumNamedBarriers,
              "every named barrier ID maps to a hardware barrier of its own");

}  // namespace flashmla_backend::sm90::decode_fp8
