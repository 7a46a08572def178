// sm90 (Hopper, sm_90a) split-KV MLA decode kernel: the __global__ function, which composes the roles.
//
// grid  = (num_m_blocks, num_heads_kv, num_sm_parts); block = 256 threads = 2 warpgroups, 1 CTA / SM.
// CTA (m_block, hk, part) processes query rows [64 m_block, 64 m_block + 64) of KV head hk for the
// requests/tokens that metadata row `part` assigns to it (params.h: SchedMetaRow).
//
// One header per role (docs/kernel-design.md describes the algorithm):
//   config.h       tile constants, refill masks          traits.h     MMA types, smem layouts and plan, named barriers
//   tile_work.cuh  request pieces of a metadata row      copies.cuh   Q cp.async, KV TMA pieces, mbarrier waits
//   softmax.cuh    online softmax, row max / row sums     mainloop.cuh Q K^T and P V wgmma, the two warpgroups' steps
//   epilogue.cuh   out / lse or o_accum / lse_accum
// Both warpgroups are consumers; there is no producer warp (copies.cuh says who issues which copy).
//
// Register budget: ptxas gives this kernel 251 of its 255 registers (the O accumulators alone take 128). One more
// value live across the main loop tips it over: keeping two page numbers for a prefetch in registers, global
// loads by thread 0 just before a piece's main loop or stores after it, or a printf each made ptxas spill 6.6 KB
// and serialize every wgmma (warning C7512; check `-Xptxas -v` after any change here). Values the main loop needs
// go through shared memory.
#pragma once

#include <cuda.h>  // CUtensorMap (type only; the launcher encodes it through the runtime's driver entry point)
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include <cstdint>

#include "common/device.cuh"
#include "params.h"
#include "sm90/decode/config.h"
#include "sm90/decode/copies.cuh"
#include "sm90/decode/epilogue.cuh"
#include "sm90/decode/mainloop.cuh"
#include "sm90/decode/softmax.cuh"
#include "sm90/decode/tile_work.cuh"
#include "sm90/decode/traits.h"

namespace flashmla_backend::sm90::decode {

using namespace cute;

// Programmatic dependent launch: common/device.cuh's pdl_wait_primary / pdl_launch_dependents, issued
// unconditionally (CUTLASS's wrappers compile to nothing unless CUTLASS_ENABLE_GDC_FOR_SM90 is defined).

// T: a Traits instantiation (traits.h): the element type of q, cache and output.
template <class T>
__global__ void __launch_bounds__(kNumThreads, 1)
    sm90_decode_kernel(const __grid_constant__ DecodeParams params, const __grid_constant__ CUtensorMap tmap_kv) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using SharedStorage = typename T::SharedStorage;
  const DecodeParams& p = params;

  extern __shared__ uint8_t smem_raw[];
  // Realign to 1024 bytes (128B-swizzle atoms, TMA destinations); the launcher reserves the slack.
  const uint32_t raw_addr = cute::cast_smem_ptr_to_uint(smem_raw);
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_raw + ((kSmemAlign - (raw_addr % kSmemAlign)) % kSmemAlign));

  const int m_block = blockIdx.x;
  const int hk = blockIdx.y;
  const int part = blockIdx.z;
  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid / kThreadsPerWarpGroup, 0);  // warp-uniform
  const int tid_in_wg = tid % kThreadsPerWarpGroup;
  const int lane = tid & 31;

  // Everything below reads memory written by earlier kernels (metadata, q, the cache).
  pdl_wait_primary();

  CtaRequests cta;
  if (!cta_requests(p, part, cta)) return;
  const SchedMetaRow& meta = cta.meta;
  const int begin_req = cta.begin_req, end_req = cta.end_req;

  init_kv_barriers(&tmap_kv, ss.kv_full, tid);
  __syncthreads();

  const uint32_t sq_addr = cute::cast_smem_ptr_to_uint(ss.q.data());
  uint8_t* stage_base[kNumStages] = {reinterpret_cast<uint8_t*>(ss.kv[0].data()),
                                     reinterpret_cast<uint8_t*>(ss.kv[1].data())};

  RequestPiece work = make_request_piece(p, meta, begin_req, m_block);
  issue_request_loads<T>(p, &tmap_kv, ss.kv_full, stage_base, work, m_block, hk, sq_addr, tid);

  // Phase parity of the KV piece barriers of the stage this warpgroup multiplies by Q (stage wg).
  uint32_t kv_parity = 0;

  // Rows of this thread's accumulator elements (same in both warpgroups). Computed here rather than in a
  // helper: that made the compiler spell `lane / 4` differently (same value, other SASS).
  RowInfo ri;
  ri.row[0] = 16 * (tid_in_wg / 32) + lane / 4;
  ri.row[1] = ri.row[0] + 8;

  typename T::TiledMmaPVReg mma_pv;
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHalfDimV>>{});  // ((2,2,32),1,1) fp32

  CUTLASS_PRAGMA_NO_UNROLL
  for (int req = begin_req; req <= end_req; ++req) {
    const RequestPiece w = work;
    set_row_ends(p, w, m_block, ri);

    if (tid < kBlockM) ss.row_max[tid] = -INFINITY;
    cp_async_wait_all();
    cutlass::arch::fence_view_async_shared();  // Q written by cp.async, read by wgmma
    __syncthreads();

    clear(tOrO);
    float row_sum[2] = {0.f, 0.f};
    if (wg == 0) {
      mainloop_wg0<T>(ss, p, &tmap_kv, w, ri, hk, tid_in_wg, tOrO, row_sum, kv_parity);
    } else {
      mainloop_wg1<T>(ss, p, &tmap_kv, w, ri, hk, tid_in_wg, tOrO, row_sum, kv_parity);
    }

    publish_row_sums(ss, ri.row, wg, lane, row_sum);
    // Both warpgroups are past their last wgmma: Q and both KV stages may be overwritten.
    __syncthreads();

    if (req < end_req) {
      work = make_request_piece(p, meta, req + 1, m_block);
      issue_request_loads<T>(p, &tmap_kv, ss.kv_full, stage_base, work, m_block, hk, sq_addr, tid);
    } else {
      pdl_launch_dependents();
    }

    float l[2], m[2];
    final_row_stats(ss, ri.row, l, m);
    store_output<T>(p, w, ri, m_block, hk, wg, tid_in_wg, tOrO, l, m, 1.f);
    __syncthreads();  // row_max / row_sum are reused by the next request
  }
#else
  // Built for another architecture: this kernel needs sm_90a (wgmma, TMA).
  if (threadIdx.x == 0) printf("flashmla_backend: sm90 decode kernel was not compiled for sm_90a\n");
  __trap();
#endif
}

}  // namespace flashmla_backend::sm90::decode
