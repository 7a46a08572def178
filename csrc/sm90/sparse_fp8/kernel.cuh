// sm90 sparse (DeepSeek-V3.2) decode kernel on fp8_ds_mla tokens: Q K^T and P V on e4m3 wgmma with the tokens'
// group scales folded into the scores and into P, never dequantizing the cache (docs/perf/journal.md: the design,
// the precision model and the probes that measured its arithmetic).
//
// Work: params.h's sparse mapping. A "request" is one query token's index row; the tile scheduler's metadata (every
// row at top-k entries) gives each CTA column `part` a run of rows, the first and last possibly in pieces of 64-entry
// blocks, and the combine kernel merges the pieces. grid = (ceil(h_q / 64), 1, num_sm_parts): CTA (m, 0, part)
// computes heads [64 m, 64 m + 64) of its rows. One CTA per SM, 384 threads:
//   warpgroup 2 (producer): warps 0 and 1 gather each block of 64 indexed tokens into a stage, 32 tokens each
//     (gather.cuh: cp.async, the entries that name no token zero-filled and left out of the block's mask); warps 2
//     and 3 transpose the stage's latent part into V^T, half 0 (groups 0, 1) then half 1 (groups 2, 3), each warp
//     half of each half (pv.cuh), one slot a half.
//   warpgroups 0 and 1 (consumers): the four latent groups' output columns (128 each) are split one and three:
//     warpgroup 0 computes every block's whole scores and the softmax, hands P to warpgroup 1 in fp16, and multiplies
//     P by V for group 0; warpgroup 1 does so for groups 1, 2 and 3 (lead.cuh). Each group's P V takes two e4m3 terms
//     of P s[t, g] under a group factor that only goes down (pv.cuh); the transposer warps make each block's group
//     factors and the words' s F pairs once (common.cuh: block_group_factors).
// The epilogue (common.cuh: store_group, store_lse) writes out = O_g / (F_g l) and lse, or a split's fp32 partials for
// the combine.
#pragma once

#include "common/measure.h"
#include "sm90/sparse_fp8/common.cuh"
#include "sm90/sparse_fp8/lead.cuh"

namespace flashmla_backend::sm90::sparse_fp8 {

constexpr int kSmemBytes = int(sizeof(LeadStorage)) + 1024;

__global__ void __launch_bounds__(kNumThreads, 1)
    sm90_sparse_fp8_decode_kernel(const __grid_constant__ DecodeParams params, int debug_arg) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using SS = LeadStorage;
#if defined(FMLA_SPARSE_TIMELINE)
  const long long tl_start = clock64();  // timeline.cuh
  const unsigned long long tl_start_ns = global_timer_ns();
#endif
  const DecodeParams& p = params;
  const int debug = kMeasureBuild ? debug_arg : 0;  // common/measure.h
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = cute::cast_smem_ptr_to_uint(smem_raw);
  SS& ss = *reinterpret_cast<SS*>(smem_raw + ((1024 - (raw_addr % 1024)) % 1024));

  const int m_block = blockIdx.x;
  const int part = blockIdx.z;
  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid / kWgThreads, 0);
  const int lane = tid & 31;

  pdl_wait_primary();
  decode::CtaRequests cta;
  if (!decode::cta_requests(p, part, cta)) return;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      ss.full[s].init(kFullArrivals);
      ss.empty[s].init(kLeadEmptyArrivals);
    }
    for (int c = 0; c < kPSlots; ++c) {
      ss.p_full[c].init(kPSlotArrivals);
      ss.p_empty[c].init(kPSlotArrivals);
    }
    for (int v = 0; v < LeadStorage::kVtSlots; ++v) {
      ss.vt_full[v].init(kVtFullArrivals);
      ss.vt_empty[v].init(kVtEmptyArrivals);
    }
    ss.qk_issued[0].init(kQkIssuedArrivals);
    ss.qk_issued[1].init(kQkIssuedArrivals);
#if defined(FMLA_SPARSE_TIMELINE)
    tl_init(ss.tl, tl_start, tl_start_ns);
#endif
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  FMLA_TL(ss, tid / kWgThreads, kTlStart, tid == 0 || tid == kWgThreads);
  FMLA_TL(ss, kTlGather, kTlStart, tid == kNumConsumerThreads);
  FMLA_TL(ss, kTlTranspose, kTlStart, tid == kNumConsumerThreads + 32 * kGatherWarps);

  if (wg == 2) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    const int warp = (tid - kNumConsumerThreads) / 32;
    if (warp < kGatherWarps) {
      gather_warp(p, ss, cta.meta, cta.begin_req, cta.end_req, m_block, warp, lane, debug);
    } else {
      transpose_warp(p, ss, cta.meta, cta.begin_req, cta.end_req, m_block, warp - kGatherWarps, lane, debug);
    }
  } else if (wg == 0) {
    cutlass::arch::warpgroup_reg_alloc<kLeadRegs>();
    lead_loop(p, ss, cta.meta, cta.begin_req, cta.end_req, m_block, tid, debug);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kFollowRegs>();
    follow_loop(p, ss, cta.meta, cta.begin_req, cta.end_req, m_block, tid, debug);
  }
#else
  if (threadIdx.x == 0) printf("flashmla_backend: sm90 sparse decode kernel was not compiled for sm_90a\n");
  __trap();
#endif
}

}  // namespace flashmla_backend::sm90::sparse_fp8
