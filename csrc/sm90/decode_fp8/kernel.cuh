// sm90 FP8 tensor-core MLA decode kernel (e4m3 cache; Q K^T on e4m3 wgmma, P V on e4m3 or, in the accurate mode,
// fp16 wgmma): the __global__ function.
//
// grid = (num_m_blocks, num_heads_kv, num_sm_parts), the 16-bit kernel's grid and metadata; block = 384 threads:
// warpgroups 0 and 1 consume (mainloop.cuh), warpgroup 2 produces (producer.cuh). One CTA per SM. The cluster plans
// (Traits::kClusterPair: the shared transposition, the multicast copies) launch the same grid in clusters of
// (2, 1, 1): a pair of M tiles of a (part, KV head) that see the same keys.
//   config.h / traits.h   geometry, MMA types, shared-memory plan, barriers
//   producer.cuh          KV copies (TMA) and the V transposition (the accurate mode: V widened to fp16)
//   q_tile.cuh            the Q tile: q copied (cp.async), a 16-bit q then split into e4m3 terms in place
//   mainloop.cuh          the consumers' seesaw
//   mainloop_f16pv.cuh    warpgroup 1 of the accurate mode (P V on fp16 wgmma)
//   mainloop_vregs.cuh    both consumers of the accurate mode's V-in-registers tile (vregs.h: TraitsVR), its
//                         epilogue and barriers; its producer warpgroup only issues the copies
// The tile work (sm90/decode/tile_work.cuh), the softmax pieces (sm90/decode/softmax.cuh) and the epilogue
// (sm90/decode/epilogue.cuh) are the 16-bit kernel's.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>

#include <cstdint>

#include "common/device.cuh"
#include "common/measure.h"
#include "params.h"
#include "sm90/decode/epilogue.cuh"
#include "sm90/decode/softmax.cuh"
#include "sm90/decode/tile_work.cuh"
#include "sm90/decode_fp8/config.h"
#include "sm90/decode_fp8/mainloop.cuh"
#include "sm90/decode_fp8/mainloop_f16pv.cuh"
#include "sm90/decode_fp8/mainloop_vregs.cuh"
#include "sm90/decode_fp8/producer.cuh"
#include "sm90/decode_fp8/q_tile.cuh"
#include "sm90/decode_fp8/traits.h"
#include "sm90/decode_fp8/vregs.h"

