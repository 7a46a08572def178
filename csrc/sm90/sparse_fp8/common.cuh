// The sm90 sparse (DeepSeek-V3.2) decode kernel (kernel.cuh) but for its consumer warpgroups' loops (lead.cuh): the
// geometry, the measurement switches, the mbarrier waits, the Q tile of a row, the counted blocks of a row piece, the
// producer warps (the gather, the transposition and the group factors) and the epilogue's stores.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/bfloat16.h>
#include <cutlass/cutlass.h>

#include <cstdint>
#include <type_traits>

#include "common/device.cuh"
#include "params.h"
#include "sm90/decode/copies.cuh"
#include "sm90/decode/epilogue.cuh"  // interleaved_value_index
#include "sm90/decode/softmax.cuh"
#include "sm90/decode/tile_work.cuh"
#include "sm90/decode_fp8/config.h"
#include "sm90/decode_fp8/mainloop.cuh"  // warp_arrive, p16_fragment, store_p, load_p_chunk
#include "sm90/decode_fp8/producer.cuh"  // FMLA_SM90_WAIT_TIMEOUT_NS
#include "sm90/decode_fp8/q_tile.cuh"    // split_e4m3x2
#include "sm90/sparse_fp8/gather.cuh"
#include "sm90/sparse_fp8/layout.h"
#include "sm90/sparse_fp8/pv.cuh"
#include "sm90/sparse_fp8/qk.cuh"
#include "sm90/sparse_fp8/timeline.cuh"

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
constexpr int kGatherWarps = 2;         // producer warps 0..1: gather warp w copies tokens 32 w .. 32 w + 31 of a block
constexpr int kTransposeWarps = 2;      // producer warps 2..3: transposer warp t writes part t of each V^T half
static_assert(kGatherWarps == 2 && kTransposeWarps == 2, "the producer's four warps: a half block or a part each");
constexpr int kProducerRegs = 56;

// Measurement switches (FLASHMLA_BACKEND_SPARSE_DEBUG, bits; sparse.cu): each leaves a stage's work out, so the
// results are wrong and only the time means something. None of them may skip a wgmma: a run-time branch around a
// wgmma, or a non-wgmma definition of its accumulator on another path, makes ptxas serialize every wgmma of the kernel
// (its C7515 info; tests/test_device_checks.py fails on it). Bits 8 (no P V) and 32 (no Q K^T) did, and are gone.
enum DebugFlags : int {
  kDebugNoGather = 1,     // the gather warps issue no copies (the stages keep what they held)
  kDebugNoTranspose = 2,  // the transposer warps write no V^T
  kDebugHalfGather = 4,   // gather warp 1 issues no copies: an SM gathers half of each block, as each of a 2-CTA
                          // cluster's SMs would if the pair shared the gather of the M tiles' common tokens
  kDebugNoWords = 16,     // the consumers build no P words (zeros)
  kDebugSuspend = 256,    // every mbarrier wait retries with a suspend-time hint (kSuspendHintNs; measured: no change)
};

// Arrivals of the V^T barriers: vt_full (the transposer warps), vt_empty (a warp of a consumer warpgroup once a
// group's P V of the half completed: a half holds two groups, each read by its own P V, lead.cuh).
constexpr uint32_t kVtFullArrivals = kTransposeWarps;
constexpr uint32_t kGroupsPerVtHalf = 2;
constexpr uint32_t kVtEmptyArrivals = 4 * kGroupsPerVtHalf;

// The mbarrier waits of the dense FP8 kernel (the producer's trap after FMLA_SM90_WAIT_TIMEOUT_NS, the consumers' do
// not: decode_fp8/producer.cuh says why), with the retries' suspend-time hint of the launch (suspend_hint: 0, the
// system's default, unless kDebugSuspend), and its one-arrival-a-warp.
using decode_fp8::warp_arrive;
constexpr uint32_t kSuspendHintNs = 10000000;  // 10 ms: a waiting warp sleeps until the phase completes
__device__ __forceinline__ uint32_t suspend_hint(int debug) { return (debug & kDebugSuspend) ? kSuspendHintNs : 0u; }
template <class Barrier>
__device__ __forceinline__ void consumer_wait(Barrier& bar, uint32_t parity, uint32_t hint) {
  mbarrier_wait<0>(cute::cast_smem_ptr_to_uint(&bar), parity, NoTimeoutAction{}, hint);
}
template <class Barrier>
__device__ __forceinline__ void producer_wait(Barrier& bar, uint32_t parity, uint32_t hint) {
  mbarrier_wait<uint64_t(FMLA_SM90_WAIT_TIMEOUT_NS)>(cute::cast_smem_ptr_to_uint(&bar), parity, NoTimeoutAction{},
                                                     hint);
}

