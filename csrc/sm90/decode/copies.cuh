// Copies into shared memory of the sm90 decode kernel: the Q tile (cp.async), the KV blocks (TMA, nine 64x64
// pieces per block with one mbarrier each), the waits on those barriers, and the zeroing of V rows past the
// end of a request.
//
// There is no producer warp: a request's Q tile and first two KV blocks are loaded by issue_request_loads
// after the previous request's epilogue barrier, and every later block's pieces are re-issued by thread 0
// of the warpgroup that released them (refill_kv_pieces, config.h: kRefillMask).
#pragma once

#include <cuda.h>  // CUtensorMap (type only; the launcher encodes it through the runtime's driver entry point)

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include <cstdint>

#include "common/device.cuh"
#include "params.h"
#include "sm90/decode/config.h"
#include "sm90/decode/tile_work.cuh"

// A wait on a KV mbarrier that does not complete within this many nanoseconds traps (a launch error
// instead of a hung GPU). 0 disables the check. With FMLA_SM90_HANG_PRINTF defined it also prints the
// CTA, thread, stage, piece and parity first (debug only: the printf call serializes the wgmma pipeline).
#ifndef FMLA_SM90_WAIT_TIMEOUT_NS
#define FMLA_SM90_WAIT_TIMEOUT_NS 4000000000ull
#endif

namespace flashmla_backend::sm90::decode {

using TmaBarrier = cutlass::arch::ClusterTransactionBarrier;

// L2 policy of the KV loads. With one M tile (h_q * s_q / h_kv <= 64: gridDim.x == 1) every KV block is read
// by one CTA and evict-normal measured faster; with two M tiles the CTAs of both tiles read each block at about
// the same time and evict-first measured faster (figures: docs/perf/journal.md).
constexpr uint64_t kEvictFirst = uint64_t(cute::TMA::CacheHintSm90::EVICT_FIRST);
constexpr uint64_t kEvictNormal = uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL);

// ------------------------------------------------------------------------------------------------
// mbarrier waits
// ------------------------------------------------------------------------------------------------
// Wait until phase `parity` of a KV piece barrier completed (its TMA bytes landed); common/device.cuh's
// mbarrier_wait, trapping after FMLA_SM90_WAIT_TIMEOUT_NS.
__device__ __forceinline__ void wait_kv_piece(TmaBarrier& bar, uint32_t parity, int stage, int piece) {
  mbarrier_wait<uint64_t(FMLA_SM90_WAIT_TIMEOUT_NS)>(cute::cast_smem_ptr_to_uint(&bar), parity, [&] {
#ifdef FMLA_SM90_HANG_PRINTF
    printf("flashmla_backend sm90 decode: KV wait timed out: block (%d,%d,%d) thread %d stage %d piece %d "
           "parity %u\n",
           int(blockIdx.x), int(blockIdx.y), int(blockIdx.z), int(threadIdx.x), stage, piece, parity);
#endif
  });
}

