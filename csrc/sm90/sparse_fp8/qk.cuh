// Q K^T of one gathered block of the sm90 sparse (DeepSeek-V3.2) decode kernel, without dequantizing the cache: the
// latent part per 128-channel group on e4m3 wgmma into a fresh accumulator, added into S times each token's group
// scale, and the rope part on bf16 wgmma. One consumer warpgroup; operands in shared memory in the layouts of
// layout.h (the gathered stage) and of the Q tile below. checks/block_probe.cu runs it on a GPU against fp64.
//
// The Q tile (built by the caller, see checks/block_probe.cu: build_q_tile):
//   latent  kQTerms e4m3 terms of 64 rows x 512, each in the latent layout of a stage (eight SW64 pieces): q's latent
//           part divided by the row's power-of-two split scale s_r, term 0 = e4m3(q / s_r), term 1 = e4m3(q / s_r -
//           term 0) (docs/perf/journal.md: the sparse kernel needs two terms to reach FlashMLA's error);
//   rope    64 rows x 64 bf16 of q's rope part divided by s_r (exact: a power of two), K-major SW128.
// With Q' = q / s_r, the score of row r and token t is s_r (sum_g scale[t][g] Q'_g K_g^T + Q'_pe K_pe^T).
// sparse_qk_block returns the bracket; the caller folds s_r into the row's softmax scale, as the dense kernel's
// accurate mode folds its q split scale (decode_fp8/q_tile.cuh).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/bfloat16.h>
#include <cutlass/cutlass.h>
#include <cutlass/float8.h>

#include <cstdint>

#include "sm90/sparse_fp8/layout.h"

namespace flashmla_backend::sm90::sparse_fp8 {

using namespace cute;

struct QkTypes {
  using F8 = cutlass::float_e4m3_t;
  using BF = cutlass::bfloat16_t;
  // S_g = Q_g K_g^T: (64 rows, 64 tokens), k32 steps, both operands K-major in shared memory.
  using TiledMmaLatent = decltype(make_tiled_mma(
      GMMA::ss_op_selector<F8, F8, float, Shape<Int<64>, Int<kBlockTokens>, Int<128>>, GMMA::Major::K,
                           GMMA::Major::K>()));
  // S += Q_pe K_pe^T: k16 steps of bf16.
  using TiledMmaRope = decltype(make_tiled_mma(
      GMMA::ss_op_selector<BF, BF, float, Shape<Int<64>, Int<kBlockTokens>, Int<64>>, GMMA::Major::K,
                           GMMA::Major::K>()));
  // A stage's latent region, or one latent term of the Q tile (64 rows x 512 e4m3).
  using LatentLayout = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<F8>{}, Shape<Int<64>, Int<512>>{}));
  // A stage's rope region, or the Q tile's rope (64 rows x 64 bf16).
  using RopeLayout = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<BF>{}, Shape<Int<64>, Int<64>>{}));
  static_assert(cosize_v<LatentLayout> == kLatentBytes, "latent region size");
  static_assert(cosize_v<RopeLayout> * 2 == kRopeBytes, "rope region size");
};

// The group g of a 128-channel latent group is k32 steps 4 g .. 4 g + 3 of the latent tiles.
constexpr int kKStepsPerGroup = 128 / 32;