// ------------------------------------------------------------------------------------------------
// The Q tile of a row, one slot t (0..255) at a time: head 64 m + t / 4, latent group t % 4 (128 channels) and rope
// channels 16 (t % 4) .. + 15. q ~ s_r (hi + lo), s_r = 2^ceil(log2(amax / 448)) over the head's latent part (qk.cuh's
// header); heads past h_q get zeros. A thread copies its slot's 16-bit q into the tile (q_slot_copy, cp.async) and,
// once its copies have landed, splits it in place (q_slot_split). Only warpgroup 0 reads the tile (its Q K^T), so
// only the CTA's first row piece is made by both warpgroups (slot tid each); warpgroup 0 makes every later one alone
// (slots t and t + 128): copied once its last Q K^T of the row piece before is complete, split after that row
// piece's stores (lead.cuh).
// ------------------------------------------------------------------------------------------------
// Slot t's 16-bit q copied by cp.async (no commit) into the bytes its terms go to: latent channels 16 c .. + 7 of
// the slot's group where chunk c's hi term goes, 16 c + 8 .. + 15 where its lo term goes, the rope chunks where they
// stay (zeros for heads past h_q). Two e4m3 terms are as many bytes as the 16-bit q, so the tile holds it exactly, and
// the split reads only the bytes its own thread copied: it needs no barrier before it.
template <class SS>
__device__ __forceinline__ void q_slot_copy(const DecodeParams& p, SS& ss, int req, int m_block, int t) {
  const int r = t >> 2, qq = t & 3;
  const int h = m_block * kTileRows + r;
  const bool valid = h < p.num_heads_q;
  const int64_t row = valid ? int64_t(req) * p.q_stride_b + int64_t(h) * p.q_stride_h : 0;
  const int64_t row_pe = valid ? int64_t(req) * p.q_pe_stride_b + int64_t(h) * p.q_pe_stride_h : 0;
  const cutlass::bfloat16_t* src = reinterpret_cast<const cutlass::bfloat16_t*>(p.q) + row + 128 * qq;
  const cutlass::bfloat16_t* src_pe = reinterpret_cast<const cutlass::bfloat16_t*>(p.q_pe) + row_pe + 16 * qq;
  const uint32_t lat = cute::cast_smem_ptr_to_uint(ss.q_latent), rope = cute::cast_smem_ptr_to_uint(ss.q_rope);
  CUTLASS_PRAGMA_UNROLL
  for (int c = 0; c < 8; ++c) {
    const uint32_t off = lat + gather_chunk_offset(r, 8 * qq + c);
    decode::cp_async_16(off, src + 16 * c, valid);
    decode::cp_async_16(off + kLatentBytes, src + 16 * c + 8, valid);
  }
  CUTLASS_PRAGMA_UNROLL
  for (int c = 0; c < 2; ++c) decode::cp_async_16(rope + sw128_offset(r, 2 * qq + c), src_pe + 8 * c, valid);
}
// The 16 latent channels of a slot's chunk at tile offset off, as q_slot_copy put them (8 where the hi term goes, 8
// where the lo term goes): 8 words of bf16 pairs.
template <class SS>
__device__ __forceinline__ void q_chunk_words(SS& ss, uint32_t off, uint32_t (&w)[8]) {
  const uint4 a = *reinterpret_cast<const uint4*>(ss.q_latent + off);
  const uint4 b = *reinterpret_cast<const uint4*>(ss.q_latent + kLatentBytes + off);
  w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
}
// Slot t split in place: its 16-bit q, where q_slot_copy put it, replaced by its two e4m3 terms and its rope by the
// rope divided by s_r; the head's s_r (the max over its four slots: lanes t ^ 1 and t ^ 2) into row_scale_log2.
// The chunks are a loop of two a trip, not unrolled: the split runs once a row piece, after code that has pushed its
// own out of the instruction cache. In ncu's samples at b128 top-k 128 (every cache flushed before the launch) the
// unrolled form (about 1,000 instructions a slot, 8,168 in the kernel against 6,792) stalled 72% of its samples on
// instruction fetch (no_inst) and the kernel took 49.3 µs; with this loop 43.0 (66% of the loop's samples on the short
// scoreboard: its conversions and loads; four chunks a trip 46.4). In CUDA-graph replays, where the code stays cached
// from the call before, the two forms are within 1% but at b = 1 (top-k 2048 3% slower, top-k 512 5% faster):
// docs/perf/journal.md, 2026-12-02 (afternoon).
template <class SS>
__device__ __forceinline__ void q_slot_split(const DecodeParams& p, SS& ss, int t) {
  constexpr int kTrip = 2;  // chunks a trip
  const int r = t >> 2, qq = t & 3;
  // max |x| over the head's 512 latent values (four slots): bf16 pairs, |.| and max (NaN dropped, as fmaxf does)
  __nv_bfloat162 m2 = __float2bfloat162_rn(0.f);
  CUTLASS_PRAGMA_UNROLL
  for (int c = 0; c < 8; ++c) {
    uint32_t w[8];
    q_chunk_words(ss, gather_chunk_offset(r, 8 * qq + c), w);
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < 8; ++k) m2 = __hmax2(m2, __habs2(*reinterpret_cast<const __nv_bfloat162*>(&w[k])));
  }
  float amax = fmaxf(__low2float(m2), __high2float(m2));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  const float s = amax > 0.f ? exp2f(ceilf(log2f(amax / decode_fp8::kE4m3Max))) : 1.f;
  const float inv = 1.f / s;
