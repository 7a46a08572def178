// Portable split-KV MLA decode kernel: mma.sync m16n8k16 (fp32 accumulate), ldmatrix, cp.async.
// Runs on sm_80 and newer with >= 160 KB of shared memory per block (see config.h). It is the
// non-Hopper path and the correctness baseline of the fast sm_90 kernel.
//
// Grid (num_m_blocks, num_heads_kv, num_sm_parts), 256 threads = 8 warps, 1 CTA per SM.
// CTA (m_block, hk, part) handles query rows [m_block*64, m_block*64 + 64) of kv head hk, for the
// token ranges of the requests that scheduler row `part` assigns to it (see SchedMetaRow).
//
// Tensors (element strides in DecodeParams):
//   q         [b, s_q, h_q, 576]                T
//   kv        [num_pages, 64, h_kv, 576]        T     (V = columns 0..511 of the same row)
//   out       [b, s_q, h_q, 512]                T     (requests with a single split)
//   lse       [b, h_q, s_q]                     fp32  (natural log)
//   o_accum   [b + parts, h_kv, q_rows, 512]    fp32  (requests with several splits, by split id)
//   lse_accum [b + parts, h_kv, q_rows]         fp32
//
// Warp roles (warp w: warp_m = w % 4, warp_n = w / 4):
//   S = Q K^T   64x64:  warp computes rows 16*warp_m .. +16, keys 32*warp_n .. +32
//   O += P V    64x512: warp computes rows 16*warp_m .. +16, V columns 256*warp_n .. +256
// A warp's S rows and O rows are the same 16 rows, so the online-softmax state (running max, sum) of
// a row lives in the quad of lanes that holds it, in both warps of the row group.
//
// Per KV block (all barriers are CTA-wide __syncthreads):
//   1. Q K^T, one cp.async group at a time (group order: chunk 8, then chunks {0,4},{1,5},{2,6},{3,7})
//   2. mask, block row max -> smem, barrier; now Q and chunk 8 are free: issue the next block's
//      group 0 (its chunk 8, plus the next request's Q tile when the next block starts a new request)
//   3. online softmax, P -> smem, barrier
//   4. P V in 4 steps; step i reads V chunk i (warp_n 0) and chunk 4 + i (warp_n 1); after the
//      barrier that ends step i, those two chunks of the next block are issued (group 1 + i).
// The "next block" may belong to a later request of the part: loads run ahead across requests.
//
// Online softmax runs in base 2 on scaled scores x = (q.k) * scale_log2; the running max m is kept
// in those units, so lse = m * ln(2) + ln(l). (Tracking the max of scaled scores also keeps the
// kernel correct for a negative softmax scale.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>

// Only the arch atoms (inline-PTX wrappers), not cute/tensor.hpp: keeps the compile time low.
#include <cute/arch/copy_sm75.hpp>   // SM75_U32x4_LDSM_N, SM75_U16x8_LDSM_T

#include "common/device.cuh"
#include "params.h"
#include "portable/config.h"
#include "portable/traits.h"

namespace flashmla_backend::portable {

// ---- Thin wrappers over the CuTe arch atoms ------------------------------------------------------
// d += a * b for one m16n8k16 tile. a: 4 regs (A fragment), b0/b1: B fragment, d: 4 fp32.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  ElementOps<T>::Mma::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1, d[0], d[1], d[2], d[3]);
}

// Four 8x8 b16 matrices; lane l gives the address of row l % 8 of matrix l / 8; register i of every
// lane receives its (row lane/4, columns 2*(lane%4) .. +1) of matrix i.
__device__ __forceinline__ void ldsm_x4(const uint16_t* smem, uint32_t (&r)[4]) {
  cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(smem), r[0], r[1], r[2], r[3]);
}
// Same addressing; register i receives (rows 2*(lane%4) .. +1, column lane/4) of matrix i.
__device__ __forceinline__ void ldsm_x4_trans(const uint16_t* smem, uint32_t (&r)[4]) {
  cute::SM75_U16x8_LDSM_T::copy(*reinterpret_cast<const cute::uint128_t*>(smem), r[0], r[1], r[2], r[3]);
}

