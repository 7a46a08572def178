// Types of the keys-on-M kernel (docs/kernel-design.md, "The accurate mode for few query rows"): for R <= 32 query
// rows a KV head, the products are transposed so that the 64 keys of a block fill wgmma's M:
//   S^T = K Q^T   e4m3, M = 64 keys (the KV stage, as the 64-row kernel's B), K = 576, N = 2 R in the accurate mode
//                 (the hi terms of the R rows, then their lo terms: each term has an accumulator of its own, added in
//                 fp32), R in the fast mode (an e4m3 q, one term);
//   O^T += V^T P^T  M = value columns, N = R (P^T written to shared memory by the consumers), K = the block's 64 keys,
//                 fp32 accumulators: in fp16 with the producer's fp16 V (accurate), or in e4m3 with its V^T (fast).
// One consumer warpgroup holds all 512 value columns (4 R accumulators a thread) and walks the blocks in order;
// warpgroup 1 is the producer of the 64-row kernel (producer.cuh: the KV copies and the fp16 widening or the
// transposition of V), which this Traits type serves with the same names.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/float8.h>
#include <cutlass/numeric_types.h>

#include <type_traits>

#include "sm90/decode_fp8/config.h"
#include "sm90/decode_fp8/traits.h"  // kKvEmptyArrivals, kVtFullArrivals, kVtEmptyArrivals

namespace flashmla_backend::sm90::decode_fp8 {

using namespace cute;

// QIn: bf16 or fp16 (the accurate mode). kRows: R, query rows of the tile (16 or 32; a tile serves up to R rows of
// one KV head). kStages: KV blocks in flight. kVParts: the fp16 V of a block in 2 halves or 4 quarters of value
// columns (each its own O^T accumulator, P V product and slot ring; the producer fills a half with two V piece pairs,
// a quarter with one). kRingA / kRingB: the rings (blocks in flight) of the first and the second half of the parts
// (traits.h: VRings). The one consumer reads a block's parts in order.
template <class QIn_, int kRows_, int kStages_, int kVParts_, int kRingA_, int kRingB_>
struct TraitsKM : VRings<kStages_, kVParts_, kRingA_, kRingB_> {
  using Rings = VRings<kStages_, kVParts_, kRingA_, kRingB_>;
  using Rings::kVtEmptyCopies;
  using Rings::kVtSlots;
  using QIn = QIn_;
  using Element = cutlass::float_e4m3_t;
  // An e4m3 q: the fast mode (one q term, P in e4m3, P V on e4m3 tensor cores with the transposed V^T of the fast
  // mode's producer, bf16 out). A 16-bit q: the accurate mode (two q terms, P and V in fp16).
  static constexpr bool kQFp8 = std::is_same_v<QIn, cutlass::float_e4m3_t>;
  using Out = std::conditional_t<kQFp8, cutlass::bfloat16_t, QIn>;
  static_assert(kQFp8 || std::is_same_v<QIn, cutlass::bfloat16_t> || std::is_same_v<QIn, cutlass::half_t>,
                "q is e4m3, bf16 or fp16");
  static constexpr int kRows = kRows_;
  static constexpr int kQTerms = kQFp8 ? 1 : 2;
  static constexpr int kQRows = kQTerms * kRows;  // the Q tile: (the hi terms, then the lo terms of) the R rows
  static_assert(kRows == 16 || kRows == 32, "R = 16 or 32 query rows");
  static constexpr int kStages = kStages_;
  static_assert(kStages >= 2, "at least two KV stages");
  static constexpr int kVParts = kVParts_;
  static_assert(!kQFp8 || kVParts == 2, "the fast mode's V^T comes in halves");
  static constexpr int kPartCols = kHeadDimV / kVParts;  // 256 or 128
  static constexpr int kRingFirst = kRingA_, kRingSecond = kRingB_;
  // One consumer warpgroup (warpgroup 0) and the producer (warpgroup 1), without setmaxnreg (each thread may hold 255
  // registers).
  static constexpr int kNumThreads = 2 * kThreadsPerWarpGroup;
  // The step order (keys_on_m.cuh: km_mainloop; FLASHMLA_BACKEND_FP8_DEBUG bit 128 runs the other). Measured on an
  // H100 (docs/perf/journal.md, 2026-11-27 evening), the next S^T issued ahead, once the block's maxima are known, is
  // faster for the accurate mode at R = 16 (b128 h_q 16 229.1-229.5 against 232.9-233.1 us, varlen h_q 16 141.2-141.3
  // against 142.3-142.7, b = 1 22.1 against 22.2-22.3), slower at R = 32 (b64 h_q 32 167.9-168.2 against
  // 161.2-162.6; its quarters' one-slot rings then wait for the widening) and for the fast mode (b = 1 h_q 16 17.7
  // against 17.4).
  static constexpr bool kStepAhead = !kQFp8 && kRows == 16;