#pragma unroll 1
  for (int c0 = 0; c0 < 8; c0 += kTrip) {
    CUTLASS_PRAGMA_UNROLL
    for (int cc = 0; cc < kTrip; ++cc) {  // chunk 8 qq + c0 + cc: 16 latent channels, words 2 k and 2 k + 1 in word k
      const uint32_t off = gather_chunk_offset(r, 8 * qq + c0 + cc);
      uint32_t w[8];
      q_chunk_words(ss, off, w);
      uint32_t hi[4], lo[4];
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < 4; ++k) {  // decode_fp8::split_e4m3x2: the difference in fp16
        uint32_t h0, l0, h1, l1;
        decode_fp8::split_e4m3x2(__uint_as_float(w[2 * k] << 16) * inv,
                                 __uint_as_float(w[2 * k] & 0xffff0000u) * inv, h0, l0);
        decode_fp8::split_e4m3x2(__uint_as_float(w[2 * k + 1] << 16) * inv,
                                 __uint_as_float(w[2 * k + 1] & 0xffff0000u) * inv, h1, l1);
        hi[k] = h0 | (h1 << 16);
        lo[k] = l0 | (l1 << 16);
      }
      *reinterpret_cast<uint4*>(ss.q_latent + off) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
      *reinterpret_cast<uint4*>(ss.q_latent + kLatentBytes + off) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
  }
  CUTLASS_PRAGMA_UNROLL
  for (int c = 0; c < 2; ++c) {  // rope chunk 2 qq + c: 8 channels, divided by s (a power of two: exact)
    uint4* const at = reinterpret_cast<uint4*>(ss.q_rope + sw128_offset(r, 2 * qq + c));
    uint4 o = *at;
    __nv_bfloat162* v = reinterpret_cast<__nv_bfloat162*>(&o);
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < 4; ++k) {
      const float2 f = __bfloat1622float2(v[k]);
      v[k] = __floats2bfloat162_rn(f.x * inv, f.y * inv);
    }
    *at = o;
  }
  if (qq == 0) ss.row_scale_log2[r] = p.scale_log2 * s;
}