// The steps of a block's Q K^T (sparse_qk_block below, and lead.cuh's overlapped order, which puts the block before's
// softmax and P V between them): qk_issue_rope, then qk_issue_group for groups 0..3 and qk_fold_group for each once
// its commit group was waited for. Each issue is one commit group.
template <class FragS>
__device__ __forceinline__ void qk_issue_rope(int tid, uint8_t* q_rope, uint8_t* stage, FragS& tSrS) {
  using BF = QkTypes::BF;
  typename QkTypes::TiledMmaRope mma_r;
  auto thr_r = mma_r.get_slice(tid);
  Tensor sQr = make_tensor(make_smem_ptr(reinterpret_cast<BF*>(q_rope)), typename QkTypes::RopeLayout{});
  Tensor sKr = make_tensor(make_smem_ptr(reinterpret_cast<BF*>(stage + kRopeAt)), typename QkTypes::RopeLayout{});
  Tensor tQr = thr_r.partition_fragment_A(sQr);
  Tensor tKr = thr_r.partition_fragment_B(sKr);
  mma_r.accumulate_ = GMMA::ScaleOut::Zero;
  warpgroup_fence_operand(tSrS);
  warpgroup_arrive();
  CUTLASS_PRAGMA_UNROLL
  for (int kb = 0; kb < 4; ++kb) {
    cute::gemm(mma_r, tQr(_, _, kb), tKr(_, _, kb), tSrS);
    mma_r.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(tSrS);
}
// t = S_g (the group's latent product, both q terms), one commit group.
template <int kQTerms, class FragS>
__device__ __forceinline__ void qk_issue_group(int tid, uint8_t* q_latent, uint8_t* stage, int g, FragS& t) {
  static_assert(kQTerms == 1 || kQTerms == 2, "one or two e4m3 terms of q");
  using F8 = QkTypes::F8;
  typename QkTypes::TiledMmaLatent mma_l;
  auto thr_l = mma_l.get_slice(tid);
  Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<F8*>(stage)), typename QkTypes::LatentLayout{});
  Tensor tKl = thr_l.partition_fragment_B(sK);
  mma_l.accumulate_ = GMMA::ScaleOut::Zero;
  warpgroup_fence_operand(t);
  warpgroup_arrive();
  CUTLASS_PRAGMA_UNROLL
  for (int q = 0; q < kQTerms; ++q) {
    Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<F8*>(q_latent + q * kLatentBytes)),
                            typename QkTypes::LatentLayout{});
    Tensor tQl = thr_l.partition_fragment_A(sQ);
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kKStepsPerGroup; ++k) {
      cute::gemm(mma_l, tQl(_, _, kKStepsPerGroup * g + k), tKl(_, _, kKStepsPerGroup * g + k), t);
      mma_l.accumulate_ = GMMA::ScaleOut::One;
    }
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(t);
}
// S += t s[token, g], after t's commit group was waited for.
template <class FragS>
__device__ __forceinline__ void qk_fold_group(int tid, const uint8_t* stage, int g, FragS& t, FragS& tSrS) {
  const float* scales = reinterpret_cast<const float*>(stage + kScalesAt);
  const int lane = tid & 31;
  warpgroup_fence_operand(t);
  warpgroup_fence_operand(tSrS);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(tSrS); ++i) {
    const int token = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
    tSrS(i) = fmaf(t(i), scales[token * kGroups + g], tSrS(i));
  }
}

// S (64 x 64 fp32 accumulator fragment of thread `tid`, 0..127 in the warpgroup) = the block's scores without the
// row's split scale (header). q_latent: term t at q_latent + t * kLatentBytes; stage: the gathered block (layout.h),
// whose scales are read here. The rope product goes into S first; then S_g of two groups at a time into the two
// temporaries, and each added into S with 32 FFMA by the token's scale of group g (16 distinct tokens a thread:
// accumulator element i is token 8 (i >> 2) + 2 (lane % 4) + (i & 1)) once it is waited for, so that group 2 j + 1's
// product runs under group 2 j's FFMAs. The operations are the one-temporary form's, in the same order (rope, then
// groups 0..3; the GPU tests' worst errors are the earlier builds'). The pair loop is rolled, one copy of a pair's
// code (a rolled group loop measured 10% faster at b = 1 h_q 128 and 2-5% at b32, b64 and top-k 512 than the unrolled
// one; docs/perf/journal.md). The tensor cores drain between the two pairs (the next pair is issued after both folds);
// the unrolled order that issues group g + 2 right after group g's fold, so that a product is always queued, was
// measured level at b = 1 and 0.3-3% slower at the table's other shapes (journal, 2026-12-02): the pair's
// gap is not on the path.
template <int kQTerms, class FragS>
__device__ __forceinline__ void sparse_qk_block(int tid, uint8_t* q_latent, uint8_t* q_rope, uint8_t* stage,
                                                FragS& tSrS, FragS& tmp0, FragS& tmp1) {
  static_assert(kGroups % 2 == 0, "groups in pairs");
  qk_issue_rope(tid, q_rope, stage, tSrS);
#pragma unroll 1
  for (int g = 0; g < kGroups; g += 2) {
    qk_issue_group<kQTerms>(tid, q_latent, stage, g, tmp0);
    qk_issue_group<kQTerms>(tid, q_latent, stage, g + 1, tmp1);
    warpgroup_wait<1>();  // group g (and, at the first pair, the rope product and what the caller committed)
    qk_fold_group(tid, stage, g, tmp0, tSrS);
    warpgroup_wait<0>();
    qk_fold_group(tid, stage, g + 1, tmp1, tSrS);
  }
}

}  // namespace flashmla_backend::sm90::sparse_fp8
