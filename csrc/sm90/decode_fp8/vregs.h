// Types of the "V in registers" tile (TraitsVR), first the accurate mode's: the 64-row, two-q-term tile of the sm90 FP8
// tensor-core decode kernel with P V computed transposed, O^T = V^T P^T, on fp16 wgmma whose A operand (V^T, 64 value
// columns a tile) is read from the KV stage into registers and widened there (mainloop_vregs.cuh), and whose B operand
// is P in fp16 in shared memory. No V^T or fp16 V buffer, no transposing or widening producer warps: the shared memory
// they took holds a third KV stage, and the producer warpgroup only issues copies.
//
// Why (csrc/sm90/decode_fp8/checks/vregs_probe.cu, H200): the fp16 V widened by the producer needs 32 KB a consumer
// half, so the accurate mode's 64-row tile runs rings of one slot that the consumers wait on (598 us at
// b128-sk8192-h128 against 496 with the widening's data movement skipped); the register-sourced n64 products run at the
// rate of the n256 ones (959 against 970 TFLOP/s for P V alone), and the in-register widening (8 ldmatrix.x4.trans, 32
// prmt and 64 cvt a thread and block) costs 20% of the P V products' time when nothing else overlaps it.
//
// Measured (docs/perf/journal.md, 2026-11-29, H200): correct (tests/test_fp8_gpu.py: error 1.69e-3 at b128-sk8192-h128,
// as the default tile's), but slower than the default tile: 631 against 599 us at b128-sk8192-h128, 387 / 359 on the
// varlen h_q 128 batch, 44 / 32 at b = 1; without the cvt (wrong results) 583 / 358. So it is not the default; it runs
// with FLASHMLA_BACKEND_FP8_DEBUG bit 1024 (decode.h: kDebugVRegs).
//
// The fast mode's form (an e4m3 q: one Q term, 4 KV stages, P V on e4m3 wgmma whose A words are V's bytes permuted by
// prmt, P in e4m3 with the exact running max): in place of the fast 64-row tile and its V transposition with the same
// bit. Measured (docs/perf/journal.md, 2026-11-30, H200): correct (tests/test_fp8_gpu.py, out 5.8e-3-2.1e-2 against
// fp64, as the default tile), no spills, but slower at every shape: 444.8 against 331.9 us at b128-sk8192-h128 (451 /
// 351 in 100 ms windows, both at the power cap), 876 / 652 at s_q 2, 275 / 207 on the varlen h_q 128 batch, 133 / 102
// at b64 h_q 32, 220 / 174 at b128 h_q 16, 31.9 / 21.7 at b = 1. ncu at b128-sk8192-h128: 137 M warp instructions
// against 100.6 M (the permutes and the exact max's column rescales, 28 M FP32 instructions against 15.6 M, now on the
// consumers' path instead of a producer warpgroup's).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/float8.h>
#include <cutlass/numeric_types.h>

#include <type_traits>

#include "sm90/decode_fp8/config.h"

namespace flashmla_backend::sm90::decode_fp8 {

using namespace cute;

// QIn: the 16-bit q of the accurate mode (split into two e4m3 terms as in Traits), or the fast mode's e4m3 q (one
// term; P V then on e4m3 wgmma: the A words are V's bytes permuted, not widened, and P is e4m3). kStages: KV blocks in
// flight.
template <class QIn_, int kStages_, int kConsumerRegs_ = 232, int kProducerRegs_ = 40>
struct TraitsVR {
  using QIn = QIn_;
  using Element = cutlass::float_e4m3_t;
  static constexpr bool kQFp8 = std::is_same_v<QIn, cutlass::float_e4m3_t>;
  static_assert(kQFp8 || std::is_same_v<QIn, cutlass::bfloat16_t> || std::is_same_v<QIn, cutlass::half_t>,
                "the V-in-registers tile takes a 16-bit q (accurate mode) or an e4m3 q (fast mode)");
  using Out = std::conditional_t<kQFp8, cutlass::bfloat16_t, QIn>;
  // The O^T product's operands: V^T words and P in fp16 (accurate) or e4m3 (fast).
  using PvElement = std::conditional_t<kQFp8, cutlass::float_e4m3_t, cutlass::half_t>;
  static constexpr int kQTerms = kQFp8 ? 1 : 2;
  static constexpr int kQTiles = kQTerms;
  static constexpr int kStages = kStages_;
  static constexpr int kTileRows = kBlockM;
  static constexpr int kOutRowsPerThread = 2;
  // qk_block (mainloop.cuh) takes the small q term first when kPvF16 (P V on 16-bit tensor cores).
  static constexpr bool kPvF16 = !kQFp8;
  static constexpr bool kStackedTerms = false;
  static constexpr bool kShareVt = false;
  static constexpr bool kMulticastKv = false;
  static constexpr bool kClusterPair = false;
  static constexpr bool kKeysOnM = false;
  static constexpr bool kVRegs = true;
  static constexpr int kConsumerRegs = kConsumerRegs_;
  static constexpr int kProducerRegs = kProducerRegs_;
  static_assert(kNumConsumerThreads * kConsumerRegs + kThreadsPerWarpGroup * kProducerRegs <= kCtaRegisters,
                "register split exceeds the CTA's allocation");
  static_assert(kStages >= 2, "at least two KV stages");
  struct KvFormat {
    static constexpr bool kScaled = true;
  };

