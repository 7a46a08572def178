// Main loop of the sm90 decode kernel: the Q K^T and P V wgmma steps of one request piece and the "seesaw"
// schedule between the two warpgroups (docs/kernel-design.md).
//
// The KV blocks of a piece are consumed two at a time: block 2k sits in KV stage 0 and is multiplied by Q in
// warpgroup 0, block 2k+1 in stage 1 and warpgroup 1. Warpgroup 0 accumulates the output columns [0, 256)
// (O_L), warpgroup 1 the columns [256, 512) (O_R) of both blocks; the row max, the rescale factors and the P
// tiles are exchanged through shared memory under named barriers (traits.h: NamedBarriers). Each warpgroup
// re-issues the TMA of the KV pieces it was the last to read (copies.cuh: refill_kv_pieces).
#pragma once

#include <cuda.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include <cstdint>

#include "params.h"
#include "sm90/decode/config.h"
#include "sm90/decode/copies.cuh"
#include "sm90/decode/softmax.cuh"
#include "sm90/decode/tile_work.cuh"
#include "sm90/decode/traits.h"

namespace flashmla_backend::sm90::decode {

using namespace cute;
using NamedBarrier = cutlass::arch::NamedBarrier;

// ------------------------------------------------------------------------------------------------
// wgmma steps
// ------------------------------------------------------------------------------------------------
// The wgmma helpers below derive their smem descriptors from `pointer + opaque_zero()`, where the
// zero comes from a volatile asm placed right before the wgmma (after the mbarrier wait). NOTE: without
// this the compiler computes the descriptors of all 36 Q K^T k-blocks up front (or reuses the prologue's
// across the main loop) while the 128 output accumulators are in flight, and either spills them or
// serializes every wgmma for lack of registers. Volatile asms keep their relative order, so each piece's
// descriptors are computed after its wait.
__device__ __forceinline__ uint32_t opaque_zero() {
  uint32_t z;
  asm volatile("mov.u32 %0, 0;" : "=r"(z));
  return z;
}

// Issue Q K^T k-blocks of the pieces in kPieces (in that order), waiting for each piece's TMA first;
// one commit group. The first k-block overwrites the accumulator when kZeroInit.
template <class T, int kStage, bool kZeroInit, int... kPieces, class FragC>
__device__ __forceinline__ void qk_pieces(int tid, typename T::Element* q_smem, typename T::Element* k_smem,
                                          FragC& tSrS, TmaBarrier* full, uint32_t parity) {
  constexpr int stage = kStage;
  typename T::TiledMmaQK mma;
  auto thr = mma.get_slice(tid);
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  auto one_piece = [&](auto piece_c) CUTLASS_LAMBDA_FUNC_INLINE {
    constexpr int j = decltype(piece_c)::value;
    wait_kv_piece(full[j], parity, stage, j);
    const uint32_t z = opaque_zero();
    Tensor sQ = make_tensor(make_smem_ptr(q_smem + z), typename T::SmemLayoutQK{});  // (64, 576)
    Tensor sK = make_tensor(make_smem_ptr(k_smem + z), typename T::SmemLayoutKV{});  // (64, 576)
    Tensor tSrQ = thr.partition_fragment_A(sQ);  // (MMA, 1, 36) descriptors
    Tensor tSrK = thr.partition_fragment_B(sK);  // (MMA, 1, 36)
    CUTLASS_PRAGMA_UNROLL
    for (int kb = 0; kb < kPieceCols / 16; ++kb) {
      cute::gemm(mma, tSrQ(_, _, j * (kPieceCols / 16) + kb), tSrK(_, _, j * (kPieceCols / 16) + kb), tSrS);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
  };
  warpgroup_fence_operand(tSrS);
  warpgroup_arrive();
  (one_piece(Int<kPieces>{}), ...);
  warpgroup_commit_batch();
  warpgroup_fence_operand(tSrS);
}

// S = Q K1^T of a stage-1 block (warpgroup 1). Its pieces 4..7 are refilled earliest (by this warpgroup), so
// they go first; the order is the same for every block (determinism).
template <class T, class FragC>
__device__ __forceinline__ void qk_stage1(int tid, typename T::Element* q_smem, typename T::Element* k_smem,
                                          FragC& tSrS, TmaBarrier* full, uint32_t parity) {
  qk_pieces<T, 1, true, 4, 5, 6, 7, 0, 1, 2, 3, 8>(tid, q_smem, k_smem, tSrS, full, parity);
}

// O_half += P V_half over the 64 keys of a block (4 k-blocks of 16), one commit group.
// V_half = value columns [kHalf * 256, kHalf * 256 + 256) of the KV block at kv_smem.
// P from registers (A fragment of TiledMmaPVReg).
template <class T, int kHalf, class FragP, class FragO>
__device__ __forceinline__ void pv_gemm_reg(int tid, FragP& tOrP, typename T::Element* kv_smem, FragO& tOrO) {
  typename T::TiledMmaPVReg mma;
  auto thr = mma.get_slice(tid);
  const uint32_t z = opaque_zero();
  Tensor sVt = make_tensor(make_smem_ptr(kv_smem + z), typename T::SmemLayoutVt{});  // (512, 64)
  Tensor sV = local_tile(sVt, Shape<Int<kHalfDimV>, Int<kBlockN>>{}, make_coord(Int<kHalf>{}, _0{}));  // (256, 64)
  Tensor tOrV = thr.partition_fragment_B(sV);  // (MMA, 1, 4)
  mma.accumulate_ = GMMA::ScaleOut::One;
  warpgroup_fence_operand(tOrP);
  warpgroup_fence_operand(tOrO);
  warpgroup_arrive();
  CUTLASS_PRAGMA_UNROLL
  for (int kb = 0; kb < size<2>(tOrV); ++kb) cute::gemm(mma, tOrP(_, _, kb), tOrV(_, _, kb), tOrO);
  warpgroup_commit_batch();
  warpgroup_fence_operand(tOrO);
  warpgroup_fence_operand(tOrP);
}

// Same with P (64 x 64, K-major 128B swizzle) read from shared memory at p_smem.
template <class T, int kHalf, class FragO>
__device__ __forceinline__ void pv_gemm_smem(int tid, typename T::Element* p_smem, typename T::Element* kv_smem,
                                             FragO& tOrO) {
  typename T::TiledMmaPVSmem mma;
  auto thr = mma.get_slice(tid);
  const uint32_t z = opaque_zero();
  Tensor sP = make_tensor(make_smem_ptr(p_smem + z), typename T::SmemLayoutP{});     // (64, 64)
  Tensor sVt = make_tensor(make_smem_ptr(kv_smem + z), typename T::SmemLayoutVt{});  // (512, 64)
  Tensor sV = local_tile(sVt, Shape<Int<kHalfDimV>, Int<kBlockN>>{}, make_coord(Int<kHalf>{}, _0{}));  // (256, 64)
  Tensor tOsP = thr.partition_fragment_A(sP);  // (MMA, 1, 4)
  Tensor tOrV = thr.partition_fragment_B(sV);  // (MMA, 1, 4)
  mma.accumulate_ = GMMA::ScaleOut::One;
  warpgroup_fence_operand(tOrO);
  warpgroup_arrive();
  CUTLASS_PRAGMA_UNROLL
  for (int kb = 0; kb < size<2>(tOrV); ++kb) cute::gemm(mma, tOsP(_, _, kb), tOrV(_, _, kb), tOrO);
  warpgroup_commit_batch();
  warpgroup_fence_operand(tOrO);
}

// ------------------------------------------------------------------------------------------------
// The step over blocks (b0, b0 + 1) is specialized at compile time on which blocks exist
// (kHas1: block b0 + 1; kNext0 / kNext1: blocks b0 + 2 / b0 + 3), so that no wgmma sits inside a
// run-time branch (ptxas serializes every wgmma of the kernel when an accumulator is merged from
// two paths). Both warpgroups run the same sequence of steps (checks/protocol_model.py mirrors it).
// ------------------------------------------------------------------------------------------------
template <class StepFn>
__device__ __forceinline__ void run_steps(int nblk, StepFn&& step) {
  using TT = cute::true_type;
  using FF = cute::false_type;
  int b0 = 0;
  CUTLASS_PRAGMA_NO_UNROLL
  for (; b0 + 4 <= nblk; b0 += 2) step(TT{}, TT{}, TT{}, b0);
  const int remaining = nblk - b0;  // 1, 2 or 3 when nblk >= 1
  if (remaining == 3) {
    step(TT{}, TT{}, FF{}, b0);
    step(FF{}, FF{}, FF{}, b0 + 2);
  } else if (remaining == 2) {
    step(TT{}, FF{}, FF{}, b0);
  } else {
    step(FF{}, FF{}, FF{}, b0);
  }
}

// ------------------------------------------------------------------------------------------------
// Warpgroup 0: Q K0^T, softmax of block 0 (decides m0), O_L += P0 V0L + P1 V1L.
// ------------------------------------------------------------------------------------------------
template <class T, class FragO>
__device__ __forceinline__ void mainloop_wg0(typename T::SharedStorage& ss, const DecodeParams& p,
                                             const CUtensorMap* tmap, const RequestPiece& w, const RowInfo& ri,
                                             int hk, int tid, FragO& tOrO, float (&row_sum)[2],
                                             uint32_t& parity0) {
  using Element = typename T::Element;
  const int lane = tid & 31;
  const int nblk = w.num_blocks;
  if (nblk == 0) return;

  Element* const q_smem = ss.q.data();
  Element* const kv0_smem = ss.kv[0].data();
  Element* const kv1_smem = ss.kv[1].data();
  Element* const p0_smem = kv0_smem + kRopePiece * kPieceElems;  // P0 tile (written here)
  Element* const p1_smem = kv1_smem + kRopePiece * kPieceElems;  // P1 tile (from warpgroup 1)
  uint8_t* const stage0 = reinterpret_cast<uint8_t*>(kv0_smem);
  uint8_t* const stage1 = reinterpret_cast<uint8_t*>(kv1_smem);

  typename T::TiledMmaQK mma_qk;
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});  // ((2,2,8),1,1) fp32
  // P0 as the A operand of P V ((2,2,2),1,4) and, same registers, in the accumulator layout for stmatrix.
  typename T::TiledMmaPVReg mma_pv_reg;
  Tensor tOrP0 = make_tensor<Element>(partition_shape_A(mma_pv_reg, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor rP0 = make_tensor(tOrP0.data(), tSrS.layout());
  static_assert(size(decltype(tOrP0){}) == size(decltype(tSrS){}), "P fragment = S fragment");

  auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_qk);
  auto thr_r2s = r2s.get_slice(tid);
  Tensor tPsP0 = thr_r2s.partition_D(make_tensor(make_smem_ptr(p0_smem), typename T::SmemLayoutP{}));

  TmaBarrier* full0 = ss.kv_full[0];
  TmaBarrier* full1 = ss.kv_full[1];
  const float sl2 = p.scale_log2;

  // S = Q K0^T for block 0.
  qk_pieces<T, 0, true, 0, 1, 2, 3, 4, 5, 6, 7, 8>(tid, q_smem, kv0_smem, tSrS, full0, parity0);
  parity0 ^= 1u;
  warpgroup_wait<0>();
  warpgroup_fence_operand(tSrS);

  auto step = [&](auto has1_c, auto next0_c, auto next1_c, int b0) CUTLASS_LAMBDA_FUNC_INLINE {
    constexpr bool kHas1 = decltype(has1_c)::value;
    constexpr bool kNext0 = decltype(next0_c)::value;
    constexpr bool kNext1 = decltype(next1_c)::value;
    static_assert(kHas1 || !kNext0, "next block of stage 0 implies block 1");
    static_assert(kNext0 || !kNext1, "next block of stage 1 implies next of stage 0");
    const int tok0 = (w.first_page + b0) * kBlockN;  // first key of block b0
    // Pages of the blocks this step refills, read early (the TMA issue would otherwise wait on them).
    const int page_next0 = kNext0 && tid == 0 ? block_page(p, w, b0 + 2) : 0;
    const int page_next1 = kNext1 && tid == 0 ? block_page(p, w, b0 + 3) : 0;

    // ---- softmax of block 0: m0 = max(m, rowmax(S0)), P0 = exp2(S0 scale - m0) (fp32, kept in tSrS) ----
    if (tok0 < w.start || tok0 + kBlockN > w.min_row_end) mask_scores(tSrS, tok0, w.start, ri.row_end, lane);
    float mx[2], m_new[2], m_use[2], sc0[2], sum[2];
    row_max_quad(tSrS, mx);
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) update_max(ss.row_max[ri.row[v]], mx[v], sl2, m_new[v], m_use[v], sc0[v]);
    __syncwarp();  // all four lanes of a row read row_max before one of them overwrites it
    if ((lane & 3) == 0) {
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < 2; ++v) {
        ss.row_max[ri.row[v]] = m_new[v];
        ss.scale0[ri.row[v]] = sc0[v];
      }
    }
    NamedBarrier::arrive(kNumThreads, uint32_t(NamedBarriers::kScale0Ready));
    exp2_rows(tSrS, sl2, m_use, sum);
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) row_sum[v] = row_sum[v] * sc0[v] + sum[v];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tSrS); ++i) rP0(i) = static_cast<Element>(tSrS(i));

    // ---- O_L = O_L * scale0 + P0 V0L ----
    scale_rows(tOrO, sc0);
    if (b0 == w.num_blocks - 1 && tok0 + kBlockN > w.stop_eff) {
      zero_v_rows(stage0, 0, w.stop_eff - tok0, tid);
      NamedBarrier::sync(kThreadsPerWarpGroup, uint32_t(NamedBarriers::kWG0Local));
    }
    pv_gemm_reg<T, 0>(tid, tOrP0, kv0_smem, tOrO);

    // ---- warpgroup 1 decided m1 and stored P1. P0 * scale1 (P0 in m1's frame) -> stage 0's rope piece for
    // warpgroup 1's P0 V0R; then O_L = O_L * scale1 + P1 V1L ----
    NamedBarrier::sync(kNumThreads, uint32_t(NamedBarriers::kScale1Ready));
    float sc1[2];
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) sc1[v] = ss.scale1[ri.row[v]];
    warpgroup_wait<0>();  // P0 V0L done: stage 0's left pieces and the P0 registers are free
    warpgroup_fence_operand(tOrO);
    warpgroup_fence_operand(tOrP0);
    if constexpr (kNext0) {
      if (tid == 0) refill_kv_pieces<T, kRefillMask[0][0]>(tmap, full0, stage0, page_next0, hk);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tSrS); ++i) rP0(i) = static_cast<Element>(tSrS(i) * sc1[(i >> 1) & 1]);
    cute::copy(r2s, thr_r2s.retile_S(rP0), tPsP0);
    cutlass::arch::fence_view_async_shared();
    NamedBarrier::arrive(kNumThreads, uint32_t(NamedBarriers::kP0Ready));
    scale_rows(tOrO, sc1);
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) row_sum[v] *= sc1[v];
    if constexpr (kHas1) {
      if (b0 + 1 == w.num_blocks - 1 && tok0 + 2 * kBlockN > w.stop_eff) {
        zero_v_rows(stage1, 0, w.stop_eff - tok0 - kBlockN, tid);
        NamedBarrier::sync(kThreadsPerWarpGroup, uint32_t(NamedBarriers::kWG0Local));
      }
      pv_gemm_smem<T, 0>(tid, p1_smem, kv1_smem, tOrO);
    }

    // ---- next S = Q K0^T (block b0 + 2); release stage 1's left pieces + P1 piece in between ----
    if constexpr (kNext0) {
      qk_pieces<T, 0, true, 0, 1, 2, 3>(tid, q_smem, kv0_smem, tSrS, full0, parity0);
      warpgroup_wait<1>();  // P1 V1L done
      if constexpr (kNext1) {
        if (tid == 0) refill_kv_pieces<T, kRefillMask[1][0]>(tmap, full1, stage1, page_next1, hk);
      }
      qk_pieces<T, 0, false, 4, 5, 6, 7, 8>(tid, q_smem, kv0_smem, tSrS, full0, parity0);
      parity0 ^= 1u;
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    warpgroup_fence_operand(tSrS);
  };
  run_steps(nblk, step);
}