// The CTA's first Q tile, slot t of one warpgroup (both warpgroups make it, lead.cuh), made visible to the tensor
// cores; the caller's named barrier follows.
template <class SS>
__device__ __forceinline__ void first_q_tile_slot(const DecodeParams& p, SS& ss, int req, int m_block, int t) {
  q_slot_copy(p, ss, req, m_block, t);
  decode::cp_async_commit();
  decode::cp_async_wait_all();  // this thread's own copies: the split reads only them
  FMLA_TL(ss, kTlLead, kTlFirstQLoaded, t == 0);
  q_slot_split(p, ss, t);
  cutlass::arch::fence_view_async_shared();  // Q written by st.shared, read by wgmma
}

// Named barriers of the consumer warpgroups: the CTA's first Q tile (warpgroup 1 arrives after its half, warpgroup 0
// waits for it), and warpgroup 0's own once it loaded a later tile alone.
constexpr uint32_t kBarFirstQ = 0;
constexpr uint32_t kBarLeadQ = 1;

// A consumer thread's two accumulator rows (a 64-row accumulator's rows g and g + 8 of its warp's 16): their place in
// the M tile (row_in_tile: the Q tile's and the shared row arrays' index) and among the query rows (rows).
__device__ __forceinline__ void thread_rows(int tid_in_wg, int m_block, int (&row_in_tile)[2], int (&rows)[2]) {
  const int lane = tid_in_wg & 31;
  row_in_tile[0] = 16 * (tid_in_wg / 32) + lane / 4;
  row_in_tile[1] = row_in_tile[0] + 8;
  rows[0] = m_block * kTileRows + row_in_tile[0];
  rows[1] = m_block * kTileRows + row_in_tile[1];
}

// The blocks of request piece w that hold counted entries (topk_length cuts a row; params.h), and the end of the
// counted entries (`stop`, request-local). The same in every role of the CTA.
__device__ __forceinline__ int counted_blocks(const DecodeParams& p, const decode::RequestPiece& w, int& stop) {
  int n = w.stop;
  if (p.topk_length != nullptr) n = min(n, max(__ldg(p.topk_length + w.req / p.sparse_seqlen_q), 0));
  stop = n;
  return n > w.start ? (n + kBlockTokens - 1) / kBlockTokens - w.first_page : 0;
}
// Scores of the entries that name no token to -inf (a block whose 64 entries all count skips the loop).
template <class FragS>
__device__ __forceinline__ void mask_block(FragS& S, uint64_t mask, int lane) {
  if (mask == ~uint64_t(0)) return;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(S); ++i) {
    const int token = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
    if (!((mask >> token) & 1u)) S(i) = -INFINITY;
  }
}

template <class FragS>
__device__ __forceinline__ void block_row_max(const FragS& S, float (&mx)[2]) {
  mx[0] = mx[1] = -INFINITY;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(S); ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], S(i));
  mx[0] = decode::quad_max(mx[0]);
  mx[1] = decode::quad_max(mx[1]);
}

// The online softmax of a block's scores S (the thread's two rows), in place: the entries its mask leaves out to
// -inf, the running max m (log2 domain, sl2 the rows' scale) and the rows' factor sc = exp2(m_before - m_after), the
// sums l taken to the new max and added to, and S = P = 2^(S sl2 - m + 8) (config.h: kPScaleLog2).
template <class FragS>
__device__ __forceinline__ void online_softmax(FragS& S, uint64_t mask, int lane, const float (&sl2)[2], float (&m)[2],
                                               float (&l)[2], float (&sc)[2]) {
  mask_block(S, mask, lane);
  float mx[2], m_use[2];
  block_row_max(S, mx);
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < 2; ++v) {
    float m_new;
    decode::update_max(m[v], mx[v], sl2[v], m_new, m_use[v], sc[v]);
    m[v] = m_new;
    l[v] *= sc[v];
  }
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(S); ++i) {
    const int v = (i >> 1) & 1;
    S(i) = fast_exp2(fmaf(S(i), sl2[v], decode_fp8::kPScaleLog2 - m_use[v]));
    l[v] += S(i);
  }
}

