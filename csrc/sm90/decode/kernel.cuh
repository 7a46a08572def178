// sm90 (Hopper, sm_90a) split-KV MLA decode kernel: device code.
//
// grid  = (num_m_blocks, num_heads_kv, num_sm_parts); block = 256 threads = 2 warpgroups, 1 CTA / SM.
// CTA (m_block, hk, part) processes query rows [64 m_block, 64 m_block + 64) of KV head hk for the
// requests/tokens that metadata row `part` assigns to it (params.h: SchedMetaRow).
//
// Register budget: ptxas gives this kernel 251 of its 255 registers (the O accumulators alone take 128). One more
// value live across the main loop tips it over: keeping two page numbers for a prefetch in registers, global
// loads by thread 0 just before a piece's main loop or stores after it, or a printf each made ptxas spill 6.6 KB
// and serialize every wgmma (warning C7512; check `-Xptxas -v` after any change here). Values the main loop needs
// go through shared memory.
//
// Per request piece (keys [start, stop) of request req) the KV blocks are consumed two at a time
// ("seesaw", docs/kernel-design.md): block 2k sits in KV stage 0 and is multiplied by Q in warpgroup 0,
// block 2k+1 in stage 1 and warpgroup 1. Warpgroup 0 accumulates the output columns [0, 256) (O_L),
// warpgroup 1 the columns [256, 512) (O_R) of both blocks; the row max, the rescale factors and the P
// tiles are exchanged through shared memory under named barriers. Copies: Q by cp.async (rows of a tile
// are not one strided box when s_q > 1 or h_kv > 1), KV by TMA in nine 64x64 pieces with one mbarrier
// each, re-issued by the warpgroup that releases the piece.
//
// Units: scores S are raw Q.K; the running max `m` and every exponent are in the log2 domain
// (m = max(S) * scale_log2); lse outputs are natural log.
#pragma once

#include <cuda.h>  // CUtensorMap (type only; the launcher encodes it through the runtime's driver entry point)
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include <cstdint>

#include "params.h"
#include "sm90/decode/config.h"
#include "sm90/decode/traits.h"

// A wait on a KV mbarrier that does not complete within this many nanoseconds traps (a launch error
// instead of a hung GPU). 0 disables the check. With FMLA_SM90_HANG_PRINTF defined it also prints the
// CTA, thread, stage, piece and parity first (debug only: the printf call serializes the wgmma pipeline).
#ifndef FMLA_SM90_WAIT_TIMEOUT_NS
#define FMLA_SM90_WAIT_TIMEOUT_NS 4000000000ull
#endif

// Ablation builds for benchmarks/ablation.py (results are wrong; never in a release build). FMLA_ABLATE is a bit
// mask: 1 drops the KV refills (each piece barrier completes on a plain arrive and the stage keeps stale data),
// 2 drops 7 of the 9 pieces of every Q K^T (dropping all nine made ptxas spill), 4 drops the P V wgmmas.
// Everything else (barrier waits, softmax, the exchanges between warpgroups, the stores) runs as usual.
#ifndef FMLA_ABLATE
#define FMLA_ABLATE 0
#endif

namespace flashmla_backend::sm90::decode {

using namespace cute;
using TmaBarrier = cutlass::arch::ClusterTransactionBarrier;
using NamedBarrier = cutlass::arch::NamedBarrier;

constexpr float kLn2 = 0.69314718055994530942f;
// L2 policy of the KV loads. With one M tile (h_q * s_q / h_kv <= 64: gridDim.x == 1) every KV block is read
// by one CTA and evict-normal measured faster (H100, b128-sk8192: h16 462.6 -> 457.0 us, varlen h16 267.2 ->
// 262.0 us, h32 unchanged); with two M tiles the CTAs of both tiles read each block at about the same time and
// evict-first measured faster (h128: 596.6 us against 610.3 with evict-normal).
constexpr uint64_t kEvictFirst = uint64_t(cute::TMA::CacheHintSm90::EVICT_FIRST);
constexpr uint64_t kEvictNormal = uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL);