// 16-byte cp.async of one Q / KV unit (common/device.cuh), with the 128-byte L2 prefetch: the other
// units of the same 128 bytes are loaded by the neighbouring threads.
__device__ __forceinline__ void cp_async_unit(uint16_t* smem_dst, const void* gmem_src, bool pred) {
  cp_async_16<L2Prefetch::k128B>(static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst)), gmem_src, pred);
}

// Waits until at most n of this thread's committed groups are pending. n is a constant after unrolling.
// n = 0 waits for everything (the last group of a block).
__device__ __forceinline__ void cp_async_wait_pending(int n) {
  static_assert(kNumLoadGroups == 5, "update the cases below");
  switch (n) {
    case 0: cp_async_wait_all(); break;
    case 1: cp_async_wait_group<1>(); break;
    case 2: cp_async_wait_group<2>(); break;
    case 3: cp_async_wait_group<3>(); break;
    default: cp_async_wait_group<4>(); break;
  }
}

// ---- Scheduling: which tokens of which request this CTA processes -------------------------------------
struct PartRange {
  int begin_req, begin_token, end_req, end_token, begin_split;   // as SchedMetaRow, both reqs inclusive
};

__device__ __forceinline__ PartRange load_part_range(const DecodeParams& params, int part) {
  const SchedMetaRow row = load_sched_meta_row(params, part);   // clamped to the batch
  PartRange pr;
  pr.begin_req = row.begin_req;
  pr.begin_token = row.begin_token;
  pr.end_req = row.end_req;
  pr.end_token = row.end_token;
  pr.begin_split = row.begin_split;
  return pr;
}

// Token range [start, stop) of request req in this part; 0 <= start <= stop <= len.
struct TokenRange {
  int len;     // cache length clamped to [0, kPageSize * max_pages_per_seq]
  int start;
  int stop;
};

__device__ __forceinline__ TokenRange token_range(const DecodeParams& params, const PartRange& pr, int req) {
  TokenRange tr;
  tr.len = clamp_seqlen(params.seqlens[req], params.max_pages_per_seq);
  const int stop = (req == pr.end_req) ? pr.end_token : tr.len;
  tr.stop = min(max(stop, 0), tr.len);
  const int start = (req == pr.begin_req) ? pr.begin_token : 0;
  tr.start = min(start, tr.stop);
  return tr;
}

// A KV block (one page) to process: request req, block index blk (tokens blk*64 .. +64), clipped to
// [start, stop). req < 0: no block.
struct BlockCursor {
  int req;
  int blk;
  int start;
  int stop;
};

// First block of the first request in [req, end_req] with a non-empty token range.
__device__ __forceinline__ BlockCursor first_block_from(const DecodeParams& params, const PartRange& pr, int req) {
  for (; req <= pr.end_req; ++req) {
    const TokenRange tr = token_range(params, pr, req);
    if (tr.start < tr.stop) return BlockCursor{req, tr.start / kBlockN, tr.start, tr.stop};
  }
  return BlockCursor{-1, 0, 0, 0};
}

__device__ __forceinline__ BlockCursor next_block(const DecodeParams& params, const PartRange& pr,
                                                  const BlockCursor& cur) {
  if ((cur.blk + 1) * kBlockN < cur.stop) return BlockCursor{cur.req, cur.blk + 1, cur.start, cur.stop};
  return first_block_from(params, pr, cur.req + 1);
}

// ---- Global -> shared loads --------------------------------------------------------------------------
// This thread's two cache rows of a KV block (local key rows tid/8 and tid/8 + 32, 16-byte unit tid%8 of
// each 64-column chunk). Rows whose token lies outside [start, stop) -- or whose page id is not a valid
// page -- are zero-filled and never read: unused cache slots may hold NaN.
template <typename T>
struct KvRowSources {
  const T* src[kKvRowsPerThread];   // address of column 8*(tid%8) of the row; the kv base when !ok
  bool ok[kKvRowsPerThread];
};