  // S = Q K^T as in Traits.
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kBlockN>, Int<kPieceCols>>,
                           GMMA::Major::K, GMMA::Major::K>()));
  using SmemLayoutTile = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<Element>{},
                                                Shape<Int<kBlockM>, Int<kHeadDimK>>{}));
  // One O^T tile: (64 value columns, 64 query rows, 64 keys), A (V^T) from registers, B (P^T) K-major in shared memory.
  using TiledMmaOT = decltype(make_tiled_mma(GMMA::rs_op_selector<PvElement, PvElement, float,
                                                                  Shape<_64, _64, Int<kBlockN>>, GMMA::Major::K,
                                                                  GMMA::Major::K>()));
  // P of a block as the B operand: (64 query rows, 64 keys), K-major; fp16: rows of 128 bytes, 128B swizzle (layout.h:
  // sw128_offset); e4m3: rows of 64 bytes, 64B swizzle (sw64_offset), the keys in the order of the fast mode's P
  // fragment (mainloop.cuh: p_words), which the V^T words follow.
  using SmemLayoutPT = std::conditional_t<
      kQFp8,
      decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<cutlass::float_e4m3_t>{}, Shape<Int<kBlockM>, Int<kBlockN>>{})),
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<cutlass::half_t>{}, Shape<Int<kBlockM>, Int<kBlockN>>{}))>;
  static constexpr int kPtBytes = kBlockM * kBlockN * int(sizeof(PvElement));  // 8192 (fp16) or 4096 (e4m3)
  static_assert(cosize_v<SmemLayoutPT> * int(sizeof(PvElement)) == kPtBytes, "P tile size");
  static_assert(cosize_v<SmemLayoutTile> == kTileBytes, "tile size");

  struct alignas(kSmemAlign) SharedStorage {
    alignas(kSmemAlign) cute::array_aligned<uint8_t, kQTiles * kTileBytes, kSmemAlign> q;   // term tile t at t * 36 KB
    alignas(kSmemAlign) cute::array_aligned<uint8_t, kStages * kTileBytes, kSmemAlign> kv;  // block g: g % kStages
    // pt[0] = P0 (warpgroup 0's block, relative to m0), pt[1] = P1 (warpgroup 1's block, relative to m1), fp16, read
    // by both warpgroups' products.
    alignas(kSmemAlign) cute::array_aligned<uint8_t, 2 * kPtBytes, kSmemAlign> pt;
    float row_max[kBlockM];  // the reference max m of each row (log2 domain, scaled): mainloop_vregs.cuh
    float scale0[kBlockM];   // exp2(m_prev - m0) of the current step (warpgroup 0)
    float scale1[kBlockM];   // exp2(m0 - m1) of the current step (warpgroup 1)
    float row_sum[kNumConsumerWarpGroups][kBlockM];
    float q_scale[kBlockM];  // the 16-bit q's per-row split scale
    float row_scale_log2[kBlockM];
    float value_scale;
    // Where each row of the request piece goes (elements from p.out, or from p.o_accum for a split; -1: a row past
    // q_rows): set at the request's start (mainloop_vregs.cuh: vregs_row_offset), read by the epilogue.
    int64_t row_off[kBlockM];
    // kv_full[s][j]: piece j of stage s landed (TMA). kv_empty[s]: the eight consumer warps are done with stage s
    // (the owner's Q K^T and every warp's V reads).
    cutlass::arch::ClusterTransactionBarrier kv_full[kStages][kNumPieces];
    cutlass::arch::ClusterBarrier kv_empty[kStages];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + kSmemAlign;
  static_assert(kSmemBytes <= kMaxSmemPerBlock, "shared memory plan exceeds 227 KB");
};

// Whether a Traits type is the V-in-registers tile (TraitsVR; Traits and TraitsKM do not say).
template <class T, class = void>
struct IsVRegs : std::false_type {};
template <class T>
struct IsVRegs<T, std::void_t<decltype(T::kVRegs)>> : std::bool_constant<T::kVRegs> {};

// kv_empty of the V-in-registers tile: every consumer warp arrives once a block, after its last read of the stage.
constexpr uint32_t kKvEmptyArrivalsVRegs = kNumConsumerThreads / 32;

}  // namespace flashmla_backend::sm90::decode_fp8