// Whether O of groups with these ratios must be multiplied (rescale_group) by the row factors r and the ratios: not
// where all are 1 in the warp.
template <int kN>
__device__ __forceinline__ bool rescale_needed(const float (&r)[2], const float (&ratio)[kN]) {
  bool any = r[0] != 1.f || r[1] != 1.f;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kN; ++i) any = any || ratio[i] != 1.f;
  return __any_sync(0xffffffffu, any);
}
template <class FragO>
__device__ __forceinline__ void rescale_group(FragO& o, const float (&r)[2], float ratio) {
  const float x[2] = {r[0] * ratio, r[1] * ratio};
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(o); ++i) o(i) *= x[(i >> 1) & 1];
}

// The two-term e4m3 words of P[:, t] s[t, g] F_g of one group (pv.cuh: p_chunk_words_f16) from the group's s F pairs
// that the transposer warps made for the block (sf_g: the group's [4][8] words; a thread's eight are at sf_g + 8 (lane
// % 4), two a chunk) and P in fp16 by chunks (p_chunk(c, p4): the thread's P words 4 c .. 4 c + 3), zeros under the
// kDebugNoWords switch.
template <class PChunk>
__device__ __forceinline__ void build_words(PChunk&& p_chunk, const uint32_t* sf_g, int lane, int debug,
                                            uint32_t (&words)[kPTerms][8]) {
  if (debug & kDebugNoWords) {
    CUTLASS_PRAGMA_UNROLL
    for (int t = 0; t < kPTerms; ++t) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < 8; ++i) words[t][i] = 0u;
    }
    return;
  }
  const uint2* sf = reinterpret_cast<const uint2*>(sf_g + 8 * (lane & 3));
  CUTLASS_PRAGMA_UNROLL
  for (int c = 0; c < 4; ++c) {
    uint32_t p4[4];
    p_chunk(c, p4);
    const uint2 v = sf[c];
    p_chunk_words_f16<kPTerms>(p4, *reinterpret_cast<const __half2(*)[2]>(&v), c, words);
  }
}

// ------------------------------------------------------------------------------------------------
// Producer warpgroup
// ------------------------------------------------------------------------------------------------
// The gather warps (producer warps 0..1, gwarp 0..1): half gwarp of block g into stage g % kStages (gather.cuh), once
// the stage's previous block was released (empty), full[s] completing when both warps' copies have landed and their
// lane 0 wrote their half of the block's mask (ss.mask[SS::mask_slot(g)], its 32-bit half gwarp).
// Each lane loads its entry of the block's index row first (gather.cuh: half_index), after the wait for the stage, and
// the copies wait for that load. Loading the next block's entry before the wait instead (across row pieces too) was
// measured 0.3-2.5% slower at every shape of the benchmark table (docs/perf/journal.md, 2026-12-02): the load's latency
// it hides is not on the path, its instructions are (the gather's instruction stream is: docs/kernel-design.md). So it
// was again with warpgroup 0's overlapped order (1-1.5% slower at top-k 2048), although the next block is late at
// warpgroup 0's softmax in about nine blocks of ten there (journal, 2026-12-02 night).
constexpr uint32_t kFullArrivals = kGatherWarps * (32 + 1);  // each gather warp's lanes (copies landed) and lane 0

