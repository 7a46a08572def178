// Types of the accurate mode's keys-on-M kernel (docs/kernel-design.md, "The accurate mode for few query rows"):
// for R <= 32 query rows a KV head, the products are transposed so that the 64 keys of a block fill wgmma's M:
//   S^T = K Q^T   e4m3, M = 64 keys (the KV stage, as the 64-row kernel's B), N = 2 R (the hi terms of the R rows,
//                 then their lo terms: each term has an accumulator of its own, added in fp32), K = 576;
//   O^T += V^T P^T  fp16, M = value columns (the producer's fp16 V halves, read MN-major), N = R (P^T written to
//                 shared memory by the consumers), K = the block's 64 keys; fp32 accumulators.
// One consumer warpgroup holds all 512 value columns (4 R accumulators a thread) and walks the blocks in order;
// warpgroup 1 is the producer of the 64-row kernel (producer.cuh: the KV copies and the fp16 widening of V), which
// this Traits type serves with the same names.
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

// 256 threads: warpgroup 0 consumes, warpgroup 1 produces. Without setmaxnreg each thread may hold 255 registers
// (__launch_bounds__(256, 1)).
constexpr int kKmNumThreads = 2 * kThreadsPerWarpGroup;

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
  using Out = QIn;
  static_assert(std::is_same_v<QIn, cutlass::bfloat16_t> || std::is_same_v<QIn, cutlass::half_t>,
                "the keys-on-M tile serves the accurate mode: a 16-bit q");
  static constexpr int kRows = kRows_;
  static constexpr int kQRows = 2 * kRows;  // the Q tile: hi terms, then lo terms
  static_assert(kRows == 16 || kRows == 32, "R = 16 or 32 query rows");
  static constexpr int kStages = kStages_;
  static_assert(kStages >= 2, "at least two KV stages");
  static constexpr int kVParts = kVParts_;
  static constexpr int kPartCols = kHeadDimV / kVParts;  // 256 or 128

  // What producer.cuh reads of its Traits (the accurate mode's fp16 V; traits.h explains each).
  static constexpr bool kQFp8 = false;
  static constexpr int kQTerms = 2;
  static constexpr bool kPvF16 = true;
  static constexpr bool kShareVt = false;
  static constexpr bool kKeysOnM = true;
  static constexpr int kProducerRegs = 0;  // no setmaxnreg; the widening does not read it
  static constexpr int kVSlotPairs = kNumVPairs / kVParts;
  static constexpr int kVSlotBytes = kPartCols * kBlockN * 2;

  // S^T of a block: (64 keys, 2 R) e4m3, k32 steps, both operands K-major in shared memory.
  using TiledMmaS = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kQRows>, Int<kPieceCols>>,
                           GMMA::Major::K, GMMA::Major::K>()));
  // O^T_part += V_part^T P^T: (kPartCols value columns, R) fp16, k16 steps; A = the fp16 V part, B = P^T, both
  // MN-major.
  using TiledMmaO = decltype(make_tiled_mma(
      GMMA::ss_op_selector<cutlass::half_t, cutlass::half_t, float, Shape<Int<64>, Int<kRows>, Int<kBlockN>>,
                           GMMA::Major::MN, GMMA::Major::MN>()));

  // The Q tile (2 R rows, 576): 64B-swizzle atoms stacked along the rows first, nine pieces of 2 R x 64 bytes
  // (layout.h: km_q_chunk_offset).
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<Element>{},
                                             Shape<Int<kQRows>, Int<kHeadDimK>>{}));
  // A KV block (64 keys, 576), as in the 64-row kernel.
  using SmemLayoutTile = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<Element>{},
                                                Shape<Int<kBlockN>, Int<kHeadDimK>>{}));
  // A fp16 V part seen as (kPartCols value columns, 64 keys) MN-major: the 64-row kernel's layout of a half (traits.h),
  // pieces of 64 columns, 8 KB each (layout.h: v16_offset).
  using SmemLayoutVPart = decltype(composition(
      tile_to_shape(GMMA::Layout_K_SW128_Atom<cutlass::half_t>{}, Shape<Int<kBlockN>, Int<kPartCols>>{}),
      make_layout(Shape<Int<kPartCols>, Int<kBlockN>>{}, GenRowMajor{})));
  // P^T of a block: (R rows, 64 keys) fp16 MN-major (layout.h: km_pt_offset).
  using PtAtom = std::conditional_t<kRows == 16, GMMA::Layout_MN_SW32_Atom<cutlass::half_t>,
                                    GMMA::Layout_MN_SW64_Atom<cutlass::half_t>>;
  using SmemLayoutPt = decltype(tile_to_shape(PtAtom{}, Shape<Int<kRows>, Int<kBlockN>>{}));
  static constexpr int kQBytes = kQRows * kHeadDimK;
  static constexpr int kPtBytes = kRows * kBlockN * 2;
  static_assert(cosize_v<SmemLayoutQ> == kQBytes, "Q tile size");
  static_assert(cosize_v<SmemLayoutPt> * 2 == kPtBytes, "P^T size");

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
    float q_scale[kRows];         // a row's split scale (q ~ q_scale (hi + lo))
    float row_scale_log2[kRows];  // scale_log2 * descale_k * q_scale of the current request
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