template <typename T>
__device__ __forceinline__ KvRowSources<T> kv_row_sources(const DecodeParams& params, const BlockCursor& blk,
                                                          int hk, int tid) {
  const T* kv = static_cast<const T*>(params.kv);
  // Only pages holding keys of [start, stop) are looked up: other block-table entries may be garbage.
  const int page = params.block_table[static_cast<int64_t>(blk.req) * params.block_table_stride_b + blk.blk];
  const bool page_ok = page >= 0 && page < params.num_pages;
  KvRowSources<T> rows;
#pragma unroll
  for (int i = 0; i < kKvRowsPerThread; ++i) {
    const int row = tid / kKvThreadsPerRow + i * kKvRowsPerPass;
    const int token = blk.blk * kBlockN + row;
    rows.ok[i] = page_ok && token >= blk.start && token < blk.stop;
    rows.src[i] = rows.ok[i] ? kv + static_cast<int64_t>(page) * params.kv_stride_page +
                                   static_cast<int64_t>(row) * params.kv_stride_token +
                                   static_cast<int64_t>(hk) * params.kv_stride_h +
                                   (tid % kKvThreadsPerRow) * kElemsPerCopy
                             : kv;
  }
  return rows;
}

template <typename T>
__device__ __forceinline__ void issue_kv_chunk(SharedStorage& ss, const KvRowSources<T>& rows, int chunk, int tid) {
#pragma unroll
  for (int i = 0; i < kKvRowsPerThread; ++i) {
    const int row = tid / kKvThreadsPerRow + i * kKvRowsPerPass;
    const int col = chunk * kChunkCols + (tid % kKvThreadsPerRow) * kElemsPerCopy;
    cp_async_unit(&ss.kv[row][col], rows.ok[i] ? rows.src[i] + chunk * kChunkCols : rows.src[i], rows.ok[i]);
  }
}

// Element offsets of one query row (token and head) inside one request: in q (columns 0..511) and in q_pe
// (columns 512..575, which the kernels read through their own pointer and strides; params.h).
struct QRowOffsets {
  int64_t q;
  int64_t pe;
};

// Q tile of request req: this thread copies row tid/4 (query row m_block*64 + tid/4), units tid%4 + 4k.
// q_row: offsets of that row; q_row_ok: row < q_rows.
template <typename T>
__device__ __forceinline__ void issue_q_tile(SharedStorage& ss, const DecodeParams& params, int req,
                                             const QRowOffsets& q_row, bool q_row_ok, int tid) {
  const T* q = static_cast<const T*>(params.q);
  const T* src = q + static_cast<int64_t>(req) * params.q_stride_b + q_row.q;
  const T* src_pe = static_cast<const T*>(params.q_pe) + static_cast<int64_t>(req) * params.q_pe_stride_b + q_row.pe;
  const int row = tid / kQThreadsPerRow;
  static_assert(kHeadDimV % kElemsPerCopy == 0, "no copy unit straddles the latent / rope boundary");
#pragma unroll
  for (int k = 0; k < kQCopiesPerThread; ++k) {
    const int col = (tid % kQThreadsPerRow + k * kQThreadsPerRow) * kElemsPerCopy;
    cp_async_unit(&ss.q[row][col], q_row_ok ? (col < kHeadDimV ? src + col : src_pe + (col - kHeadDimV)) : q, q_row_ok);
  }
}

// Issues one commit group of the KV block `rows` (group 0 also carries the Q tile when load_q).
template <typename T>
__device__ __forceinline__ void issue_load_group(SharedStorage& ss, const DecodeParams& params, int group,
                                                 const KvRowSources<T>& rows, bool load_q, int q_req,
                                                 const QRowOffsets& q_row, bool q_row_ok, int tid) {
  if (group == 0) {
    if (load_q) issue_q_tile<T>(ss, params, q_req, q_row, q_row_ok, tid);
    issue_kv_chunk<T>(ss, rows, kRopeChunk, tid);
  } else {
    issue_kv_chunk<T>(ss, rows, group - 1, tid);
    issue_kv_chunk<T>(ss, rows, group - 1 + kPvSteps, tid);
  }
  cp_async_commit();
}

