// sm90 sparse (DeepSeek-V3.2) decode kernel on fp8_ds_mla tokens: Q K^T and P V on e4m3 wgmma with the tokens'
// group scales folded into the scores and into P, never dequantizing the cache (docs/perf/journal.md: the design,
// the precision model and the probes that measured its arithmetic).
//
// Work: params.h's sparse mapping. A "request" is one query token's index row; the tile scheduler's metadata (from
// the rows' counted lengths) gives each CTA column `part` a run of rows, the first and last possibly in pieces of
// 64-entry blocks, and the combine kernel merges the pieces. grid = (ceil(h_q / 64), 1, num_sm_parts): CTA
// (m, 0, part) computes heads [64 m, 64 m + 64) of its rows. One CTA per SM, 384 threads:
//   warpgroup 2 (producer): warp 0 gathers each block of 64 indexed tokens into a stage (gather.cuh: cp.async, the
//     entries that name no token zero-filled and left out of the block's mask); warps 1..3 transpose the stage's
//     latent part into V^T, half 0 (groups 0, 1) then half 1 (groups 2, 3) (pv.cuh), one slot a half.
//   warpgroups 0 and 1 (consumers): warpgroup w owns latent groups 2 w and 2 w + 1: their part of the scores (two
//     e4m3 terms of q a group, times the tokens' group scale) and half of the rope product (qk.cuh:
//     sparse_qk_groups); the two parts are exchanged through shared memory and added (fp32 addition commutes, so
//     both warpgroups hold the same scores, bit for bit, and run the same online softmax); then P V of its two
//     groups with two e4m3 terms of P s[t, g] under a group factor that only goes down (pv.cuh), into O of its
//     256 output columns.
// The epilogue writes out = O_g / (F_g l) and lse (warpgroup 0), or a split's fp32 partials for the combine.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/bfloat16.h>
#include <cutlass/cutlass.h>

#include <cstdint>

#include "common/device.cuh"
#include "params.h"
#include "sm90/decode/copies.cuh"
#include "sm90/decode/epilogue.cuh"  // interleaved_value_index
#include "sm90/decode/softmax.cuh"
#include "sm90/decode/tile_work.cuh"
#include "sm90/decode_fp8/config.h"
#include "sm90/sparse_fp8/gather.cuh"
#include "sm90/sparse_fp8/layout.h"
#include "sm90/sparse_fp8/pv.cuh"
#include "sm90/sparse_fp8/qk.cuh"

#ifndef FMLA_SM90_WAIT_TIMEOUT_NS
#define FMLA_SM90_WAIT_TIMEOUT_NS 4000000000ull
#endif