// ------------------------------------------------------------------------------------------------
// Q tile (cp.async)
// ------------------------------------------------------------------------------------------------
// The Q tile's cp.async: these keep a "memory" clobber on each asm, unlike common/device.cuh's (whose portable
// kernel was tuned without one). The clobbers pin these among the kernel's other shared-memory accesses;
// the unclobbered ones compile this kernel to a different instruction schedule (same registers), which has not
// been timed, so the one that was timed stays.
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, bool valid) {
  // src-size 0 zero-fills the 16 bytes without reading gmem.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Q rows of (req, m_block, hk) into the swizzled Q tile with cp.async; rows past q_rows are zero.
// Byte offset of (row, 16B chunk c) in the SW128 K-major tile: piece (c / 8) * 8 KB + row * 128 +
// ((c % 8) ^ (row % 8)) * 16 (checked against the CuTe layout by checks/layout_check.cu).
template <class T>
__device__ __forceinline__ void load_q_async(const DecodeParams& p, int req, int m_block, int hk,
                                             uint32_t sq_addr, int tid) {
  using QIn = typename T::QIn;
  constexpr int kElemsPerChunk = 16 / sizeof(QIn);
  constexpr int kChunksPerRow = kHeadDimK / kElemsPerChunk;
  constexpr int kChunksPerThread = kBlockM * kChunksPerRow / kNumThreads;
  static_assert(kBlockM * kChunksPerRow % kNumThreads == 0, "Q chunks split evenly over the CTA");
  const QIn* q = reinterpret_cast<const QIn*>(p.q);
  const QIn* q_pe = reinterpret_cast<const QIn*>(p.q_pe);
  const int64_t req_off = int64_t(req) * p.q_stride_b;
  const int64_t req_off_pe = int64_t(req) * p.q_pe_stride_b;
  constexpr int kLatentChunks = kHeadDimV / kElemsPerChunk;  // chunks 0..kLatentChunks-1 from q, the rest from q_pe
  static_assert(kHeadDimV % kElemsPerChunk == 0, "no chunk straddles the latent / rope boundary");
  // Not unrolled: this runs while the output accumulators are live (before the epilogue).
  CUTLASS_PRAGMA_NO_UNROLL
  for (int it = 0; it < kChunksPerThread; ++it) {
    const int idx = tid + it * kNumThreads;
    const int row = idx / kChunksPerRow;
    const int c = idx % kChunksPerRow;
    const int r = m_block * kBlockM + row;
    const bool valid = r < p.q_rows;
    const QIn* src = q;
    if (valid) {
      const int s = r / p.ngroups;
      const int h = hk * p.ngroups + (r - s * p.ngroups);
      src = c < kLatentChunks
                ? q + req_off + int64_t(s) * p.q_stride_s + int64_t(h) * p.q_stride_h + c * kElemsPerChunk
                : q_pe + req_off_pe + int64_t(s) * p.q_pe_stride_s + int64_t(h) * p.q_pe_stride_h +
                      (c - kLatentChunks) * kElemsPerChunk;
    }
    const uint32_t dst = sq_addr + (c / 8) * kPieceBytes + row * 128 + (((c % 8) ^ (row % 8)) * 16);
    cp_async_16(dst, src, valid);
  }
  cp_async_commit();
}

// ------------------------------------------------------------------------------------------------
// e4m3 to fp16 (used by the FP8 tensor-core kernel, sm90/decode_fp8/)
// ------------------------------------------------------------------------------------------------
// Two e4m3 values (the low and high byte of a 16-bit word) to an fp16 pair, exactly (NaN stays NaN).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint16_t x) {
  uint32_t d;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(x));
  return d;
}
// 8 e4m3 values (two 32-bit words) to one 16-byte chunk of 8 fp16.
__device__ __forceinline__ uint4 e4m3x8_to_f16x8(uint32_t lo, uint32_t hi) {
  return make_uint4(e4m3x2_to_f16x2(uint16_t(lo)), e4m3x2_to_f16x2(uint16_t(lo >> 16)), e4m3x2_to_f16x2(uint16_t(hi)),
                    e4m3x2_to_f16x2(uint16_t(hi >> 16)));
}

// ------------------------------------------------------------------------------------------------
// KV blocks (TMA)
// ------------------------------------------------------------------------------------------------
// TMA of the pieces in kMask (bit j = piece j) of cache page `page`, KV head hk, into the stage at
// stage_base, each completing on its own barrier full[j]. Called by one thread. Box = 64 columns x
// 64 tokens = one 8 KB piece, landing in its slot j * kPieceBytes.
template <class T, uint32_t kMask>
__device__ __forceinline__ void issue_kv_pieces(const CUtensorMap* tmap, TmaBarrier* full, uint8_t* stage_base,
                                                int page, int hk) {
  const uint64_t cache_hint = gridDim.x == 1 ? kEvictNormal : kEvictFirst;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kNumPieces; ++j) {
    if ((kMask >> j) & 1u) {
      full[j].arrive_and_expect_tx(kPieceBytes);
      // tensor map dims (fastest first): (576 columns, h_kv, 64 tokens, num_pages)
      cute::SM90_TMA_LOAD_4D::copy(tmap, reinterpret_cast<uint64_t*>(&full[j]), cache_hint,
                                   stage_base + j * kPieceBytes, j * kPieceCols, hk, 0, page);
    }
  }
}