// ---- Tensor-core pieces ---------------------------------------------------------------------------------
// S[16 x 32] += Q[16 rows, chunk] * K[32 keys, chunk]^T over one 64-column chunk.
// q_lds: &q[16*warp_m + lane%8 + 8*((lane/8)%2)][8*(lane/16)]   (A: x4 = rows 0-7/8-15 x k 0-7/8-15)
// k_lds: &kv[32*warp_n + lane%8 + 8*(lane/16)][8*((lane/8)%2)]  (B: x4 = 2 n-tiles x k 0-7/8-15)
template <typename T>
__device__ __forceinline__ void qk_chunk(const uint16_t* q_lds, const uint16_t* k_lds, int chunk,
                                         float (&s_acc)[kWarpSTiles][4]) {
#pragma unroll
  for (int ks = 0; ks < kChunkKSteps; ++ks) {
    const int col = chunk * kChunkCols + ks * kMmaK;
    uint32_t a[4];
    ldsm_x4(q_lds + col, a);
#pragma unroll
    for (int pair = 0; pair < kWarpSTiles / 2; ++pair) {
      uint32_t b[4];
      ldsm_x4(k_lds + pair * 2 * kMmaN * kRowElems + col, b);
      mma_16816<T>(s_acc[2 * pair], a, b[0], b[1]);
      mma_16816<T>(s_acc[2 * pair + 1], a, b[2], b[3]);
    }
  }
}

// O[16 x 64 columns of chunk] += P[16 x 64 keys] * V[64 keys x chunk columns], for P V step `step`.
// p_frag: A fragments of P for the 4 k-steps of 16 keys.
// v_lds: &kv[lane%8 + 8*((lane/8)%2)][256*warp_n + 8*(lane/16)]  (B via .trans: x4 = keys 0-7/8-15 x 2 n-tiles)
template <typename T>
__device__ __forceinline__ void pv_step(const uint16_t* v_lds, int step, const uint32_t (&p_frag)[kPvKSteps][4],
                                        float (&o_acc)[kWarpOTiles][4]) {
#pragma unroll
  for (int ks = 0; ks < kPvKSteps; ++ks) {
#pragma unroll
    for (int pair = 0; pair < kChunkOTiles / 2; ++pair) {
      uint32_t b[4];
      ldsm_x4_trans(v_lds + ks * kMmaK * kRowElems + step * kChunkCols + pair * 2 * kMmaN, b);
      const int tile = step * kChunkOTiles + 2 * pair;
      mma_16816<T>(o_acc[tile], p_frag[ks], b[0], b[1]);
      mma_16816<T>(o_acc[tile + 1], p_frag[ks], b[2], b[3]);
    }
  }
}

// ---- Outputs of a request with no key in this part's range (e.g. cache_seqlens == 0) --------------------
// The empty-row rule (common/device.cuh). Single split: out = 0, lse = +inf. Split: o_accum = 0,
// lse_accum = -inf. All threads cooperate; no shared memory, no barrier.
template <typename T>
__device__ void write_empty_rows(const DecodeParams& params, int req, bool is_split, int64_t sid, int row0, int hk,
                                 int tid) {
  constexpr int kPairsPerRow = kHeadDimV / 2;   // each thread writes element pairs
  static_assert(kPairsPerRow == kNumThreads, "one pair per thread per row");
  const int rows = min(kBlockM, params.q_rows - row0);
  for (int i = 0; i < rows; ++i) {
    const int r = row0 + i;
    const int col = 2 * tid;
    if (!is_split) {
      const QueryRow qr = query_row(params, hk, r);
      *reinterpret_cast<uint32_t*>(out_row<T>(params, req, qr.s, qr.h) + col) = 0u;
      if (tid == 0) *lse_at(params, req, qr.s, qr.h) = kNoKeyLse;
    } else {
      const int64_t acc_row = accum_row(params, sid, hk, r);
      *reinterpret_cast<float2*>(o_accum_row(params, acc_row) + col) = make_float2(0.f, 0.f);
      if (tid == 0) *lse_accum_at(params, acc_row) = kNoKeySplitLse;
    }
  }
}