namespace flashmla_backend::sm90::sparse_fp8 {

using namespace cute;
using NamedBarrier = cutlass::arch::NamedBarrier;

constexpr int kNumThreads = 384;
constexpr int kNumConsumerThreads = 256;
constexpr int kWgThreads = 128;
constexpr int kTileRows = 64;           // heads of an M tile
constexpr int kStages = 2;              // gathered blocks in flight
constexpr int kQTerms = 2;              // e4m3 terms of q (the journal's precision model asks for two)
constexpr int kPTerms = 2;              // e4m3 terms of P s[t, g]
constexpr int kTransposeWarps = 3;      // producer warps 1..3
constexpr int kConsumerRegs = 224;
constexpr int kProducerRegs = 56;
static_assert(2 * kWgThreads * kConsumerRegs + kWgThreads * kProducerRegs <= decode_fp8::kCtaRegisters,
              "register split exceeds the CTA's allocation");

struct alignas(1024) SharedStorage {
  alignas(1024) uint8_t q_latent[kQTerms * kLatentBytes];    // term t at t * kLatentBytes (qk.cuh's Q tile)
  alignas(1024) uint8_t q_rope[kRopeBytes];
  alignas(1024) uint8_t stage[kStages][kStageBytes];        // block g in stage g % kStages (layout.h)
  alignas(1024) uint8_t vt[2][decode_fp8::kVtHalfBytes];    // V^T half h (groups 2 h, 2 h + 1), read by warpgroup h
  alignas(16) float sx[2][kTileRows * kTileRows];           // warpgroup w's part of a block's scores
  uint64_t mask[kStages];                                    // the block's entries that name a token (gather.cuh)
  float row_scale_log2[kTileRows];                           // softmax scale (log2) x the row's q split scale
  // full[s]: block landed in stage s (the gather warp's lanes, kFullArrivals). empty[s]: the 8 consumer warps (scores and P built)
  // and the 3 transposer warps are done with stage s. vt_full[h]: V^T half h written (3 transposer warps).
  // vt_empty[h]: warpgroup h's P V of the half completed (its 4 warps).
  cutlass::arch::ClusterBarrier full[kStages];
  cutlass::arch::ClusterBarrier empty[kStages];
  cutlass::arch::ClusterBarrier vt_full[2];
  cutlass::arch::ClusterBarrier vt_empty[2];
};
constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;
static_assert(kSmemBytes <= decode_fp8::kMaxSmemPerBlock, "shared memory plan exceeds 227 KB");

constexpr uint32_t kFullArrivals = 32 + 1;  // the gather warp's lanes (their copies landed) and lane 0 (the mask)
constexpr uint32_t kEmptyArrivals = 8 + kTransposeWarps;
constexpr uint32_t kVtFullArrivals = kTransposeWarps;
constexpr uint32_t kVtEmptyArrivals = 4;

// Named barriers (IDs relative to CUTLASS's reserved ones), all used in their non-.aligned form: the two consumer
// warpgroups run different instantiations of consumer_loop, so they reach each barrier at different instructions
// (decode_fp8/kernel.cuh: consumers_sync says more). kScoresReady: both warpgroups wrote their part of the
// block's scores. kScoresFree + w: warpgroup 1 - w read warpgroup w's part (it arrives), so warpgroup w may write
// the next one (it waits): one arrival a block, one wait a block after the CTA's first and one at the end.
enum class Bar : uint32_t { kConsumers = 0, kScoresReady = 1, kScoresFree = 2 };

// Measurement switches (FLASHMLA_BACKEND_SPARSE_DEBUG, bits; sparse.cu): each leaves a stage's work out, so the
// results are wrong and only the time means something.
enum DebugFlags : int {
  kDebugNoGather = 1,     // the gather warp issues no copies (the stages keep what they held)
  kDebugNoTranspose = 2,  // the transposer warps write no V^T
  kDebugNoExchange = 4,   // the consumers do not hand their score parts over (each keeps its own)
  kDebugNoPv = 8,         // the consumers issue no P V
  kDebugNoWords = 16,     // the consumers build no P words (zeros)
  kDebugNoQk = 32,        // the consumers issue no Q K^T (scores 0)
};

__device__ __forceinline__ void consumers_sync() {
  NamedBarrier(kNumConsumerThreads, uint32_t(Bar::kConsumers)).arrive_and_wait_unaligned();
}

// Waits for completion (parity) of an mbarrier; the producer's waits trap after FMLA_SM90_WAIT_TIMEOUT_NS, the
// consumers' do not (decode_fp8/producer.cuh says why).
template <class Barrier>
__device__ __forceinline__ void producer_wait(Barrier& bar, uint32_t parity) {
  mbarrier_wait<uint64_t(FMLA_SM90_WAIT_TIMEOUT_NS)>(cute::cast_smem_ptr_to_uint(&bar), parity);
}
template <class Barrier>
__device__ __forceinline__ void consumer_wait(Barrier& bar, uint32_t parity) {
  mbarrier_wait<0>(cute::cast_smem_ptr_to_uint(&bar), parity);
}
template <class Barrier>
__device__ __forceinline__ void warp_arrive(Barrier& bar, int lane) {
  __syncwarp();
  if (lane == 0) bar.arrive();
}

// ------------------------------------------------------------------------------------------------
// The Q tile of a row: the 256 consumer threads, thread t: head 64 m + t / 4, latent group t % 4 (128 channels) and
// rope channels 16 (t % 4) .. + 15. q ~ s_r (hi + lo), s_r = 2^ceil(log2(amax / 448)) over the head's latent part
// (qk.cuh's header); heads past h_q get zeros.
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ void load_q_tile(const DecodeParams& p, SharedStorage& ss, int req, int m_block, int tid) {
  const int r = tid >> 2, qq = tid & 3;
  const int h = m_block * kTileRows + r;
  const bool valid = h < p.num_heads_q;
  uint4 lat[16], rope[2];
  if (valid) {
    const uint4* src = reinterpret_cast<const uint4*>(reinterpret_cast<const cutlass::bfloat16_t*>(p.q) +
                                                      int64_t(req) * p.q_stride_b + int64_t(h) * p.q_stride_h) +
                       16 * qq;
    const uint4* src_pe = reinterpret_cast<const uint4*>(
                              reinterpret_cast<const cutlass::bfloat16_t*>(p.q_pe) + int64_t(req) * p.q_pe_stride_b +
                              int64_t(h) * p.q_pe_stride_h) +
                          2 * qq;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 16; ++i) lat[i] = __ldg(src + i);
    rope[0] = __ldg(src_pe);
    rope[1] = __ldg(src_pe + 1);
  } else {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 16; ++i) lat[i] = make_uint4(0, 0, 0, 0);
    rope[0] = rope[1] = make_uint4(0, 0, 0, 0);
  }
  float amax = 0.f;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < 16; ++i) {
    const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&lat[i]);
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < 4; ++k) {
      const float2 f = __bfloat1622float2(v[k]);
      amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  const float s = amax > 0.f ? exp2f(ceilf(log2f(amax / decode_fp8::kE4m3Max))) : 1.f;
  const float inv = 1.f / s;
  CUTLASS_PRAGMA_UNROLL
  for (int c = 0; c < 8; ++c) {  // chunk 8 qq + c: 16 latent channels
    float x[16];
    CUTLASS_PRAGMA_UNROLL
    for (int half = 0; half < 2; ++half) {
      const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&lat[2 * c + half]);
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < 4; ++k) {
        const float2 f = __bfloat1622float2(v[k]);
        x[8 * half + 2 * k] = f.x * inv;
        x[8 * half + 2 * k + 1] = f.y * inv;
      }
    }
    uint32_t hi[4], lo[4];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < 4; ++k) {
      hi[k] = decode_fp8::f32x4_to_e4m3x4(x[4 * k], x[4 * k + 1], x[4 * k + 2], x[4 * k + 3]);
      float b[4];
      decode_fp8::e4m3x4_to_f32x4(hi[k], b);
      lo[k] = decode_fp8::f32x4_to_e4m3x4(x[4 * k] - b[0], x[4 * k + 1] - b[1], x[4 * k + 2] - b[2],
                                          x[4 * k + 3] - b[3]);
    }
    const uint32_t off = gather_chunk_offset(r, 8 * qq + c);
    *reinterpret_cast<uint4*>(ss.q_latent + off) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    *reinterpret_cast<uint4*>(ss.q_latent + kLatentBytes + off) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
  }
  CUTLASS_PRAGMA_UNROLL
  for (int c = 0; c < 2; ++c) {  // rope chunk 2 qq + c: 8 channels, divided by s (a power of two: exact)
    uint4 o;
    const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&rope[c]);
    __nv_bfloat162* w = reinterpret_cast<__nv_bfloat162*>(&o);
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < 4; ++k) {
      const float2 f = __bfloat1622float2(v[k]);
      w[k] = __floats2bfloat162_rn(f.x * inv, f.y * inv);
    }
    *reinterpret_cast<uint4*>(ss.q_rope + sw128_offset(r, 2 * qq + c)) = o;
  }
  if (qq == 0) ss.row_scale_log2[r] = p.scale_log2 * s;
}

