// Consumer warpgroup 1 of the accurate mode (Traits::kPvF16): Q K^T on e4m3 wgmma (two q terms), P V on fp16 wgmma
// with P in fp16 and V widened to fp16 by the producer (producer.cuh: widen_pair). Warpgroup 0 runs mainloop.cuh's
// mainloop_wg0, which hands P0 over unscaled in this mode.
//
// The seesaw of mainloop.cuh with one change of order. A fp16 V half is 32 KB, so each consumer warpgroup has a
// ring of one (traits.h: the shared-memory plan), and with a ring of one the producer can widen a block's half
// only after the warpgroup's P V of the previous block's half completed. Warpgroup 1 therefore reads its halves in
// block order too: O_R = (O_R sc0 sc1 + (P0 sc1) V0R) + P1 V1R, with P0 handed over unscaled right after
// warpgroup 0's softmax and multiplied by sc1 here (only where a row's max moved). In the order of mainloop.cuh
// (P1 V1R first) the right half of block b0 would be widened only after P1 V1R, and the KV stage of b0 would stay
// held until then, a step too late for the copy of block b0 + 2.
#pragma once

#include <cuda_fp16.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include <cstdint>

#include "sm90/decode/softmax.cuh"
#include "sm90/decode/tile_work.cuh"
#include "sm90/decode_fp8/config.h"
#include "sm90/decode_fp8/mainloop.cuh"
#include "sm90/decode_fp8/producer.cuh"
#include "sm90/decode_fp8/traits.h"

namespace flashmla_backend::sm90::decode_fp8 {

// The fragment's rows times f (word k: row k & 1), in fp32 and rounded back to fp16.
__device__ __forceinline__ void scale_p16(uint32_t (&words)[16], const float (&f)[2]) {
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < 16; ++k) {
    const float2 x = __half22float2(*reinterpret_cast<const __half2*>(&words[k]));
    const __half2 h = __floats2half2_rn(x.x * f[k & 1], x.y * f[k & 1]);
    words[k] = *reinterpret_cast<const uint32_t*>(&h);
  }
}

// ------------------------------------------------------------------------------------------------
// Warpgroup 1: Q K1^T, softmax of block 1 (decides m1), P1 -> p[1], O_R = O_R sc0 sc1 + (P0 sc1) V0R + P1 V1R.
// ------------------------------------------------------------------------------------------------
template <class T, class FragO>
__device__ __forceinline__ void mainloop_f16pv_wg1(typename T::SharedStorage& ss, const RequestPiece& w,
                                                   const RowInfo& ri, int tid, uint32_t g_base, FragO& tOrO,
                                                   float (&row_sum)[2]) {
  static_assert(T::kPvF16, "the fp16 P V mode");
  const int lane = tid & 31;
  const int nblk = padded_blocks(w.num_blocks);
  if (nblk == 0) {
    clear(tOrO);
    return;
  }

  typename T::TiledMmaQK mma_qk;
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
  PFrag<T> P;

  auto step = [&](auto next_c, int b0) CUTLASS_LAMBDA_FUNC_INLINE {
    constexpr bool kNext = decltype(next_c)::value;  // blocks b0 + 2 and b0 + 3 exist
    const uint32_t g0 = g_base + uint32_t(b0);
    const int tok1 = (w.first_page + b0 + 1) * kBlockN;
    const float sl2[2] = {ss.row_scale_log2[ri.row[0]], ss.row_scale_log2[ri.row[1]]};

    // ---- softmax of block 1 against m0: m1 = max(m0, rowmax S1); P1 -> p[1] ----
    float sc1[2], sc01[2];
    fold_stacked_terms<T>(tSrS);
    const auto store_p1 = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
      uint32_t words[16];
      p16_fragment<T::kStackedTerms>(tSrS, words);
      store_p(ss.p[1], tid, words);
    };
    softmax_block1<T::kStackedTerms>(ss, w, ri, lane, tok1, sl2, tSrS, row_sum, sc1, sc01, store_p1);

    // ---- O_R = O_R sc0 sc1 + (P0 sc1) V0R ----
    rescale_o(tOrO, sc01);
    NamedBarrier::sync(kNumConsumerThreads, uint32_t(NamedBarriers::kP0Ready));
    {
      uint32_t words[16];
      load_p(ss.p[0], tid, words);
      if constexpr (kNext) NamedBarrier::arrive(kNumConsumerThreads, uint32_t(NamedBarriers::kP0Free));
      if (__any_sync(0xffffffffu, sc1[0] != 1.f || sc1[1] != 1.f)) scale_p16(words, sc1);
      P.set(words);
    }
    wait_vt<T, 1>(ss, g0);
    pv_block<T, 1>(tid, ss, g0, P, tOrO);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    release_vt<T, 1>(ss, g0, lane);

    // ---- O_R += P1 V1R (P1 back from p[1]: two fragments at once would cost 16 more registers); next S = Q K1^T
    // (block b0 + 3) ----
    {
      uint32_t words[16];
      load_p(ss.p[1], tid, words);
      P.set(words);
    }
    wait_vt<T, 1>(ss, g0 + 1);
    pv_block<T, 1>(tid, ss, g0 + 1, P, tOrO);
    if constexpr (kNext) qk_block<T>(tid, ss, g0 + 3, tSrS);
    warpgroup_wait<kNext ? 1 : 0>();
    warpgroup_fence_operand(tOrO);
    release_vt<T, 1>(ss, g0 + 1, lane);
    if constexpr (kNext) {
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
      release_kv_stage<T>(ss, int(stage_of(g0 + 3, T::kStages)), lane);
    }
  };

  qk_block<T>(tid, ss, g_base + 1, tSrS);
  warpgroup_wait<0>();
  warpgroup_fence_operand(tSrS);
  clear(tOrO);
  release_kv_stage<T>(ss, int(stage_of(g_base + 1, T::kStages)), lane);
  run_steps(nblk, step);
}

}  // namespace flashmla_backend::sm90::decode_fp8