// ---- The kernel -----------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kNumThreads, 1) portable_decode_kernel(const __grid_constant__ DecodeParams params) {
  static_assert(sizeof(T) == kElemBytes, "16-bit element types only");
  // Let the combine kernel (launched with PDL) get scheduled; its pdl_wait_primary() still waits for
  // this whole grid to complete and its memory to be visible. (No-op below sm_90.)
  pdl_launch_dependents();
  extern __shared__ __align__(128) unsigned char smem_raw[];
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_raw);

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int warp_m = warp % kWarpsM;
  const int warp_n = warp / kWarpsM;
  const int frag_row = lane / 4;   // mma C fragment: rows frag_row and frag_row + 8 ...
  const int frag_col = lane % 4;   // ... columns 2*frag_col, 2*frag_col + 1 of each n-tile
  const int m_block = blockIdx.x;
  const int hk = blockIdx.y;
  const int row0 = m_block * kBlockM;   // first query row of this CTA

  const PartRange pr = load_part_range(params, blockIdx.z);
  if (pr.begin_req > pr.end_req) return;   // part without work (uniform over the CTA)

  // Warp-uniform: a row group whose 16 rows are all >= q_rows skips every MMA and softmax step, but
  // still issues its share of the loads and joins every barrier.
  const bool warp_active = row0 + warp_m * kWarpRows < params.q_rows;

  // Query token of this thread's two fragment rows (for the causal limit).
  int frag_s[2];
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) frag_s[hi] = (row0 + warp_m * kWarpRows + frag_row + 8 * hi) / params.ngroups;

  // The Q row this thread copies (same for every request).
  QRowOffsets q_row{0, 0};
  const int q_load_r = row0 + tid / kQThreadsPerRow;
  const bool q_row_ok = q_load_r < params.q_rows;
  if (q_row_ok) {
    const int s = q_load_r / params.ngroups;
    const int h = hk * params.ngroups + q_load_r % params.ngroups;
    q_row.q = static_cast<int64_t>(s) * params.q_stride_s + static_cast<int64_t>(h) * params.q_stride_h;
    q_row.pe = static_cast<int64_t>(s) * params.q_pe_stride_s + static_cast<int64_t>(h) * params.q_pe_stride_h;
  }

  // ldmatrix base addresses (element pointers into shared memory).
  const int ldsm_row = lane % 8 + 8 * ((lane / 8) % 2);   // A operand / .trans B operand row
  const int ldsm_col = 8 * (lane / 16);
  const uint16_t* q_lds = &ss.q[warp_m * kWarpRows + ldsm_row][ldsm_col];
  const uint16_t* k_lds = &ss.kv[warp_n * kWarpKeys + lane % 8 + 8 * (lane / 16)][8 * ((lane / 8) % 2)];
  const uint16_t* p_lds = &ss.p[warp_m * kWarpRows + ldsm_row][ldsm_col];
  const uint16_t* v_lds = &ss.kv[ldsm_row][warp_n * kWarpOCols + ldsm_col];

  // Prologue: all groups of the part's first block (and its request's Q tile).
  BlockCursor next = first_block_from(params, pr, pr.begin_req);
  KvRowSources<T> next_rows;
  if (next.req >= 0) {
    next_rows = kv_row_sources<T>(params, next, hk, tid);
#pragma unroll
    for (int g = 0; g < kNumLoadGroups; ++g)
      issue_load_group<T>(ss, params, g, next_rows, /*load_q=*/true, next.req, q_row, q_row_ok, tid);
  }

  for (int req = pr.begin_req; req <= pr.end_req; ++req) {
    const TokenRange tr = token_range(params, pr, req);
    const int split_base = params.num_splits[req];
    const bool is_split = params.num_splits[req + 1] - split_base > 1;
    const int64_t sid = split_base + (req == pr.begin_req ? pr.begin_split : 0);   // global split id

    if (tr.start >= tr.stop) {   // nothing visible to any row: no loads were issued for it
      write_empty_rows<T>(params, req, is_split, sid, row0, hk, tid);
      continue;
    }

    // Keys visible to fragment row hi: [tr.start, key_limit[hi]).
    int key_limit[2];
#pragma unroll
    for (int hi = 0; hi < 2; ++hi)
      key_limit[hi] = params.causal ? min(tr.stop, causal_key_end(tr.len, params.seqlen_q, frag_s[hi])) : tr.stop;

    float o_acc[kWarpOTiles][4];
#pragma unroll
    for (int t = 0; t < kWarpOTiles; ++t) o_acc[t][0] = o_acc[t][1] = o_acc[t][2] = o_acc[t][3] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY};   // running max of scaled scores x (log2 units)
    float row_sum[2] = {0.f, 0.f};               // this thread's part of the running sum of 2^(x - max)

    for (int blk = tr.start / kBlockN; blk * kBlockN < tr.stop; ++blk) {
      next = next_block(params, pr, BlockCursor{req, blk, tr.start, tr.stop});

      // ---- 1. S = Q K^T, chunk groups in load order -----------------------------------------------------
      float s_acc[kWarpSTiles][4];
#pragma unroll
      for (int t = 0; t < kWarpSTiles; ++t) s_acc[t][0] = s_acc[t][1] = s_acc[t][2] = s_acc[t][3] = 0.f;
#pragma unroll
      for (int g = 0; g < kNumLoadGroups; ++g) {
        cp_async_wait_pending(kNumLoadGroups - 1 - g);
        __syncthreads();   // group g of every thread has landed
        if (warp_active) {
          if (g == 0) {
            qk_chunk<T>(q_lds, k_lds, kRopeChunk, s_acc);
          } else {
            qk_chunk<T>(q_lds, k_lds, g - 1, s_acc);
            qk_chunk<T>(q_lds, k_lds, g - 1 + kPvSteps, s_acc);
          }
        }
      }

      // ---- 2. mask, scale, block row max ----------------------------------------------------------------
      if (warp_active) {
        const int key0 = blk * kBlockN + warp_n * kWarpKeys + 2 * frag_col;
        float local_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int t = 0; t < kWarpSTiles; ++t) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int hi = e / 2;
            const int key = key0 + t * kMmaN + (e % 2);
            const bool visible = key >= tr.start && key < key_limit[hi];
            s_acc[t][e] = visible ? s_acc[t][e] * params.scale_log2 : -INFINITY;
            local_max[hi] = fmaxf(local_max[hi], s_acc[t][e]);
          }
        }
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
          local_max[hi] = fmaxf(local_max[hi], __shfl_xor_sync(0xffffffffu, local_max[hi], 1));
          local_max[hi] = fmaxf(local_max[hi], __shfl_xor_sync(0xffffffffu, local_max[hi], 2));
          if (frag_col == 0) ss.row_max[warp_n][warp_m * kWarpRows + frag_row + 8 * hi] = local_max[hi];
        }
      }
      __syncthreads();   // row_max visible; every warp is done with Q and with chunk 8 of this block

      if (next.req >= 0) {
        next_rows = kv_row_sources<T>(params, next, hk, tid);
        issue_load_group<T>(ss, params, 0, next_rows, /*load_q=*/next.req != req, next.req, q_row,
                            q_row_ok, tid);
      }

      // ---- 3. online softmax; P -> shared memory ------------------------------------------------------------
      if (warp_active) {
        float alpha[2];
        float ref[2];
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
          const int row = warp_m * kWarpRows + frag_row + 8 * hi;
          const float block_max = fmaxf(ss.row_max[0][row], ss.row_max[1][row]);
          const float new_max = fmaxf(row_max[hi], block_max);
          // All keys so far masked: new_max = -inf. Subtract 0 instead, so that exp2(-inf - ref) = 0 and no
          // (-inf) - (-inf) NaN appears; O and the sum stay exactly 0.
          ref[hi] = new_max == -INFINITY ? 0.f : new_max;
          alpha[hi] = exp2f(row_max[hi] - ref[hi]);   // 0 when row_max = -inf; 1 when the max is unchanged
          row_max[hi] = new_max;
          row_sum[hi] *= alpha[hi];
        }