// The blocks of request piece w that hold counted entries (topk_length cuts a row; params.h), and the end of the
// counted entries (`stop`, request-local). The same in every role of the CTA.
__device__ __forceinline__ int counted_blocks(const DecodeParams& p, const decode::RequestPiece& w, int& stop) {
  int n = w.stop;
  if (p.topk_length != nullptr) n = min(n, max(__ldg(p.topk_length + w.req / p.sparse_seqlen_q), 0));
  stop = n;
  return n > w.start ? (n + kBlockTokens - 1) / kBlockTokens - w.first_page : 0;
}

// ------------------------------------------------------------------------------------------------
// Producer warpgroup
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ void gather_warp(const DecodeParams& p, SharedStorage& ss, const SchedMetaRow& meta,
                                            int begin_req, int end_req, int m_block, int lane, int debug) {
  const uint8_t* cache = reinterpret_cast<const uint8_t*>(p.kv);
  uint32_t g = 0;
  for (int req = begin_req; req <= end_req; ++req) {
    const decode::RequestPiece w = decode::make_request_piece(p, meta, req, m_block);
    const int* row = p.indices + int64_t(req) * p.indices_stride;
    int stop;
    const int nblk = counted_blocks(p, w, stop);
    for (int blk = 0; blk < nblk; ++blk, ++g) {
      const int s = int(g % kStages);
      if (g >= uint32_t(kStages)) producer_wait(ss.empty[s], ((g / kStages) - 1) & 1u);
      const uint32_t stage_addr = cute::cast_smem_ptr_to_uint(ss.stage[s]);
      const uint64_t mask = (debug & kDebugNoGather)
                                ? ~uint64_t(0)
                                : gather_block_warp(stage_addr, cache, p.num_kv_tokens, row,
                                                    (w.first_page + blk) * kBlockTokens, stop, lane);
      // full[s] completes when the 32 lanes' copies have landed (their cp.async arrivals) and lane 0 wrote the mask.
      cp_async_arrive_on(cute::cast_smem_ptr_to_uint(&ss.full[s]));
      if (lane == 0) {
        ss.mask[s] = mask;
        ss.full[s].arrive();
      }
    }
  }
  decode::cp_async_wait_all();  // no copy outlives the warp
}