// ------------------------------------------------------------------------------------------------
// Small PTX helpers
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;  // ex2(-inf) = +0
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ bool mbarrier_try_wait(uint32_t bar_addr, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(bar_addr), "r"(parity)
      : "memory");
  return done != 0;
}

// Wait until phase `parity` of a KV piece barrier completed (its TMA bytes landed).
__device__ __forceinline__ void wait_kv_piece(TmaBarrier& bar, uint32_t parity, int stage, int piece) {
  const uint32_t addr = cute::cast_smem_ptr_to_uint(&bar);
  if (mbarrier_try_wait(addr, parity)) return;
#if FMLA_SM90_WAIT_TIMEOUT_NS > 0
  const uint64_t t0 = global_timer_ns();
#endif
  while (!mbarrier_try_wait(addr, parity)) {
#if FMLA_SM90_WAIT_TIMEOUT_NS > 0
    if (global_timer_ns() - t0 > uint64_t(FMLA_SM90_WAIT_TIMEOUT_NS)) {
#ifdef FMLA_SM90_HANG_PRINTF
      printf("flashmla_backend sm90 decode: KV wait timed out: block (%d,%d,%d) thread %d stage %d piece %d "
             "parity %u\n",
             int(blockIdx.x), int(blockIdx.y), int(blockIdx.z), int(threadIdx.x), stage, piece, parity);
#endif
      __trap();
    }
#endif
  }
}