// Main-loop refill of the pieces in kMask of a stage, issued by the warpgroup whose wgmma released them last
// (config.h: kRefillMask). A request's first two blocks are loaded by issue_request_loads instead.
template <class T, uint32_t kMask>
__device__ __forceinline__ void refill_kv_pieces(const CUtensorMap* tmap, TmaBarrier* full, uint8_t* stage_base,
                                                 int page, int hk) {
  issue_kv_pieces<T, kMask>(tmap, full, stage_base, page, hk);
}

// Barriers of both KV stages (one per piece, arrival count 1: the issuing thread's arrive.expect_tx) and the
// tensor map prefetch, by thread 0. The caller synchronizes the CTA before the first wait.
__device__ __forceinline__ void init_kv_barriers(const CUtensorMap* tmap, TmaBarrier (&full)[kNumStages][kNumPieces],
                                                 int tid) {
  if (tid == 0) {
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(tmap));
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < kNumStages; ++s) {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kNumPieces; ++j) full[s][j].init(1);
    }
    cutlass::arch::fence_barrier_init();
  }
}

// Loads of a request piece's Q tile and first two KV blocks (the main loop re-issues the rest). Called by the
// whole CTA once nothing reads Q or either KV stage any more.
template <class T>
__device__ __forceinline__ void issue_request_loads(const DecodeParams& p, const CUtensorMap* tmap,
                                                    TmaBarrier (&full)[kNumStages][kNumPieces],
                                                    uint8_t* const (&stage_base)[kNumStages], const RequestPiece& w,
                                                    int m_block, int hk, uint32_t sq_addr, int tid) {
  load_q_async<T>(p, w.req, m_block, hk, sq_addr, tid);
  if (tid == 0) {
    constexpr uint32_t kAll = (1u << kNumPieces) - 1;
    if (w.num_blocks > 0) issue_kv_pieces<T, kAll>(tmap, full[0], stage_base[0], block_page(p, w, 0), hk);
    if (w.num_blocks > 1) issue_kv_pieces<T, kAll>(tmap, full[1], stage_base[1], block_page(p, w, 1), hk);
  }
}

// ------------------------------------------------------------------------------------------------
// KV stage contents
// ------------------------------------------------------------------------------------------------
// Zero rows [row0, 64) of the V pieces [first_piece, first_piece + 4) of a stage: keys past the end of
// the request may hold anything (NaN), and P = 0 times NaN is NaN. Whole 128-byte rows, so the
// swizzle does not matter. Followed by a proxy fence (the readers are wgmma).
__device__ __forceinline__ void zero_v_rows(uint8_t* stage_base, int first_piece, int row0, int tid_in_wg) {
  const int rows = kBlockN - row0;
  const int total = rows * kVPiecesPerWarpGroup * 8;  // 16-byte chunks
  for (int idx = tid_in_wg; idx < total; idx += kThreadsPerWarpGroup) {
    const int chunk = idx % 8;
    const int rp = idx / 8;
    const int piece = first_piece + rp % kVPiecesPerWarpGroup;
    const int row = row0 + rp / kVPiecesPerWarpGroup;
    *reinterpret_cast<uint4*>(stage_base + piece * kPieceBytes + row * 128 + chunk * 16) = make_uint4(0, 0, 0, 0);
  }
  cutlass::arch::fence_view_async_shared();
}

}  // namespace flashmla_backend::sm90::decode