__device__ __forceinline__ void transpose_warp(const DecodeParams& p, SharedStorage& ss, const SchedMetaRow& meta,
                                               int begin_req, int end_req, int m_block, int twarp, int lane,
                                               int debug) {
  const uint32_t vt_addr = cute::cast_smem_ptr_to_uint(ss.vt[0]);
  uint32_t g = 0;
  for (int req = begin_req; req <= end_req; ++req) {
    const decode::RequestPiece w = decode::make_request_piece(p, meta, req, m_block);
    int stop;
    const int nblk = counted_blocks(p, w, stop);
    for (int blk = 0; blk < nblk; ++blk, ++g) {
      const int s = int(g % kStages);
      producer_wait(ss.full[s], (g / kStages) & 1u);
      const uint32_t stage_addr = cute::cast_smem_ptr_to_uint(ss.stage[s]);
      CUTLASS_PRAGMA_UNROLL
      for (int h = 0; h < 2; ++h) {
        if (g > 0) producer_wait(ss.vt_empty[h], (g - 1) & 1u);
        if (!(debug & kDebugNoTranspose))
          transpose_units(stage_addr, vt_addr, h * kUnitsPerHalf, (h + 1) * kUnitsPerHalf, twarp, kTransposeWarps,
                          lane);
        cutlass::arch::fence_view_async_shared();  // stmatrix writes, read by wgmma
        warp_arrive(ss.vt_full[h], lane);
      }
      warp_arrive(ss.empty[s], lane);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Consumer warpgroup kWG
// ------------------------------------------------------------------------------------------------
// Output columns [128 g, 128 g + 128) of the thread's rows from O_g (accumulator columns in V^T's row order,
// decode_fp8/layout.h: vt_row_column), times inv[v].
template <class FragO>
__device__ __forceinline__ void store_group(const DecodeParams& p, const decode::RequestPiece& w, int g,
                                            const int (&rows)[2], int lane, const FragO& o, const float (&inv)[2]) {
  const int col0 = 128 * g + 4 * (lane & 3);
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < 2; ++v) {
    const int r = rows[v];
    if (r >= p.q_rows) continue;
    if (!w.split) {
      cutlass::bfloat16_t* out = reinterpret_cast<cutlass::bfloat16_t*>(p.out) + int64_t(w.req) * p.out_stride_b +
                                 int64_t(r) * p.out_stride_h + col0;
      CUTLASS_PRAGMA_UNROLL
      for (int a = 0; a < size(o) / 8; ++a) {
        float x[4];
        decode::interleaved_quad(o, a, v, inv[v], x);
        cutlass::bfloat16_t quad[4] = {cutlass::bfloat16_t(x[0]), cutlass::bfloat16_t(x[1]),
                                       cutlass::bfloat16_t(x[2]), cutlass::bfloat16_t(x[3])};
        *reinterpret_cast<uint2*>(out + 16 * a) = *reinterpret_cast<const uint2*>(quad);
      }
    } else {
      float* oacc = p.o_accum + (int64_t(w.split_id) * p.q_rows + r) * kHeadDimV + col0;
      CUTLASS_PRAGMA_UNROLL
      for (int a = 0; a < size(o) / 8; ++a) {
        float x[4];
        decode::interleaved_quad(o, a, v, inv[v], x);
        *reinterpret_cast<float4*>(oacc + 16 * a) = make_float4(x[0], x[1], x[2], x[3]);
      }
    }
  }
}

template <int kWG>
__device__ __forceinline__ void consumer_loop(const DecodeParams& p, SharedStorage& ss, const SchedMetaRow& meta,
                                              int begin_req, int end_req, int m_block, int tid, int debug) {
  const int tid_in_wg = tid % kWgThreads;
  const int lane = tid & 31;
  const int row_in_tile[2] = {16 * (tid_in_wg / 32) + lane / 4, 16 * (tid_in_wg / 32) + lane / 4 + 8};
  const int rows[2] = {m_block * kTileRows + row_in_tile[0], m_block * kTileRows + row_in_tile[1]};
  constexpr int kG0 = 2 * kWG;  // this warpgroup's groups: kG0, kG0 + 1
  uint8_t* vt_half = ss.vt[kWG];

  typename QkTypes::TiledMmaLatent mma_s;
  typename PvTypes::TiledMma mma_o;
  uint32_t g = 0;
  for (int req = begin_req; req <= end_req; ++req) {
    const decode::RequestPiece w = decode::make_request_piece(p, meta, req, m_block);
    load_q_tile(p, ss, req, m_block, tid);
    cutlass::arch::fence_view_async_shared();  // Q written by st.shared, read by wgmma
    consumers_sync();
    const float sl2[2] = {ss.row_scale_log2[row_in_tile[0]], ss.row_scale_log2[row_in_tile[1]]};

    Tensor o0 = partition_fragment_C(mma_o, Shape<Int<kTileRows>, Int<128>>{});  // O of group kG0
    Tensor o1 = partition_fragment_C(mma_o, Shape<Int<kTileRows>, Int<128>>{});  // O of group kG0 + 1
    clear(o0);
    clear(o1);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float F[2] = {0.f, 0.f};  // the groups' factors; 0: none yet

    int stop;
    const int nblk = counted_blocks(p, w, stop);
    for (int blk = 0; blk < nblk; ++blk, ++g) {
      const int s = int(g % kStages);
      consumer_wait(ss.full[s], (g / kStages) & 1u);
      cutlass::arch::fence_view_async_shared();  // the gather's cp.async writes (generic proxy), read by wgmma
      uint8_t* stage = ss.stage[s];
      Tensor S = partition_fragment_C(mma_s, Shape<Int<kTileRows>, Int<kBlockTokens>>{});
      if (debug & kDebugNoQk) {
        clear(S);
      } else {
        Tensor tmp = partition_fragment_C(mma_s, Shape<Int<kTileRows>, Int<kBlockTokens>>{});
        sparse_qk_groups<kQTerms, kG0, 2, 2 * kWG, 2>(tid_in_wg, ss.q_latent, ss.q_rope, stage, S, tmp);
      }
      // ---- the other warpgroup's part of the scores ----
      if (g > 0) NamedBarrier(kNumConsumerThreads, uint32_t(Bar::kScoresFree) + kWG).arrive_and_wait_unaligned();
      {
        float4* mine = reinterpret_cast<float4*>(ss.sx[kWG]);
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < size(S) / 4; ++c)
          mine[c * kWgThreads + tid_in_wg] = make_float4(S(4 * c), S(4 * c + 1), S(4 * c + 2), S(4 * c + 3));
      }
      NamedBarrier(kNumConsumerThreads, uint32_t(Bar::kScoresReady)).arrive_and_wait_unaligned();
      if (!(debug & kDebugNoExchange)) {
        const float4* other = reinterpret_cast<const float4*>(ss.sx[1 - kWG]);
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < size(S) / 4; ++c) {
          const float4 x = other[c * kWgThreads + tid_in_wg];
          S(4 * c) += x.x;
          S(4 * c + 1) += x.y;
          S(4 * c + 2) += x.z;
          S(4 * c + 3) += x.w;
        }
      }
      NamedBarrier(kNumConsumerThreads, uint32_t(Bar::kScoresFree) + (1 - kWG)).arrive_unaligned();

      // ---- mask, online softmax: P = 2^(S sl2 - m + 8) ----
      const uint64_t mask = ss.mask[s];
      float mx[2] = {-INFINITY, -INFINITY};
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(S); ++i) {
        const int token = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
        if (!((mask >> token) & 1u)) S(i) = -INFINITY;
        mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], S(i));
      }
      float sc[2], m_use[2];
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < 2; ++v) {
        float m_new;
        decode::update_max(m[v], decode::quad_max(mx[v]), sl2[v], m_new, m_use[v], sc[v]);
        m[v] = m_new;
        l[v] *= sc[v];
      }
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(S); ++i) {
        const int v = (i >> 1) & 1;
        S(i) = fast_exp2(fmaf(S(i), sl2[v], decode_fp8::kPScaleLog2 - m_use[v]));
        l[v] += S(i);
      }

      // ---- the groups' factors (only ever lowered: O_g times the ratio, a power of two) and P's words ----
      const float* scales = reinterpret_cast<const float*>(stage + kScalesAt);
      float ratio[2];
      CUTLASS_PRAGMA_UNROLL
      for (int gg = 0; gg < 2; ++gg) {
        float ms = 0.f;  // the block's largest scale of the group (0 for skipped entries: zero-filled)
        CUTLASS_PRAGMA_UNROLL
        for (int a = 0; a < 8; ++a) {
          CUTLASS_PRAGMA_UNROLL
          for (int e = 0; e < 2; ++e) ms = fmaxf(ms, scales[(8 * a + 2 * (lane & 3) + e) * kGroups + kG0 + gg]);
        }
        ms = decode::quad_max(ms);
        ratio[gg] = 1.f;
        if (ms > 0.f) {
          const float f = group_factor(ms, exp2f(decode_fp8::kPScaleLog2));
          if (F[gg] == 0.f) {
            F[gg] = f;
          } else if (f < F[gg]) {
            ratio[gg] = f / F[gg];
            F[gg] = f;
          }
        }
      }
      {
        const bool any = __any_sync(0xffffffffu, sc[0] != 1.f || sc[1] != 1.f || ratio[0] != 1.f || ratio[1] != 1.f);
        if (any) {
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(o0); ++i) {
            const float r = sc[(i >> 1) & 1];
            o0(i) *= r * ratio[0];
            o1(i) *= r * ratio[1];
          }
        }
      }
      uint32_t words0[kPTerms][8], words1[kPTerms][8];
      if (debug & kDebugNoWords) {
        CUTLASS_PRAGMA_UNROLL
        for (int t = 0; t < kPTerms; ++t) {
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < 8; ++i) words0[t][i] = words1[t][i] = 0u;
        }
      } else {
        p_group_words<kPTerms>(S, scales, kG0, F[0] == 0.f ? 1.f : F[0], lane, words0);
        p_group_words<kPTerms>(S, scales, kG0 + 1, F[1] == 0.f ? 1.f : F[1], lane, words1);
      }
      warp_arrive(ss.empty[s], lane);  // scores, mask and scales read

      // ---- O_g += P_g V_g ----
      consumer_wait(ss.vt_full[kWG], g & 1u);
      if (!(debug & kDebugNoPv)) {
        sparse_pv_group<kPTerms>(tid_in_wg, words0, vt_half, o0);
        sparse_pv_group<kPTerms>(tid_in_wg, words1, vt_half + decode_fp8::kVtHalfBytes / 2, o1);
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(o0);
      warpgroup_fence_operand(o1);
      warp_arrive(ss.vt_empty[kWG], lane);
    }

    // ---- epilogue ----
    if (req == end_req) pdl_launch_dependents();
    float inv[2][2];
    float lse[2];
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 2; ++v) {
      l[v] = decode::quad_sum(l[v]);
      const bool has_key = row_has_key(l[v]);
      lse[v] = has_key ? row_lse(m[v] - decode_fp8::kPScaleLog2, l[v]) : (w.split ? kNoKeySplitLse : kNoKeyLse);
      CUTLASS_PRAGMA_UNROLL
      for (int gg = 0; gg < 2; ++gg) inv[gg][v] = has_key ? 1.f / ((F[gg] == 0.f ? 1.f : F[gg]) * l[v]) : 0.f;
    }
    store_group(p, w, kG0, rows, lane, o0, inv[0]);
    store_group(p, w, kG0 + 1, rows, lane, o1, inv[1]);
    if (kWG == 0 && (lane & 3) == 0) {
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < 2; ++v) {
        if (rows[v] >= p.q_rows) continue;
        if (w.split) {
          p.lse_accum[int64_t(w.split_id) * p.q_rows + rows[v]] = lse[v];
        } else {
          p.lse[int64_t(w.req) * p.lse_stride_b + int64_t(rows[v]) * p.lse_stride_h] = lse[v];
        }
      }
    }
    consumers_sync();  // both warpgroups are past their last wgmma of the row: the Q tile may be rewritten
  }
  // Balance the score hand-off barrier: the other warpgroup arrived once more than this one waited.
  if (g > 0) NamedBarrier(kNumConsumerThreads, uint32_t(Bar::kScoresFree) + kWG).arrive_and_wait_unaligned();
}