// ------------------------------------------------------------------------------------------------
// Warpgroup 1: Q K1^T, softmax of block 1 (decides m1), O_R = O_R * scale0 * scale1 + P1 V1R + (P0 scale1) V0R.
// ------------------------------------------------------------------------------------------------
template <class T, class FragO>
__device__ __forceinline__ void mainloop_wg1(typename T::SharedStorage& ss, const DecodeParams& p,
                                             const CUtensorMap* tmap, const RequestPiece& w, const RowInfo& ri,
                                             int hk, int tid, FragO& tOrO, float (&row_sum)[2],
                                             uint32_t& parity1) {
  using Element = typename T::Element;
  const int lane = tid & 31;
  const int nblk = w.num_blocks;
  if (nblk == 0) return;

  Element* const q_smem = ss.q.data();
  Element* const kv0_smem = ss.kv[0].data();
  Element* const kv1_smem = ss.kv[1].data();
  Element* const p0_smem = kv0_smem + kRopePiece * kPieceElems;  // P0 tile (from warpgroup 0)
  Element* const p1_smem = kv1_smem + kRopePiece * kPieceElems;  // P1 tile (written here)
  uint8_t* const stage0 = reinterpret_cast<uint8_t*>(kv0_smem);
  uint8_t* const stage1 = reinterpret_cast<uint8_t*>(kv1_smem);

  typename T::TiledMmaQK mma_qk;
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});  // ((2,2,8),1,1) fp32
  typename T::TiledMmaPVReg mma_pv_reg;
  Tensor tOrP1 = make_tensor<Element>(partition_shape_A(mma_pv_reg, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor rP1 = make_tensor(tOrP1.data(), tSrS.layout());

  auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_qk);
  auto thr_r2s = r2s.get_slice(tid);
  Tensor tPsP1 = thr_r2s.partition_D(make_tensor(make_smem_ptr(p1_smem), typename T::SmemLayoutP{}));

  TmaBarrier* full0 = ss.kv_full[0];
  TmaBarrier* full1 = ss.kv_full[1];
  const float sl2 = p.scale_log2;

  auto step = [&](auto has1_c, auto next0_c, auto next1_c, int b0) CUTLASS_LAMBDA_FUNC_INLINE {
    constexpr bool kHas1 = decltype(has1_c)::value;
    constexpr bool kNext0 = decltype(next0_c)::value;
    constexpr bool kNext1 = decltype(next1_c)::value;
    const int tok1 = (w.first_page + b0 + 1) * kBlockN;  // first key of block b0 + 1
    const int page_next0 = kNext0 && tid == 0 ? block_page(p, w, b0 + 2) : 0;
    const int page_next1 = kNext1 && tid == 0 ? block_page(p, w, b0 + 3) : 0;

    // ---- row max of block 1 (independent of warpgroup 0) ----
    float mx[2] = {-INFINITY, -INFINITY};
    if constexpr (kHas1) {
      if (tok1 + kBlockN > w.min_row_end) mask_scores(tSrS, tok1, w.start, ri.row_end, lane);
      row_max_quad(tSrS, mx);
    }

    // ---- softmax of block 1 against m0: m1 = max(m0, rowmax(S1)); P1 -> stage 1's rope piece ----
    NamedBarrier::sync(kNumThreads, uint32_t(NamedBarriers::kScale0Ready));
    float m0[2], sc0[2];
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) {
      m0[v] = ss.row_max[ri.row[v]];
      sc0[v] = ss.scale0[ri.row[v]];
    }
    float m_new[2], m_use[2], sc1[2], sum[2] = {0.f, 0.f};
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) update_max(m0[v], mx[v], sl2, m_new[v], m_use[v], sc1[v]);
    __syncwarp();  // all four lanes of a row read row_max before one of them overwrites it
    if ((lane & 3) == 0) {  // warpgroup 0 does not touch row_max / scale1 until kScale1Ready
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < 2; ++v) {
        ss.row_max[ri.row[v]] = m_new[v];
        ss.scale1[ri.row[v]] = sc1[v];
      }
    }
    if constexpr (kHas1) {
      exp2_rows(tSrS, sl2, m_use, sum);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tSrS); ++i) rP1(i) = static_cast<Element>(tSrS(i));
      cute::copy(r2s, thr_r2s.retile_S(rP1), tPsP1);
      cutlass::arch::fence_view_async_shared();
    }
    NamedBarrier::arrive(kNumThreads, uint32_t(NamedBarriers::kScale1Ready));
    float sc01[2];
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) {
      sc01[v] = sc0[v] * sc1[v];
      row_sum[v] = row_sum[v] * sc01[v] + sum[v];
    }

    // ---- O_R = O_R * scale0 * scale1 + P1 V1R + (P0 scale1) V0R, both products issued back to back ----
    scale_rows(tOrO, sc01);
    if constexpr (kHas1) {
      if (b0 + 1 == w.num_blocks - 1 && tok1 + kBlockN > w.stop_eff) {
        zero_v_rows(stage1, kVPiecesPerWarpGroup, w.stop_eff - tok1, tid);
        NamedBarrier::sync(kThreadsPerWarpGroup, uint32_t(NamedBarriers::kWG1Local));
      }
      pv_gemm_reg<T, 1>(tid, tOrP1, kv1_smem, tOrO);
    }
    if (b0 == w.num_blocks - 1 && tok1 > w.stop_eff) {  // tok1 - kBlockN = first key of block b0
      zero_v_rows(stage0, kVPiecesPerWarpGroup, w.stop_eff - (tok1 - kBlockN), tid);
      NamedBarrier::sync(kThreadsPerWarpGroup, uint32_t(NamedBarriers::kWG1Local));
    }
    NamedBarrier::sync(kNumThreads, uint32_t(NamedBarriers::kP0Ready));  // P0 scale1 in stage 0's rope piece
    pv_gemm_smem<T, 1>(tid, p0_smem, kv0_smem, tOrO);

    // ---- P1 V1R done: stage 1's right pieces are free; P0 V0R done: stage 0's right pieces + P0 piece ----
    if constexpr (kHas1) {
      warpgroup_wait<1>();
      warpgroup_fence_operand(tOrP1);
      if constexpr (kNext1) {
        if (tid == 0) refill_kv_pieces<T, kRefillMask[1][1]>(tmap, full1, stage1, page_next1, hk);
      }
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    if constexpr (kNext0) {
      if (tid == 0) refill_kv_pieces<T, kRefillMask[0][1]>(tmap, full0, stage0, page_next0, hk);
    }

    // ---- next S = Q K1^T (block b0 + 3) ----
    if constexpr (kNext1) {
      qk_stage1<T>(tid, q_smem, kv1_smem, tSrS, full1, parity1);
      parity1 ^= 1u;
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
    }
  };

  if (nblk == 1) {
    step(cute::false_type{}, cute::false_type{}, cute::false_type{}, 0);
    return;
  }
  // S = Q K1^T for block 1. Stage 1's pieces 4..7 are refilled by this warpgroup (earliest), so they go
  // first; the order is the same for every block (determinism).
  qk_stage1<T>(tid, q_smem, kv1_smem, tSrS, full1, parity1);
  parity1 ^= 1u;
  warpgroup_wait<0>();
  warpgroup_fence_operand(tSrS);
  run_steps(nblk, step);
}

}  // namespace flashmla_backend::sm90::decode