// Programmatic dependent launch (sm_90): issued unconditionally (CUTLASS's wrappers compile to nothing
// unless CUTLASS_ENABLE_GDC_FOR_SM90 is defined). Both are no-ops when the launch did not use PDL.
__device__ __forceinline__ void pdl_wait_primary() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, bool valid) {
  // src-size 0 zero-fills the 16 bytes without reading gmem.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ------------------------------------------------------------------------------------------------
// Work description
// ------------------------------------------------------------------------------------------------
// One request piece as seen by this CTA. All values are CTA-uniform; token bounds are request-local.
struct RequestPiece {
  int req;
  int start;        // first key of the piece (a multiple of kBlockN by the scheduler's contract)
  int stop;         // one past the last key of the piece, <= len
  int len;          // clamped cache length of the request
  int stop_eff;     // one past the last key any valid row of this M tile can see (<= stop)
  int min_row_end;  // smallest per-row visible end over the valid rows of the tile
  int first_page;   // start / kBlockN: block-table index of KV block 0
  int num_blocks;   // KV blocks to process (0: no row of the tile sees a key in the piece)
  int split_id;     // global split id sid (only meaningful when split)
  bool split;       // request has more than one split: write o_accum / lse_accum
};

__device__ __forceinline__ RequestPiece make_request_piece(const DecodeParams& p, const SchedMetaRow& meta,
                                                           int req, int m_block) {
  RequestPiece w;
  w.req = req;
  const int max_len = kBlockN * p.max_pages_per_seq;
  const int len = min(max(__ldg(p.seqlens + req), 0), max_len);
  int start = req == meta.begin_req ? meta.begin_token : 0;
  int stop = req == meta.end_req ? meta.end_token : len;
  stop = min(max(stop, 0), len);
  start = min(max(start, 0), stop);
  w.len = len;
  w.start = start;
  w.stop = stop;
  // Rows of this tile: r in [64 m_block, min(q_rows, 64 m_block + 64)); row r is query token r / ngroups.
  const int row_first = m_block * kBlockM;
  const int row_last = min(p.q_rows, row_first + kBlockM) - 1;
  if (p.causal) {
    // token s sees keys [0, len - s_q + s + 1)
    const int s_first = row_first / p.ngroups;
    const int s_last = row_last / p.ngroups;
    w.stop_eff = min(stop, len - p.seqlen_q + s_last + 1);
    w.min_row_end = min(stop, len - p.seqlen_q + s_first + 1);
  } else {
    w.stop_eff = stop;
    w.min_row_end = stop;
  }
  w.first_page = start / kBlockN;
  w.num_blocks = w.stop_eff > start ? (w.stop_eff + kBlockN - 1) / kBlockN - w.first_page : 0;
  const int split_index = req == meta.begin_req ? meta.begin_split : 0;
  const int split_begin = p.num_splits[req];
  const int n_splits = p.num_splits[req + 1] - split_begin;
  w.split = n_splits > 1;
  w.split_id = split_begin + split_index;
  return w;
}

// ------------------------------------------------------------------------------------------------
// Copies into shared memory
// ------------------------------------------------------------------------------------------------
// Q rows of (req, m_block, hk) into the swizzled Q tile with cp.async; rows past q_rows are zero.
// Byte offset of (row, 16B chunk c) in the SW128 K-major tile: piece (c / 8) * 8 KB + row * 128 +
// ((c % 8) ^ (row % 8)) * 16 (checked against the CuTe layout by checks/layout_check.cu).
template <typename Element>
__device__ __forceinline__ void load_q_async(const DecodeParams& p, int req, int m_block, int hk,
                                             uint32_t sq_addr, int tid) {
  const Element* q = reinterpret_cast<const Element*>(p.q);
  const int64_t req_off = int64_t(req) * p.q_stride_b;
  // Not unrolled: this runs while the output accumulators are live (before the epilogue).
  CUTLASS_PRAGMA_NO_UNROLL
  for (int it = 0; it < kQChunksPerThread; ++it) {
    const int idx = tid + it * kNumThreads;
    const int row = idx / kQChunksPerRow;
    const int c = idx % kQChunksPerRow;
    const int r = m_block * kBlockM + row;
    const bool valid = r < p.q_rows;
    const Element* src = q;
    if (valid) {
      const int s = r / p.ngroups;
      const int h = hk * p.ngroups + (r - s * p.ngroups);
      src = q + req_off + int64_t(s) * p.q_stride_s + int64_t(h) * p.q_stride_h + c * kChunkElems;
    }
    const uint32_t dst = sq_addr + (c / 8) * kPieceBytes + row * 128 + (((c % 8) ^ (row % 8)) * 16);
    cp_async_16(dst, src, valid);
  }
  cp_async_commit();
}

// TMA of the pieces in kMask (bit j = piece j) of cache page `page`, KV head hk, into the stage at
// stage_base, each completing on its own barrier full[j]. Called by one thread. Box = 64 columns x
// 64 tokens = 8192 bytes per piece.
template <uint32_t kMask>
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

// Main-loop refill of the pieces in kMask (issue_kv_pieces; a plain arrive under FMLA_ABLATE & 1).
template <uint32_t kMask>
__device__ __forceinline__ void refill_kv_pieces(const CUtensorMap* tmap, TmaBarrier* full, uint8_t* stage_base,
                                                 int page, int hk) {
  if constexpr ((FMLA_ABLATE & 1) != 0) {
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kNumPieces; ++j)
      if ((kMask >> j) & 1u) full[j].arrive();
  } else {
    issue_kv_pieces<kMask>(tmap, full, stage_base, page, hk);
  }
}

__device__ __forceinline__ int block_page(const DecodeParams& p, const RequestPiece& w, int blk) {
  return __ldg(p.block_table + int64_t(w.req) * p.block_table_stride_b + (w.first_page + blk));
}

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

// ------------------------------------------------------------------------------------------------
// Fragment helpers. Accumulator fragment of a 64xN wgmma (per thread of the warpgroup):
//   element i: row = 16 * warp + lane / 4 + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * (lane % 4) + (i & 1)
// (PTX "wgmma 64xNx16 D fragment"; checked against CuTe by checks/layout_check.cu). The A-operand
// register fragment of a 64x16 k-slice has the same (row, col) order, so a P tile of 64 keys converts
// element by element into the A fragment of the P V product.
// ------------------------------------------------------------------------------------------------
template <class Frag>
__device__ __forceinline__ void mask_scores(Frag& s, int tok0, int start, const int (&row_end)[2], int lane) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(s); ++i) {
    const int t = tok0 + 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
    const int v = (i >> 1) & 1;
    if (t < start || t >= row_end[v]) s(i) = -INFINITY;
  }
}