  // What producer.cuh reads of its Traits (traits.h explains each): the accurate mode's fp16 V, or the fast mode's
  // V^T with eight ldmatrix in flight (units_in_flight: the producer is not held to few registers here).
  static constexpr bool kPvF16 = !kQFp8;
  static constexpr bool kShareVt = false;
  static constexpr bool kMulticastKv = false;
  static constexpr bool kClusterPair = false;
  static constexpr bool kKeysOnM = true;
  // No setmaxnreg: only units_in_flight reads it.
  static constexpr int kProducerRegs = kQFp8 ? 88 : 0;
  static constexpr int kVSlotPairs = kNumVPairs / kVParts;
  static constexpr int kVSlotBytes = kPartCols * kBlockN * (kPvF16 ? 2 : 1);

  // S^T of a block: (64 keys, kQRows) e4m3, k32 steps, both operands K-major in shared memory.
  using TiledMmaS = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kQRows>, Int<kPieceCols>>,
                           GMMA::Major::K, GMMA::Major::K>()));
  // O^T_part += V_part^T P^T: (kPartCols value columns, R). Accurate: fp16, k16 steps, A = the fp16 V part and B =
  // P^T, both MN-major. Fast: e4m3, k32 steps, A = the V^T half (value columns in the order of layout.h:
  // vt_row_column, keys in V^T's order) and B = P^T in that key order, both K-major.
  using PvElement = std::conditional_t<kPvF16, cutlass::half_t, Element>;
  static constexpr GMMA::Major kPvMajor = kPvF16 ? GMMA::Major::MN : GMMA::Major::K;
  using TiledMmaO = decltype(make_tiled_mma(
      GMMA::ss_op_selector<PvElement, PvElement, float, Shape<Int<64>, Int<kRows>, Int<kBlockN>>, kPvMajor,
                           kPvMajor>()));

  // The Q tile (kQRows rows, 576): 64B-swizzle atoms stacked along the rows first, nine pieces of kQRows x 64 bytes
  // (layout.h: km_q_chunk_offset).
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<Element>{},
                                             Shape<Int<kQRows>, Int<kHeadDimK>>{}));
  // A KV block (64 keys, 576), as in the 64-row kernel.
  using SmemLayoutTile = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<Element>{},
                                                Shape<Int<kBlockN>, Int<kHeadDimK>>{}));
  // A V part as (kPartCols value columns, 64 keys). Accurate: the fp16 V, MN-major, the 64-row kernel's layout of a
  // half (traits.h), pieces of 64 columns, 8 KB each (layout.h: v16_offset). Fast: a V^T half, K-major, 64B swizzle
  // (traits.h: SmemLayoutVtHalf).
  using SmemLayoutVPart = std::conditional_t<
      kPvF16,
      decltype(composition(
          tile_to_shape(GMMA::Layout_K_SW128_Atom<cutlass::half_t>{}, Shape<Int<kBlockN>, Int<kPartCols>>{}),
          make_layout(Shape<Int<kPartCols>, Int<kBlockN>>{}, GenRowMajor{}))),
      decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<Element>{}, Shape<Int<kPartCols>, Int<kBlockN>>{}))>;
  // P^T of a block: (R rows, 64 keys). Accurate: fp16 MN-major (layout.h: km_pt_offset). Fast: e4m3 K-major with 64B
  // swizzle, keys in V^T's order (layout.h: vt_kprime_of_key).
  using PtAtom = std::conditional_t<kRows == 16, GMMA::Layout_MN_SW32_Atom<cutlass::half_t>,
                                    GMMA::Layout_MN_SW64_Atom<cutlass::half_t>>;
  using SmemLayoutPt = std::conditional_t<
      kPvF16, decltype(tile_to_shape(PtAtom{}, Shape<Int<kRows>, Int<kBlockN>>{})),
      decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<Element>{}, Shape<Int<kRows>, Int<kBlockN>>{}))>;
  static constexpr int kQBytes = kQRows * kHeadDimK;
  static constexpr int kPtBytes = kRows * kBlockN * int(sizeof(PvElement));
  static_assert(cosize_v<SmemLayoutQ> == kQBytes, "Q tile size");
  static_assert(cosize_v<SmemLayoutPt> * int(sizeof(PvElement)) == kPtBytes, "P^T size");
  static_assert(cosize_v<SmemLayoutVPart> * int(sizeof(PvElement)) == kVSlotBytes, "V part size");

  struct alignas(kSmemAlign) SharedStorage {
    alignas(kSmemAlign) cute::array_aligned<uint8_t, kQBytes, kSmemAlign> q;
    alignas(kSmemAlign) cute::array_aligned<uint8_t, kStages * kTileBytes, kSmemAlign> kv;   // block g: g % kStages
    alignas(kSmemAlign) cute::array_aligned<uint8_t, kVtSlots * kVSlotBytes, kSmemAlign> vt;  // slot s: s * kVSlotBytes
    // P^T of the current block (written once the previous block's P V completed: keys_on_m.cuh).
    alignas(kSmemAlign) cute::array_aligned<uint8_t, kPtBytes, kSmemAlign> pt;
    // Per-warp maxima of a block's rows (one buffer: a block's are read before the kPtReady barrier that the next
    // block's writes come after), and the row sums at the end of a request.
    float col_max[4][kRows];
    float row_sum[4][kRows];
    float q_scale[kRows];         // a 16-bit q row's split scale (q ~ q_scale (hi + lo))
    float row_scale_log2[kRows];  // scale_log2 * descale_k * (descale_q or q_scale) of the current request
    float value_scale;
    // mbarriers: as in traits.h (the producer's protocol is the same; the one consumer warpgroup's four warps take
    // the place of the owner warpgroup and of the warpgroup that reads a half).
    cutlass::arch::ClusterTransactionBarrier kv_full[kStages][kNumPieces];
    cutlass::arch::ClusterBarrier kv_empty[kStages];
    cutlass::arch::ClusterBarrier vt_full[kVtSlots];
    cutlass::arch::ClusterBarrier vt_empty[kVtSlots][kVtEmptyCopies];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + kSmemAlign;
  static_assert(kSmemBytes <= kMaxSmemPerBlock, "shared memory plan exceeds 227 KB");
};

// Named barriers of the consumer warpgroup (128 threads).
enum class KmBarriers : uint32_t {
  kColMax = 0,  // the four warps' column maxima of a block are written
  kPtReady = 1, // P^T of a block is written (and fenced)
  kWarpGroup = 2,  // request boundaries, Q tile, row sums
  kPvDone = 3,  // every warp waited for the previous block's P V: P^T may be rewritten
};

}  // namespace flashmla_backend::sm90::decode_fp8