#pragma unroll
        for (int t = 0; t < kWarpSTiles; ++t) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int hi = e / 2;
            s_acc[t][e] = exp2f(s_acc[t][e] - ref[hi]);   // masked keys: exp2(-inf) = 0
            row_sum[hi] += s_acc[t][e];
          }
        }
#pragma unroll
        for (int t = 0; t < kWarpOTiles; ++t) {
          o_acc[t][0] *= alpha[0];
          o_acc[t][1] *= alpha[0];
          o_acc[t][2] *= alpha[1];
          o_acc[t][3] *= alpha[1];
        }
#pragma unroll
        for (int t = 0; t < kWarpSTiles; ++t) {
          const int col = warp_n * kWarpKeys + t * kMmaN + 2 * frag_col;
          const int row = warp_m * kWarpRows + frag_row;
          *reinterpret_cast<uint32_t*>(&ss.p[row][col]) = ElementOps<T>::pack(s_acc[t][0], s_acc[t][1]);
          *reinterpret_cast<uint32_t*>(&ss.p[row + 8][col]) = ElementOps<T>::pack(s_acc[t][2], s_acc[t][3]);
        }
      }
      __syncthreads();   // P visible

      // ---- 4. O += P V, chunk by chunk; refill freed chunks with the next block -------------------------------
      uint32_t p_frag[kPvKSteps][4];
      if (warp_active) {
#pragma unroll
        for (int ks = 0; ks < kPvKSteps; ++ks) ldsm_x4(p_lds + ks * kMmaK, p_frag[ks]);
      }