template <class Frag>
__device__ __forceinline__ void row_max_quad(const Frag& s, float (&mx)[2]) {
  mx[0] = -INFINITY;
  mx[1] = -INFINITY;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(s); ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s(i));
  mx[0] = quad_max(mx[0]);
  mx[1] = quad_max(mx[1]);
}

// s <- exp2(s * scale_log2 - m_use[row]); returns this thread's partial row sums.
template <class Frag>
__device__ __forceinline__ void exp2_rows(Frag& s, float scale_log2, const float (&m_use)[2], float (&sum)[2]) {
  sum[0] = 0.f;
  sum[1] = 0.f;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(s); ++i) {
    const int v = (i >> 1) & 1;
    s(i) = fast_exp2(fmaf(s(i), scale_log2, -m_use[v]));
    sum[v] += s(i);
  }
}

template <class Frag>
__device__ __forceinline__ void scale_rows(Frag& o, const float (&f)[2]) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(o); ++i) o(i) *= f[(i >> 1) & 1];
}

// New running max from the old one and this block's (unscaled) row max; guarded so that a row that
// has seen no key yet keeps m = -inf and gets finite exponents (exp2(-inf - 0) = 0).
__device__ __forceinline__ void update_max(float m_old, float blk_max, float scale_log2, float& m_new,
                                           float& m_use, float& rescale) {
  m_new = fmaxf(m_old, blk_max * scale_log2);
  m_use = m_new == -INFINITY ? 0.f : m_new;
  rescale = fast_exp2(m_old - m_use);  // m_old = -inf -> 0 (the accumulators are 0 then anyway)
}

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
template <class T, bool kZeroInit, int... kPieces, class FragC>
__device__ __forceinline__ void qk_pieces(int tid, typename T::Element* q_smem, typename T::Element* k_smem,
                                          FragC& tSrS, TmaBarrier* full, uint32_t parity, int stage) {
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
      if constexpr ((FMLA_ABLATE & 2) == 0 || j == 0 || j == kRopePiece)
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
  for (int kb = 0; kb < size<2>(tOrV); ++kb)
    if constexpr ((FMLA_ABLATE & 4) == 0) cute::gemm(mma, tOrP(_, _, kb), tOrV(_, _, kb), tOrO);
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
  for (int kb = 0; kb < size<2>(tOrV); ++kb)
    if constexpr ((FMLA_ABLATE & 4) == 0) cute::gemm(mma, tOsP(_, _, kb), tOrV(_, _, kb), tOrO);
  warpgroup_commit_batch();
  warpgroup_fence_operand(tOrO);
}

// ------------------------------------------------------------------------------------------------
// Per-warpgroup state that survives a request's main loop
// ------------------------------------------------------------------------------------------------
struct RowInfo {
  int row[2];      // tile-local rows of this thread's accumulator elements
  int row_end[2];  // one past the last visible key of each row (request-local)
};