template <class SS>
__device__ __forceinline__ void gather_warp(const DecodeParams& p, SS& ss, const SchedMetaRow& meta,
                                            int begin_req, int end_req, int m_block, int gwarp, int lane, int debug) {
  const uint8_t* cache = reinterpret_cast<const uint8_t*>(p.kv);
  const uint32_t hint = suspend_hint(debug);
  uint32_t g = 0;
  for (int req = begin_req; req <= end_req; ++req) {
    const decode::RequestPiece w = decode::make_request_piece(p, meta, req, m_block);
    const int* row = p.indices + int64_t(req) * p.indices_stride;
    int stop;
    const int nblk = counted_blocks(p, w, stop);
    for (int blk = 0; blk < nblk; ++blk, ++g) {
      const int s = int(g % kStages);
      if (g >= uint32_t(kStages)) producer_wait(ss.empty[s], ((g / kStages) - 1) & 1u, hint);
      FMLA_TL(ss, kTlGather, kTlStageFree, gwarp == 0 && lane == 0);
      const uint32_t stage_addr = cute::cast_smem_ptr_to_uint(ss.stage[s]);
      const uint32_t mask =
          ((debug & kDebugNoGather) || ((debug & kDebugHalfGather) && gwarp == 1))
              ? ~0u
              : gather_half_warp(stage_addr, cache, p.num_kv_tokens,
                                 half_index(row, (w.first_page + blk) * kBlockTokens, stop, gwarp, lane), gwarp, lane);
      // full[s] completes when both warps' lanes' copies have landed (their cp.async arrivals) and their lane 0
      // wrote its half of the mask.
      cp_async_arrive_on(cute::cast_smem_ptr_to_uint(&ss.full[s]));
      if (lane == 0) {
        reinterpret_cast<uint32_t*>(&ss.mask[SS::mask_slot(g)])[gwarp] = mask;
        ss.full[s].arrive();
      }
      FMLA_TL(ss, kTlGather, kTlCopies, gwarp == 0 && lane == 0);
    }
  }
  decode::cp_async_wait_all();  // no copy outlives the warp
  FMLA_TL_FINISH(ss, kTlGather, gwarp == 0 && lane == 0);
}