__global__ void __launch_bounds__(kNumThreads, 1) sm90_sparse_fp8_decode_kernel(const __grid_constant__ DecodeParams params,
                                                                                      int debug) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const DecodeParams& p = params;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = cute::cast_smem_ptr_to_uint(smem_raw);
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_raw + ((1024 - (raw_addr % 1024)) % 1024));

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
      ss.empty[s].init(kEmptyArrivals);
    }
    for (int h = 0; h < 2; ++h) {
      ss.vt_full[h].init(kVtFullArrivals);
      ss.vt_empty[h].init(kVtEmptyArrivals);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (wg == 2) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    const int warp = (tid - kNumConsumerThreads) / 32;
    if (warp == 0) {
      gather_warp(p, ss, cta.meta, cta.begin_req, cta.end_req, m_block, lane, debug);
    } else {
      transpose_warp(p, ss, cta.meta, cta.begin_req, cta.end_req, m_block, warp - 1, lane, debug);
    }
  } else if (wg == 0) {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    consumer_loop<0>(p, ss, cta.meta, cta.begin_req, cta.end_req, m_block, tid, debug);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    consumer_loop<1>(p, ss, cta.meta, cta.begin_req, cta.end_req, m_block, tid, debug);
  }
#else
  if (threadIdx.x == 0) printf("flashmla_backend: sm90 sparse decode kernel was not compiled for sm_90a\n");
  __trap();
#endif
}

}  // namespace flashmla_backend::sm90::sparse_fp8