// ------------------------------------------------------------------------------------------------
// Warpgroup 0: Q K0^T, softmax of block 0 (decides m0), O_L += P0 V0L + P1 V1L.
//
// The step over blocks (b0, b0 + 1) is specialized at compile time on which blocks exist
// (kHas1: block b0 + 1; kNext0 / kNext1: blocks b0 + 2 / b0 + 3), so that no wgmma sits inside a
// run-time branch (ptxas serializes every wgmma of the kernel when an accumulator is merged from
// two paths). Both warpgroups run the same sequence of steps, see run_steps().
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
  qk_pieces<T, true, 0, 1, 2, 3, 4, 5, 6, 7, 8>(tid, q_smem, kv0_smem, tSrS, full0, parity0, 0);
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
      if (tid == 0) refill_kv_pieces<kRefillMask[0][0]>(tmap, full0, stage0, page_next0, hk);
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
      qk_pieces<T, true, 0, 1, 2, 3>(tid, q_smem, kv0_smem, tSrS, full0, parity0, 0);
      warpgroup_wait<1>();  // P1 V1L done
      if constexpr (kNext1) {
        if (tid == 0) refill_kv_pieces<kRefillMask[1][0]>(tmap, full1, stage1, page_next1, hk);
      }
      qk_pieces<T, false, 4, 5, 6, 7, 8>(tid, q_smem, kv0_smem, tSrS, full0, parity0, 0);
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
        if (tid == 0) refill_kv_pieces<kRefillMask[1][1]>(tmap, full1, stage1, page_next1, hk);
      }
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    if constexpr (kNext0) {
      if (tid == 0) refill_kv_pieces<kRefillMask[0][1]>(tmap, full0, stage0, page_next0, hk);
    }

    // ---- next S = Q K1^T (block b0 + 3) ----
    if constexpr (kNext1) {
      qk_pieces<T, true, 4, 5, 6, 7, 0, 1, 2, 3, 8>(tid, q_smem, kv1_smem, tSrS, full1, parity1, 1);
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
  qk_pieces<T, true, 4, 5, 6, 7, 0, 1, 2, 3, 8>(tid, q_smem, kv1_smem, tSrS, full1, parity1, 1);
  parity1 ^= 1u;
  warpgroup_wait<0>();
  warpgroup_fence_operand(tSrS);
  run_steps(nblk, step);
}