#pragma unroll
      for (int step = 0; step < kPvSteps; ++step) {
        if (warp_active) pv_step<T>(v_lds, step, p_frag, o_acc);
        __syncthreads();   // V chunks `step` and `step + 4` are no longer read
        if (next.req >= 0)
          issue_load_group<T>(ss, params, 1 + step, next_rows, false, next.req, q_row, q_row_ok, tid);
      }
    }

    // ---- Epilogue of request req ---------------------------------------------------------------------
    // The two warps of a row group hold partial sums over disjoint keys, scaled to the same running max.
    if (warp_active) {
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        float l = row_sum[hi];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        if (frag_col == 0) ss.row_sum[warp_n][warp_m * kWarpRows + frag_row + 8 * hi] = l;
      }
    }
    // Also orders these row_sum writes after the previous request's reads: between two epilogues with
    // keys there is at least one KV block, i.e. several barriers.
    __syncthreads();
    if (warp_active) {
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const int row = warp_m * kWarpRows + frag_row + 8 * hi;
        const int r = row0 + row;
        if (r >= params.q_rows) continue;
        const float l = ss.row_sum[0][row] + ss.row_sum[1][row];
        const bool no_key = !row_has_key(l);   // the empty-row rule (common/device.cuh): NaN rows are not empty
        const float inv_l = no_key ? 0.f : 1.f / l;
        const float lse = row_lse(row_max[hi], l);   // used only when !no_key
        const QueryRow qr = query_row(params, hk, r);
        const int col0 = warp_n * kWarpOCols + 2 * frag_col;
        if (!is_split) {
          T* out = out_row<T>(params, req, qr.s, qr.h);
#pragma unroll
          for (int t = 0; t < kWarpOTiles; ++t)
            *reinterpret_cast<uint32_t*>(out + col0 + t * kMmaN) =
                ElementOps<T>::pack(o_acc[t][2 * hi] * inv_l, o_acc[t][2 * hi + 1] * inv_l);
          if (warp_n == 0 && frag_col == 0) *lse_at(params, req, qr.s, qr.h) = no_key ? kNoKeyLse : lse;
        } else {
          const int64_t acc_row = accum_row(params, sid, hk, r);
          float* o_acc_out = o_accum_row(params, acc_row) + col0;
#pragma unroll
          for (int t = 0; t < kWarpOTiles; ++t)
            *reinterpret_cast<float2*>(o_acc_out + t * kMmaN) =
                make_float2(o_acc[t][2 * hi] * inv_l, o_acc[t][2 * hi + 1] * inv_l);
          if (warp_n == 0 && frag_col == 0) *lse_accum_at(params, acc_row) = no_key ? kNoKeySplitLse : lse;
        }
      }
    }
  }
}

}  // namespace flashmla_backend::portable