namespace flashmla_backend::sm90::decode_fp8 {

using namespace cute;

// A consumer warpgroup's output accumulator: O (64 rows, 256 value columns), or O^T in four tiles (TraitsVR).
template <class T, bool = IsVRegs<T>::value>
struct OAccOf {
  using type = decltype(partition_fragment_C(typename T::TiledMmaPV{}, Shape<Int<kBlockM>, Int<kHalfDimV>>{}));
};
template <class T>
struct OAccOf<T, true> {
  using type = OTAcc<T>;
};

// The request loop of consumer warpgroup kWG. Each warpgroup runs its own copy (the output accumulator is
// declared inside): with one loop and a run-time choice of the main loop, ptxas merged the two warpgroups'
// accumulators, serialized every wgmma and kept O in local memory.
template <class T, int kWG>
__device__ __forceinline__ void consumer_loop(const DecodeParams& p, typename T::SharedStorage& ss,
                                              const SchedMetaRow& meta, int begin_req, int end_req, int m_block,
                                              int hk, int tid, int lane) {
  const int tid_in_wg = tid % kThreadsPerWarpGroup;
  const uint32_t q_addr = cute::cast_smem_ptr_to_uint(ss.q.data());

  // The tile rows of the thread's accumulator rows g and g + 8 (Traits::kStackedTerms: both are query row
  // 8 w + g, layout.h).
  decode::RowInfo ri;
  if constexpr (T::kStackedTerms) {
    ri.row[0] = 8 * (tid_in_wg / 32) + lane / 4;
    ri.row[1] = ri.row[0];
  } else {
    ri.row[0] = 16 * (tid_in_wg / 32) + lane / 4;
    ri.row[1] = ri.row[0] + 8;
  }

  typename OAccOf<T>::type tOrO;  // 128 fp32

  issue_q_copy<T>(p, begin_req, m_block, hk, q_addr, tid);
  uint32_t g_base = 0;

  CUTLASS_PRAGMA_NO_UNROLL
  for (int req = begin_req; req <= end_req; ++req) {
    const decode::RequestPiece w = decode::make_request_piece(p, meta, req, m_block, T::kTileRows);
    decode::set_row_ends(p, w, m_block, ri, T::kTileRows);
    if (tid < T::kTileRows) ss.row_max[tid] = -INFINITY;
    if constexpr (IsVRegs<T>::value) {
      if (tid < kBlockM) ss.row_off[tid] = vregs_row_offset(p, w, m_block, hk, tid);
    }
    decode::cp_async_wait_all();
    if constexpr (!T::kQFp8) split_q_tile<T>(q_addr, ss.q_scale, tid);
    cutlass::arch::fence_view_async_shared();  // Q written by cp.async / st.shared, read by wgmma
    consumers_sync();

    // Softmax scale of each row: scale_log2 * descale_k * (descale_q or the row's split scale).
    if (tid < T::kTileRows) {
      const float dk = descale_k_at(p, w.req, hk);
      const float qs = T::kQFp8 ? descale_q_at(p, w.req, hk) : ss.q_scale[tid];
      ss.row_scale_log2[tid] = p.scale_log2 * dk * qs;
      if (tid == 0) ss.value_scale = dk;
    }
    consumers_sync();

    float row_sum[2] = {0.f, 0.f};  // O is cleared in the main loop (mainloop.cuh)
    // Traits::kPTerms2: O's fp32 copy, the piece's rows of o_accum (mainloop.cuh)
    OPromotion op{&p, m_block, hk, ri.row[0], kWG * kHalfDimV + 4 * (lane & 3), nullptr};
    if constexpr (!IsVRegs<T>::value) {
      if constexpr (T::kPTerms2) op.m_copy = &ss.o_copy_max[tid];
    }
    if constexpr (IsVRegs<T>::value) {
      mainloop_vregs<T, kWG>(ss, w, ri, tid_in_wg, g_base, tOrO, row_sum);
    } else if constexpr (kWG == 0) {
      run_promoted<T, 0>(ss, w, g_base, tOrO, op, [&](const RequestPiece& r, uint32_t g) CUTLASS_LAMBDA_FUNC_INLINE {
        mainloop_wg0<T>(ss, r, ri, tid_in_wg, g, tOrO, row_sum);
      });
    } else if constexpr (T::kPvF16) {
      mainloop_f16pv_wg1<T>(ss, w, ri, tid_in_wg, g_base, tOrO, row_sum);
    } else {
      run_promoted<T, 1>(ss, w, g_base, tOrO, op, [&](const RequestPiece& r, uint32_t g) CUTLASS_LAMBDA_FUNC_INLINE {
        mainloop_wg1<T>(ss, r, ri, tid_in_wg, g, tOrO, row_sum);
      });
    }
    g_base += uint32_t(padded_blocks(w.num_blocks));

    decode::publish_row_sums(ss, ri.row, kWG, lane, row_sum);
    // Both consumer warpgroups are past their last wgmma: the Q tile may be overwritten.
    consumers_sync();
    if (req < end_req) {
      issue_q_copy<T>(p, req + 1, m_block, hk, q_addr, tid);
    } else {
      pdl_launch_dependents();
    }

    if constexpr (IsVRegs<T>::value) {
      store_output_vregs<T>(p, w, ss, m_block, hk, kWG, tid_in_wg, tOrO);
    } else {
      float l[2], m[2];
      decode::final_row_stats(ss, ri.row, l, m);
      if constexpr (T::kPTerms2) finish_o(tOrO, op, w, m[0]);
      // l carries P's 2^kPScaleLog2 (config.h): O / l does not see it, lse = (m + log2 l) ln 2 must not.
      m[0] -= kPScaleLog2;
      m[1] -= kPScaleLog2;
      decode::store_output<T>(p, w, ri, m_block, hk, kWG, tid_in_wg, tOrO, l, m, ss.value_scale);
    }
    consumers_sync();  // row_max / row_sum reused
  }
}

template <class T>
__global__ void __launch_bounds__(kNumThreads, 1)
    sm90_fp8_decode_kernel(const __grid_constant__ DecodeParams params, const __grid_constant__ CUtensorMap tmap_kv,
                           int debug_arg) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using SharedStorage = typename T::SharedStorage;
  const DecodeParams& p = params;
  const int debug = kMeasureBuild ? debug_arg : 0;  // common/measure.h

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = cute::cast_smem_ptr_to_uint(smem_raw);
  SharedStorage& ss =
      *reinterpret_cast<SharedStorage*>(smem_raw + ((kSmemAlign - (raw_addr % kSmemAlign)) % kSmemAlign));

  const int m_block = blockIdx.x;
  const int hk = blockIdx.y;
  const int part = blockIdx.z;
  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid / kThreadsPerWarpGroup, 0);  // warp-uniform
  const int lane = tid & 31;

  pdl_wait_primary();

  decode::CtaRequests cta;
  if (!decode::cta_requests(p, part, cta)) return;
  const SchedMetaRow& meta = cta.meta;
  const int begin_req = cta.begin_req, end_req = cta.end_req;

  if (tid == 0) {
    if constexpr (IsVRegs<T>::value) {
      init_pipeline_barriers_vregs<T>(ss, &tmap_kv);
    } else {
      init_pipeline_barriers<T>(ss, &tmap_kv);
    }
  }
  // The cluster plans: the peer's barriers must be initialized before the first remote arrival or copy. Both CTAs
  // of a cluster have the same metadata row, so both got here or both returned above.
  if constexpr (T::kClusterPair) {
    cluster_sync_all();
  } else {
    __syncthreads();
  }

  if (wg == kNumConsumerWarpGroups) {
    // ---- producer ----
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if constexpr (IsVRegs<T>::value) {
      if (tid == kNumConsumerThreads) copy_loop<T>(p, &tmap_kv, ss, meta, begin_req, end_req, m_block, hk);
    } else {
      producer_warp<T>(p, &tmap_kv, ss, meta, begin_req, end_req, m_block, hk, (tid - kNumConsumerThreads) / 32, lane,
                       debug);
    }
  } else if (wg == 0) {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
    consumer_loop<T, 0>(p, ss, meta, begin_req, end_req, m_block, hk, tid, lane);
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
    consumer_loop<T, 1>(p, ss, meta, begin_req, end_req, m_block, hk, tid, lane);
  }
  // The cluster plans: no CTA leaves while the peer may still arrive on its barriers (the consumers' last releases)
  // or read its shared memory (the last bulk copies, consumed by the peer before it gets here); the multicasts into
  // a CTA's stages all completed before its consumers' last waits.
  if constexpr (T::kClusterPair) cluster_sync_all();
#else
  if (threadIdx.x == 0) printf("flashmla_backend: sm90 FP8 decode kernel was not compiled for sm_90a\n");
  __trap();
#endif
}

}  // namespace flashmla_backend::sm90::decode_fp8