// ------------------------------------------------------------------------------------------------
// Epilogue: O / l and lse (not split), or the split's partial O / l and lse into the accumulators.
// ------------------------------------------------------------------------------------------------
template <class T, class FragO>
__device__ __forceinline__ void store_output(const DecodeParams& p, const RequestPiece& w, const RowInfo& ri,
                                             int m_block, int hk, int wg, int tid, const FragO& tOrO,
                                             const float (&l)[2], const float (&m)[2]) {
  using Element = typename T::Element;
  const int lane = tid & 31;
  const int col0 = wg * kHalfDimV + 2 * (lane & 3);
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < 2; ++v) {
    const int r = m_block * kBlockM + ri.row[v];
    if (r >= p.q_rows) continue;
    const int s = r / p.ngroups;
    const int h = hk * p.ngroups + (r - s * p.ngroups);
    const bool has_key = l[v] > 0.f;
    const float inv = has_key ? 1.f / l[v] : 0.f;
    if (!w.split) {
      Element* out = reinterpret_cast<Element*>(p.out) + int64_t(w.req) * p.out_stride_b + int64_t(s) * p.out_stride_s +
                     int64_t(h) * p.out_stride_h + col0;
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size(tOrO) / 4; ++c) {
        const int i = 4 * c + 2 * v;
        Element pair[2] = {static_cast<Element>(tOrO(i) * inv), static_cast<Element>(tOrO(i + 1) * inv)};
        *reinterpret_cast<uint32_t*>(out + 8 * c) = *reinterpret_cast<const uint32_t*>(pair);
      }
      if (wg == 0 && (lane & 3) == 0) {
        p.lse[int64_t(w.req) * p.lse_stride_b + int64_t(h) * p.lse_stride_h + s] =
            has_key ? m[v] * kLn2 + logf(l[v]) : INFINITY;
      }
    } else {
      const int64_t row_id = (int64_t(w.split_id) * p.num_heads_kv + hk) * p.q_rows + r;
      float* oacc = p.o_accum + row_id * kHeadDimV + col0;
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size(tOrO) / 4; ++c) {
        const int i = 4 * c + 2 * v;
        *reinterpret_cast<float2*>(oacc + 8 * c) = make_float2(tOrO(i) * inv, tOrO(i + 1) * inv);
      }
      if (wg == 0 && (lane & 3) == 0) {
        p.lse_accum[row_id] = has_key ? m[v] * kLn2 + logf(l[v]) : -INFINITY;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The kernel
// ------------------------------------------------------------------------------------------------
template <typename Element>
__global__ void __launch_bounds__(kNumThreads, 1)
    sm90_decode_kernel(const __grid_constant__ DecodeParams params, const __grid_constant__ CUtensorMap tmap_kv) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = Traits<Element>;
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

  const SchedMetaRow meta = reinterpret_cast<const SchedMetaRow*>(p.sched_meta)[part];
  const int begin_req = meta.begin_req;
  const int end_req = min(meta.end_req, p.batch - 1);
  if (begin_req < 0 || begin_req > end_req) {
    pdl_launch_dependents();
    return;
  }

  if (tid == 0) {
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&tmap_kv));
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < kNumStages; ++s) {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kNumPieces; ++j) ss.kv_full[s][j].init(1);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  const uint32_t sq_addr = cute::cast_smem_ptr_to_uint(ss.q.data());
  uint8_t* stage_base[kNumStages] = {reinterpret_cast<uint8_t*>(ss.kv[0].data()),
                                     reinterpret_cast<uint8_t*>(ss.kv[1].data())};

  // Loads of a request's Q tile and first two KV blocks (the main loop re-issues the rest).
  auto issue_request_loads = [&](const RequestPiece& w) {
    load_q_async<Element>(p, w.req, m_block, hk, sq_addr, tid);
    if (tid == 0) {
      constexpr uint32_t kAll = (1u << kNumPieces) - 1;
      if (w.num_blocks > 0) issue_kv_pieces<kAll>(&tmap_kv, ss.kv_full[0], stage_base[0], block_page(p, w, 0), hk);
      if (w.num_blocks > 1) issue_kv_pieces<kAll>(&tmap_kv, ss.kv_full[1], stage_base[1], block_page(p, w, 1), hk);
    }
  };

  RequestPiece work = make_request_piece(p, meta, begin_req, m_block);
  issue_request_loads(work);

  // Phase parity of the KV piece barriers of the stage this warpgroup multiplies by Q (stage wg).
  uint32_t kv_parity = 0;

  // Rows of this thread's accumulator elements (same in both warpgroups).
  RowInfo ri;
  ri.row[0] = 16 * (tid_in_wg / 32) + lane / 4;
  ri.row[1] = ri.row[0] + 8;

  typename T::TiledMmaPVReg mma_pv;
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHalfDimV>>{});  // ((2,2,32),1,1) fp32

  CUTLASS_PRAGMA_NO_UNROLL
  for (int req = begin_req; req <= end_req; ++req) {
    const RequestPiece w = work;

    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) {
      const int r = m_block * kBlockM + ri.row[v];
      int end = w.stop_eff;  // rows past q_rows: any bound that keeps them finite
      if (r < p.q_rows) {
        end = w.stop;
        if (p.causal) end = min(end, w.len - p.seqlen_q + r / p.ngroups + 1);
      }
      ri.row_end[v] = end;
    }

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

    // Row sums: this thread's columns -> the warpgroup's -> both warpgroups'.
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) row_sum[v] = quad_sum(row_sum[v]);
    if ((lane & 3) == 0) {
      ss.row_sum[wg][ri.row[0]] = row_sum[0];
      ss.row_sum[wg][ri.row[1]] = row_sum[1];
    }
    // Both warpgroups are past their last wgmma: Q and both KV stages may be overwritten.
    __syncthreads();

    if (req < end_req) {
      work = make_request_piece(p, meta, req + 1, m_block);
      issue_request_loads(work);
    } else {
      pdl_launch_dependents();
    }

    float l[2], m[2];
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) {
      l[v] = ss.row_sum[0][ri.row[v]] + ss.row_sum[1][ri.row[v]];
      m[v] = ss.row_max[ri.row[v]];
    }
    store_output<T>(p, w, ri, m_block, hk, wg, tid_in_wg, tOrO, l, m);
    __syncthreads();  // row_max / row_sum are reused by the next request
  }
#else
  // Built for another architecture: this kernel needs sm_90a (wgmma, TMA).
  if (threadIdx.x == 0) printf("flashmla_backend: sm90 decode kernel was not compiled for sm_90a\n");
  __trap();
#endif
}

}  // namespace flashmla_backend::sm90::decode