// The group factors of a block, made once by transposer warp t for groups g0 = 2 t, g0 + 1 instead of by each
// consumer thread (measured: the kernel 10-12% faster at every shape of the benchmark table; docs/perf/journal.md):
// the block's largest scale of each group over its 64 tokens (0 for skipped entries, gathered as zeros); the group's
// running factor F over the row piece (pv.cuh: group_factor; 0 until a block with a token sets it, and it only goes
// down), taken from the previous block's (ss.gfac[prev], none at the row piece's first block: first); the ratio by
// which O_g must be multiplied where the factor went down (a power of two; 1 where it did not); (ratio, F) go to
// ss.gfac[s][g], and the words' pairs sf = (s[t, g] F_g, s[t + 1, g] F_g) in f16x2 (pv.cuh: p_chunk_words_f16; F_g 1
// until set) to ss.sf[s][g][q][a] for tokens t = 8 a + 2 q: lane l has tokens 2 l and 2 l + 1 (a = l / 4, q = l % 4).
// The stage's vt_full arrivals that follow publish them to the consumer warpgroups.
template <class SS>
__device__ __forceinline__ void block_group_factors(SS& ss, int s, int prev, bool first, int twarp, int lane) {
  const int g0 = 2 * twarp;
  const float* scales = reinterpret_cast<const float*>(ss.stage[s] + kScalesAt);
  const float2 x = *reinterpret_cast<const float2*>(scales + (2 * lane) * kGroups + g0);
  const float2 y = *reinterpret_cast<const float2*>(scales + (2 * lane + 1) * kGroups + g0);
  // (ratio, F) of each group after the previous block; F 0 at a row piece's first block
  const float4 before =
      first ? make_float4(1.f, 0.f, 1.f, 0.f) : *reinterpret_cast<const float4*>(&ss.gfac[prev][g0][0]);
  const float xs[2] = {x.x, x.y}, ys[2] = {y.x, y.y}, F_before[2] = {before.y, before.w};
  float F[2], ratio[2];
  CUTLASS_PRAGMA_UNROLL
  for (int gg = 0; gg < 2; ++gg) {
    float ms = fmaxf(fmaxf(0.f, xs[gg]), ys[gg]);
    CUTLASS_PRAGMA_UNROLL
    for (int o = 16; o >= 1; o >>= 1) ms = fmaxf(ms, __shfl_xor_sync(0xffffffffu, ms, o));
    F[gg] = F_before[gg];
    ratio[gg] = 1.f;
    if (ms > 0.f) {
      const float f = group_factor(ms, exp2f(decode_fp8::kPScaleLog2));
      if (F[gg] == 0.f) {
        F[gg] = f;
      } else if (f < F[gg]) {
        ratio[gg] = power_of_two_ratio(f, F[gg]);
        F[gg] = f;
      }
    }
    const float f = factor_in_use(F[gg]);
    const __half2 pair = __floats2half2_rn(xs[gg] * f, ys[gg] * f);
    ss.sf[s][g0 + gg][lane & 3][lane >> 2] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  if (lane == 0) *reinterpret_cast<float4*>(&ss.gfac[s][g0][0]) = make_float4(ratio[0], F[0], ratio[1], F[1]);
}

// The transposer warps (producer warps 2..3, twarp 0..1): the block's group factors (block_group_factors), then part
// twarp of V^T of every block (pv.cuh: transpose_part), half 0 then half 1, half h of block g into slot h once block
// g - 1's half h was released by its P V. Each warp takes every block in order, so its wait for use g of a slot follows
// its wait for use g - 1: the parity wait cannot pass on a phase two behind.
template <class SS>
__device__ __forceinline__ void transpose_warp(const DecodeParams& p, SS& ss, const SchedMetaRow& meta, int begin_req,
                                               int end_req, int m_block, int twarp, int lane, int debug) {
  const uint32_t hint = suspend_hint(debug);
  uint32_t g = 0;
  for (int req = begin_req; req <= end_req; ++req) {
    const decode::RequestPiece w = decode::make_request_piece(p, meta, req, m_block);
    int stop;
    const int nblk = counted_blocks(p, w, stop);
    for (int blk = 0; blk < nblk; ++blk, ++g) {
      const int s = int(g % kStages);
      producer_wait(ss.full[s], (g / kStages) & 1u, hint);
      FMLA_TL(ss, kTlTranspose, kTlTFull, twarp == 0 && lane == 0);
      const uint32_t stage_addr = cute::cast_smem_ptr_to_uint(ss.stage[s]);
      block_group_factors(ss, s, int((g + kStages - 1) % kStages), blk == 0, twarp, lane);
      FMLA_TL(ss, kTlTranspose, kTlFactors, twarp == 0 && lane == 0);
#pragma unroll 1
      for (int h = 0; h < 2; ++h) {
        if (g > 0) producer_wait(ss.vt_empty[h], (g - 1) & 1u, hint);
        if (!(debug & kDebugNoTranspose))
          transpose_part(stage_addr, cute::cast_smem_ptr_to_uint(ss.vt[h]), h, twarp, lane);
        cutlass::arch::fence_view_async_shared();  // stmatrix writes, read by wgmma
        warp_arrive(ss.vt_full[h], lane);
        FMLA_TL(ss, kTlTranspose, kTlHalf, twarp == 0 && lane == 0);
      }
      warp_arrive(ss.empty[s], lane);
    }
  }
  FMLA_TL_FINISH(ss, kTlTranspose, twarp == 0 && lane == 0);
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


// The epilogue of a row piece (lead.cuh): out = O_g / (F_g l), or the split's fp32 partials, with inv_out's factor
// 1 / (F_g l) of a group (0 for a row without a token, whose out is 0), and the rows' lse (store_lse); l: the rows'
// final sums of P (its 2^8 included), m: their running max (log2 domain). A row without a token gets lse +inf (a
// split: -inf).
__device__ __forceinline__ void inv_out(float F, const float (&l)[2], float (&inv)[2]) {
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < 2; ++v) inv[v] = row_has_key(l[v]) ? 1.f / (factor_in_use(F) * l[v]) : 0.f;
}
__device__ __forceinline__ void store_lse(const DecodeParams& p, const decode::RequestPiece& w, const int (&rows)[2],
                                          int lane, const float (&l)[2], const float (&m)[2]) {
  if ((lane & 3) != 0) return;
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < 2; ++v) {
    if (rows[v] >= p.q_rows) continue;
    const float lse = row_has_key(l[v]) ? row_lse(m[v] - decode_fp8::kPScaleLog2, l[v])
                                        : (w.split ? kNoKeySplitLse : kNoKeyLse);
    if (w.split) {
      p.lse_accum[int64_t(w.split_id) * p.q_rows + rows[v]] = lse;
    } else {
      p.lse[int64_t(w.req) * p.lse_stride_b + int64_t(rows[v]) * p.lse_stride_h] = lse;
    }
  }
}
}  // namespace flashmla_backend::sm90::sparse_fp8
