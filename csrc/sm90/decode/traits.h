// Types of the sm90 decode kernel: wgmma tiled MMAs, shared-memory layouts, the shared-memory plan
// and the named barriers. Included by the kernel's role headers, launch.cuh and the host-only
// checks/layout_check.cu.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include <type_traits>

#include "sm90/decode/config.h"

namespace flashmla_backend::sm90::decode {

using namespace cute;

// Element: the element type of q, the cache and the output (bf16 or fp16), which is also the wgmma operand type of
// the Q, K, V and P tiles in shared memory; Q and the KV pieces land there as they are.
template <class Element_>
struct Traits {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  using QIn = Element;
  using Out = Element;
  // What epilogue.cuh asks of the cache format: a 16-bit cache has no value scale.
  struct KvFormat {
    static constexpr bool kScaled = false;
  };
  // The P V accumulator's column n is value column n (epilogue.cuh; the FP8 tensor-core kernel permutes them).
  static constexpr bool kOutColumnsInterleaved = false;
  static_assert(std::is_same_v<Element, cutlass::bfloat16_t> || std::is_same_v<Element, cutlass::half_t>,
                "bf16 or fp16 only");
  static_assert(sizeof(Element) == kElemBytes, "16-bit elements");

  using TileM = Int<kBlockM>;
  using TileN = Int<kBlockN>;
  using HalfV = Int<kHalfDimV>;

  // S = Q K^T for one warpgroup: (64 rows, 64 keys), K = 576, both operands K-major in smem.
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<TileM, TileN, Int<kPieceCols>>,
                           GMMA::Major::K, GMMA::Major::K>()));
  // O_half += P V_half with P in registers (A, K-major) and V in smem read MN-major: (64, 256), K = 64.
  using TiledMmaPVReg = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<TileM, HalfV, TileN>, GMMA::Major::K,
                           GMMA::Major::MN>()));
  // Same with P read from shared memory (the tile the other warpgroup computed).
  using TiledMmaPVSmem = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<TileM, HalfV, TileN>, GMMA::Major::K,
                           GMMA::Major::MN>()));

  // Q tile and KV block: (rows, 576), K-major, 128B swizzle. The atom is 8 rows x 64 columns; atoms are
  // stacked along rows first, so columns [64 j, 64 j + 64) form one contiguous 8 KB piece, the exact image
  // of one TMA box (64 columns x 64 rows, SWIZZLE_128B).
  using SmemLayoutQK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                              Shape<TileM, Int<kHeadDimK>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                              Shape<TileN, Int<kHeadDimK>>{}));
  // V^T view of a KV block: (512 value columns, 64 keys); Vt(n, k) is KV(k, n) (same bytes).
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDimV>, TileN>{}, GenRowMajor{})));
  // P tile (64 rows, 64 keys), K-major, 128B swizzle: the layout of one KV piece.
  using SmemLayoutP = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<TileM, TileN>{}));

  static_assert(cosize_v<SmemLayoutQK> * kElemBytes == kQBytes, "Q tile size");
  static_assert(cosize_v<SmemLayoutKV> * kElemBytes == kKVBlockBytes, "KV block size");
  static_assert(cosize_v<SmemLayoutP> * kElemBytes == kPTileBytes, "P tile size");

  // One plan for the whole CTA. Nothing overlaps except the P tiles, which live in the rope piece
  // (piece kRopePiece) of the KV stage they were computed from (see config.h).
  struct alignas(kSmemAlign) SharedStorage {
    alignas(kSmemAlign) cute::array_aligned<Element, cosize_v<SmemLayoutQK>, kSmemAlign> q;
    alignas(kSmemAlign) cute::array_aligned<Element, cosize_v<SmemLayoutKV>, kSmemAlign> kv[kNumStages];
    float row_max[kBlockM];        // running max m (log2 domain, scaled), shared by both warpgroups
    float scale0[kBlockM];         // exp2(m_prev - m0) of the current step, written by warpgroup 0
    float scale1[kBlockM];         // exp2(m0 - m1) of the current step, written by warpgroup 1
    float row_sum[kNumWarpGroups][kBlockM];  // per-warpgroup row sums l, exchanged in the epilogue
    // kv_full[s][j]: TMA of piece j of stage s landed. Arrival count 1 (the issuing thread's
    // arrive.expect_tx of kPieceBytes); one phase per KV block loaded into the stage.
    cutlass::arch::ClusterTransactionBarrier kv_full[kNumStages][kNumPieces];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + kSmemAlign;  // + manual realignment
  static_assert(kSmemBytes <= kMaxSmemPerBlock, "shared memory plan exceeds 227 KB");
};

// Named barriers (bar.sync / bar.arrive). IDs are relative: cutlass::arch::NamedBarrier adds
// ReservedNamedBarrierCount (8), so they map to hardware barriers 8..12. Counts are threads.
enum class NamedBarriers : uint32_t {
  // WG0 arrives (128) after writing row_max = m0 and scale0; WG1 syncs (128) before reading them.
  // 256 threads, once per step.
  kScale0Ready = 0,
  // WG1 arrives after writing row_max = m1, scale1 and (if the step has a second block) P1 into
  // stage 1's rope piece (+ proxy fence); WG0 syncs. 256 threads, once per step.
  kScale1Ready = 1,
  // Warpgroup-local (128 threads): the zeroed V rows of a request's last block are written (and
  // fenced) by every thread of the warpgroup before its wgmma reads them.
  kWG0Local = 2,
  kWG1Local = 3,
  // WG0 arrives after writing P0 * scale1 (P0 in m1's frame) into stage 0's rope piece (+ proxy fence);
  // WG1 syncs before its P0 V0R. 256 threads, once per step.
  kP0Ready = 4,
};

}  // namespace flashmla_backend::sm90::decode
