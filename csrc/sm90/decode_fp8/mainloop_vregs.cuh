// Consumer warpgroups of the V-in-registers tile (vregs.h: TraitsVR): Q K^T on e4m3 wgmma (qk_block of mainloop.cuh;
// two q terms in the accurate mode, one in the fast mode), the online softmax, and P V as O^T = V^T P^T with V^T read
// from the KV stage into registers: on fp16 wgmma with V widened (accurate), or on e4m3 wgmma with V's bytes only
// permuted and P in e4m3 (fast; vt_half_tile_words8).
//
// The seesaw of mainloop.cuh: blocks in pairs, warpgroup 0 multiplies block b0 by Q and decides m0, warpgroup 1 block
// b0 + 1 and m1; warpgroup 0 accumulates value columns [0, 256) of both blocks, warpgroup 1 columns [256, 512). Each
// writes its block's P in fp16 to pt[0] / pt[1] (the B operand of both warpgroups' products) and computes
//   warpgroup 0: O_L = ((O_L sc0) + V0L^T P0^T) sc1 + V1L^T P1^T
//   warpgroup 1: O_R = ((O_R sc0) + V0R^T P0^T) sc1 + V1R^T P1^T
// where P0 is relative to m0 and P1 to m1, and sc0, sc1 are the rows' factors of the step (columns of O^T: a thread's
// 16 columns are 16 query rows, read from scale0 / scale1). A step of warpgroup w: its block's softmax and P, O^T sc0,
// the P V of block b0, the wait for it and O^T sc1, its next Q K^T, then the P V of block b0 + 1 (queued behind the
// Q K^T, so the tensor cores have work while the half-tiles' words are built). Both warpgroups read block b0's V
// first, so its stage is released early in the step (the copy of block b0 + 3 goes there).
//
// The reference max of a row moves only when a block's max exceeds it by more than kLazyMaxLog2 (LazyMax):
// with O^T a warp's lanes hold all 64 rows, so a rescale of O is skipped only when no row of the tile moved, and with
// the exact max most steps would rescale. P = exp2(s - m + kPScaleLog2) then stays below 2^(8 + kLazyMaxLog2), within
// fp16's range; the result is the same function (l and O are both relative to the reference).
//
// A O^T tile (64 value columns) is the A operand of m64n64k16 fp16 wgmma: per warp 16 value columns, wgmma row g =
// column 2 g and row g + 8 = column 2 g + 1 (layout.h: vt_row_column's order, here on the rows). One
// ldmatrix.x4.trans of the 64B-swizzled stage (matrix j = 8 keys x 16 value columns) gives a lane the bytes of keys
// 2t, 2t + 1 of columns 2g, 2g + 1; a prmt pairs them by column and cvt.rn.f16x2.e4m3x2 widens each pair
// (checks/vregs_probe.cu checks the mapping against fp64 on a GPU).
#pragma once

#include <cuda_fp16.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include <cstdint>

#include "common/device.cuh"
#include "params.h"
#include "sm90/decode/softmax.cuh"
#include "sm90/decode/tile_work.cuh"
#include "sm90/decode_fp8/config.h"
#include "sm90/decode_fp8/layout.h"
#include "sm90/decode_fp8/mainloop.cuh"
#include "sm90/decode_fp8/producer.cuh"
#include "sm90/decode_fp8/vregs.h"

namespace flashmla_backend::sm90::decode_fp8 {

using namespace cute;

// The reference max moves when a block's max is more than 2^6 above it (log2 domain).
constexpr float kLazyMaxLog2 = 6.f;
static_assert(kPScaleLog2 + kLazyMaxLog2 < 15.f, "P must stay within fp16's range");

// The Max policy of softmax_block0 / softmax_block1 (mainloop.cuh) for this tile.
struct LazyMax {
  static __device__ __forceinline__ void update(float m_old, float blk_max, float scale_log2, float& m_new,
                                                float& m_use, float& rescale) {
    const float b = blk_max * scale_log2;
    m_new = b > m_old + kLazyMaxLog2 ? b : m_old;  // m_old = -inf: any key moves it; a NaN max does not
    m_use = m_new == -INFINITY ? 0.f : m_new;
    rescale = m_new == m_old ? 1.f : fast_exp2(m_old - m_use);  // from -inf: 0 (O and l are 0 then)
  }
};

// O^T of a consumer warpgroup: four tiles of 64 value columns (tile m: columns 256 wg + 64 m ..), 32 fp32 each.
template <class T>
struct OTAcc {
  using Frag = decltype(partition_fragment_C(typename T::TiledMmaOT{}, Shape<_64, Int<kBlockM>>{}));
  Frag t[4];
  __device__ __forceinline__ void clear_all() {
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < 4; ++m) cute::clear(t[m]);
  }
  __device__ __forceinline__ void fence() {
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < 4; ++m) warpgroup_fence_operand(t[m]);
  }
};

// The 16 query rows (columns of O^T) of a thread's O^T values: value i of a tile is row 8 (i >> 2) + 2 (lane % 4) +
// (i & 1), factor index 2 (i >> 2) + (i & 1).
__device__ __forceinline__ int ot_col_index(int i) { return 2 * (i >> 2) + (i & 1); }

// O^T *= the rows' factors (scale: 64 floats in shared memory), skipped by a warp when every factor its lanes read is 1.
template <class T>
__device__ __forceinline__ void rescale_cols(OTAcc<T>& o, const float* scale, int lane) {
  float f[16];
  bool moved = false;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < 8; ++j) {
    const float2 v = *reinterpret_cast<const float2*>(scale + 8 * j + 2 * (lane & 3));
    f[2 * j] = v.x;
    f[2 * j + 1] = v.y;
    moved |= v.x != 1.f || v.y != 1.f;
  }
  if (__any_sync(0xffffffffu, moved)) {
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < 4; ++m) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(o.t[m]); ++i) o.t[m](i) *= f[ot_col_index(i)];
    }
  }
}

// P (the S accumulator's exponentials, as p16_fragment's words: word 2 j + rh = row g + 8 rh of the warp's 16, keys
// 8 j + 2 t, + 1) into a (64 rows, 64 keys) fp16 tile with 128B swizzle: four stmatrix.x4, matrix k of store n = rows
// 16 warp + 8 (k & 1) .. + 7, keys 8 (2 n + (k >> 1)) .. + 7, the lane supplying row lane % 8 of matrix lane / 8.
__device__ __forceinline__ void store_pt(uint32_t pt_addr, int warp, int lane, const uint32_t (&words)[16]) {
  const int mi = lane >> 3;
  const int row = 16 * warp + 8 * (mi & 1) + (lane & 7);
  CUTLASS_PRAGMA_UNROLL
  for (int n = 0; n < 4; ++n) {
    const uint32_t w[4] = {words[4 * n], words[4 * n + 1], words[4 * n + 2], words[4 * n + 3]};
    stsm_x4(pt_addr + sw128_offset(row, 2 * n + (mi >> 1)), w);
  }
}

// The fast mode's P (p_fragment's e4m3 words: word 4 kk + q = row g + 8 (q & 1) of the warp's 16, positions
// 32 kk + 16 (q >> 1) + 4 t .. + 3 in the key order of mainloop.cuh: p_words) into a (64 rows, 64 positions) e4m3 tile
// with 64B swizzle: two stmatrix.x4 (a b16 matrix is 8 rows x 16 bytes, a lane's register row lane / 4, bytes
// 4 (lane % 4) ..: exactly a word's place), matrix q of store kk = rows 16 warp + 8 (q & 1) .. + 7, 16-byte chunk
// 2 kk + (q >> 1), the lane supplying row lane % 8 of matrix lane / 8.
__device__ __forceinline__ void store_pt8(uint32_t pt_addr, int warp, int lane, const uint32_t (&words)[8]) {
  const int mi = lane >> 3;
  const int row = 16 * warp + 8 * (mi & 1) + (lane & 7);
  CUTLASS_PRAGMA_UNROLL
  for (int kk = 0; kk < 2; ++kk) {
    const uint32_t w[4] = {words[4 * kk], words[4 * kk + 1], words[4 * kk + 2], words[4 * kk + 3]};
    stsm_x4(pt_addr + sw64_offset(row, 2 * kk + (mi >> 1)), w);
  }
}

// The byte selectors of a block's keys for the lane's ldmatrix registers. Register j of the load at keys 32 hh holds
// keys k = 32 hh + 8 j + 2 t (bytes 0: column 2g, 1: column 2g + 1) and k + 1 (bytes 2, 3); prmt with selector
// 0x3120 orders them (k, k + 1 of column 2g | the same of column 2g + 1), the two halves that cvt widens. A key at or
// past `valid` (the block's first key no row of the tile sees, minus the block's first key) takes byte 4 instead, the
// zero operand's: the cache may hold NaN there, and 0 x NaN is NaN.
__device__ __forceinline__ void key_selectors(int valid, int lane, uint32_t (&sel)[8]) {
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < 8; ++r) {
    const int k = 32 * (r >> 2) + 8 * (r & 3) + 2 * (lane & 3);
    const uint32_t k0 = k < valid ? 0x0100u : 0x0404u;      // nibbles 0 and 2 (output bytes 0 and 2): key k
    const uint32_t k1 = k + 1 < valid ? 0x3020u : 0x4040u;  // nibbles 1 and 3: key k + 1
    sel[r] = k0 | k1;
  }
}

// The ldmatrix registers of half-tile u of a block's V^T half (tile m = u / 2: value columns 256 half + 64 m .., the
// warp's 16 in chunk `warp` of piece 4 half + m; keys 32 (u % 2) ..): one ldmatrix.x4.trans, matrix j = keys
// 32 (u % 2) + 8 j ...
__device__ __forceinline__ void vt_half_tile_load(uint32_t stage_addr, int half, int u, int warp, int lane,
                                                  uint32_t (&r)[4]) {
  ldsm_x4_trans(stage_addr + uint32_t((4 * half + u / 2) * kPieceBytes) + sw64_offset(32 * (u & 1) + lane, warp), r);
}
// Its 8 fp16 A words: k16 step s (keys 32 (u % 2) + 16 s ..) in words 4 s .. 4 s + 3 (row g: column 2g, row g + 8:
// column 2g + 1; keys 2t, 2t + 1, then 8 + 2t, 9 + 2t).
__device__ __forceinline__ void vt_half_tile_words(const uint32_t (&r)[4], const uint32_t* sel, uint32_t (&a)[8]) {
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < 4; ++j) {
    const uint32_t x = __byte_perm(r[j], 0u, sel[j]);
    const int s = j >> 1;
    a[4 * s + 2 * (j & 1)] = decode::e4m3x2_to_f16x2(uint16_t(x));
    a[4 * s + 2 * (j & 1) + 1] = decode::e4m3x2_to_f16x2(uint16_t(x >> 16));
  }
}

// The fast mode (e4m3 words, k32 steps): word 0 is row g (column 2g) at positions 4t .. 4t + 3, which p_words gives
// keys 2t, 2t + 1, 8 + 2t, 9 + 2t: bytes 0 and 2 of registers 0 and 1, one prmt (0x6420); word 1 is row g + 8 (column
// 2g + 1), bytes 1 and 3 (0x7531); words 2 and 3 the same of registers 2 and 3 (keys 16 ..). No byte is free for a
// zero operand here, so the keys at or past `valid` (block_masks8) are cleared by an AND mask, in a block that has
// such keys only (`masked`, warp-uniform). checks/vregs_probe.cu checks this mapping against fp64 on a GPU.
// mask[2 hh + h]: the bytes of keys 32 hh + 16 h + {2t, 2t + 1, 8 + 2t, 9 + 2t} that are below `valid`.
__device__ __forceinline__ void block_masks8(int valid, int lane, uint32_t (&mask)[4]) {
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < 4; ++j) {
    uint32_t m = 0;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 4; ++i) {
      const int k = 16 * j + 2 * (lane & 3) + (i & 1) + 8 * (i >> 1);
      m |= k < valid ? 0xffu << (8 * i) : 0u;
    }
    mask[j] = m;
  }
}
__device__ __forceinline__ void vt_half_tile_words8(const uint32_t (&r)[4], bool masked, const uint32_t* mask,
                                                    uint32_t (&a)[4]) {
  a[0] = __byte_perm(r[0], r[1], 0x6420u);
  a[1] = __byte_perm(r[0], r[1], 0x7531u);
  a[2] = __byte_perm(r[2], r[3], 0x6420u);
  a[3] = __byte_perm(r[2], r[3], 0x7531u);
  if (masked) {
    a[0] &= mask[0];
    a[1] &= mask[0];
    a[2] &= mask[1];
    a[3] &= mask[1];
  }
}

// A half-tile's A words, as the (64 value columns, 32 keys) fragment of the O^T product: 8 fp16 words, or 4 e4m3.
template <class T>
struct OTWords {
  using E = typename T::PvElement;
  using ALayout = decltype(make_layout(partition_shape_A(typename T::TiledMmaOT{}, Shape<_64, _32>{})));
  static constexpr int kWords = int(cosize_v<ALayout> * sizeof(E)) / 4;
  static_assert(kWords == (T::kQFp8 ? 4 : 8), "a thread's A words of 64 value columns x 32 keys");
  uint32_t w[kWords];
  __device__ __forceinline__ auto tensor() {
    return make_tensor(make_rmem_ptr<E>(reinterpret_cast<E*>(&w[0])), ALayout{});
  }
  __device__ __forceinline__ void fence() {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kWords; ++i) asm volatile("" : "+r"(w[i]));
  }
};

// acc += A (a half-tile's words) x P^T (pt: a (64 rows, 64 keys) fp16 tile; keys 32 hh ..); one commit group.
template <class T, class Frag>
__device__ __forceinline__ void ot_product(OTWords<T>& a, uint8_t* pt, int hh, int tid, Frag& acc) {
  typename T::TiledMmaOT mma;
  auto thr = mma.get_slice(tid);
  const uint32_t z = opaque_zero();
  using E = typename T::PvElement;
  Tensor sP = make_tensor(make_smem_ptr(reinterpret_cast<E*>(pt) + z), typename T::SmemLayoutPT{});
  Tensor tB = thr.partition_fragment_B(sP);  // (MMA, 1, 4) k16 steps (fp16), (MMA, 1, 2) k32 steps (e4m3)
  Tensor tA = a.tensor();                    // (MMA, 1, 2) (fp16), (MMA, 1, 1) (e4m3)
  constexpr int kSteps = decltype(size<2>(tA))::value;
  mma.accumulate_ = GMMA::ScaleOut::One;
  a.fence();
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  CUTLASS_PRAGMA_UNROLL
  for (int kb = 0; kb < kSteps; ++kb) cute::gemm(mma, tA(_, _, kb), tB(_, _, kSteps * hh + kb), acc);
  warpgroup_commit_batch();
  warpgroup_fence_operand(acc);
  a.fence();
}

// O^T_half += V^T_half P^T of the block in stage `stage` (keys selected by sel), P^T at pt: eight half-tiles, each
// one commit group, their words in a ring of three (the words of u built while u - 1 and u - 2 run), the ldmatrix of
// u + 1 issued before the product of u. The wait for u - 3 also waits for any group the caller issued before (the
// next Q K^T: mainloop_vregs). Leaves up to three groups in flight.
template <class T>
__device__ __forceinline__ void pv_block_vregs(typename T::SharedStorage& ss, int stage, int half, uint8_t* pt,
                                               const uint32_t (&sel)[8], int tid, OTAcc<T>& o) {
  const int warp = tid / 32, lane = tid & 31;
  const uint32_t stage_addr = cute::cast_smem_ptr_to_uint(ss.kv.data()) + uint32_t(stage * kTileBytes);
  OTWords<T> a[3];
  uint32_t r[4];
  vt_half_tile_load(stage_addr, half, 0, warp, lane, r);
  const bool masked = T::kQFp8 && sel[4] != 0u;  // e4m3: sel[0..3] the block's masks, sel[4] whether any applies
  CUTLASS_PRAGMA_UNROLL
  for (int u = 0; u < 8; ++u) {
    if (u >= 3) warpgroup_wait<2>();  // u - 3's product, which read a[u % 3], completed
    if constexpr (T::kQFp8) {
      vt_half_tile_words8(r, masked, &sel[2 * (u & 1)], a[u % 3].w);
    } else {
      vt_half_tile_words(r, &sel[4 * (u & 1)], a[u % 3].w);
    }
    if (u < 7) vt_half_tile_load(stage_addr, half, u + 1, warp, lane, r);
    ot_product<T>(a[u % 3], pt, u & 1, tid, o.t[u / 2]);
  }
}

// One P tile to pt (fp16 with 128B swizzle, or the fast mode's e4m3 with 64B swizzle), fenced for the products
// (async proxy).
template <class T, class Frag>
__device__ __forceinline__ void write_pt(const Frag& s, uint8_t* pt, int tid) {
  if constexpr (T::kQFp8) {
    uint32_t words[8];
    p_fragment(s, words);
    store_pt8(cute::cast_smem_ptr_to_uint(pt), tid / 32, tid & 31, words);
  } else {
    uint32_t words[16];
    p16_fragment(s, words);
    store_pt(cute::cast_smem_ptr_to_uint(pt), tid / 32, tid & 31, words);
  }
  cutlass::arch::fence_view_async_shared();
}

// The keys of a block (first key tok) that the O^T product may read: the fp16 words' byte selectors (key_selectors),
// or the e4m3 words' masks with sel[4] telling whether the block has a key to clear (block_masks8).
template <class T>
__device__ __forceinline__ void block_key_words(int valid, int lane, uint32_t (&sel)[8]) {
  if constexpr (T::kQFp8) {
    uint32_t m[4];
    block_masks8(valid, lane, m);
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < 4; ++j) sel[j] = m[j];
    sel[4] = valid < kBlockN ? 1u : 0u;
  } else {
    key_selectors(valid, lane, sel);
  }
}

// How a row's reference max moves: exactly for the fast mode (e4m3 P must stay below 448; with the exact max P <=
// 2^kPScaleLog2 = 256), lazily for fp16 P (LazyMax above).
template <class T>
using VRegsMax = std::conditional_t<T::kQFp8, ExactMax, LazyMax>;

// ------------------------------------------------------------------------------------------------
// The request piece's main loop of consumer warpgroup kWG (blocks in pairs, run_steps of mainloop.cuh).
// ------------------------------------------------------------------------------------------------
template <class T, int kWG>
__device__ __forceinline__ void mainloop_vregs(typename T::SharedStorage& ss, const RequestPiece& w, const RowInfo& ri,
                                               int tid, uint32_t g_base, OTAcc<T>& o, float (&row_sum)[2]) {
  const int lane = tid & 31;
  const int nblk = padded_blocks(w.num_blocks);
  if (nblk == 0) {
    o.clear_all();
    return;
  }
  uint8_t* pt0 = ss.pt.data();
  uint8_t* pt1 = ss.pt.data() + T::kPtBytes;

  typename T::TiledMmaQK mma_qk;
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});  // 32 fp32

  qk_block<T>(tid, ss, g_base + uint32_t(kWG), tSrS);
  warpgroup_wait<0>();
  warpgroup_fence_operand(tSrS);
  o.clear_all();

  auto step = [&](auto next_c, int b0) CUTLASS_LAMBDA_FUNC_INLINE {
    constexpr bool kNext = decltype(next_c)::value;  // blocks b0 + 2 and b0 + 3 exist
    const uint32_t g0 = g_base + uint32_t(b0);
    const int tok0 = (w.first_page + b0) * kBlockN;
    const float sl2[2] = {ss.row_scale_log2[ri.row[0]], ss.row_scale_log2[ri.row[1]]};
    uint32_t sel[8];

    // ---- softmax of the own block (mainloop.cuh), P to pt[kWG] ----
    if constexpr (kWG == 0) {
      float sc0[2];
      softmax_block0<T, VRegsMax<T>>(ss, w, ri, lane, tok0, sl2, tSrS, row_sum, sc0);
      // P0 -> pt[0], once warpgroup 1's P0 V product of the last step completed.
      if (b0 > 0) NamedBarrier::sync(kNumConsumerThreads, uint32_t(NamedBarriers::kP0Free));
      write_pt<T>(tSrS, pt0, tid);
      NamedBarrier::sync(kThreadsPerWarpGroup, uint32_t(NamedBarriers::kOwnP0));
      NamedBarrier::arrive(kNumConsumerThreads, uint32_t(NamedBarriers::kP0Ready));
      rescale_cols<T>(o, ss.scale0, lane);
    } else {
      // m1 against warpgroup 0's m0; P1 and scale1 published together (kScale1Ready).
      float sc1[2], sc01[2];
      softmax_block1<false, VRegsMax<T>>(ss, w, ri, lane, tok0 + kBlockN, sl2, tSrS, row_sum, sc1, sc01,
                                         [&]() CUTLASS_LAMBDA_FUNC_INLINE {
        if (b0 > 0) NamedBarrier::sync(kNumConsumerThreads, uint32_t(NamedBarriers::kP1Free));
        write_pt<T>(tSrS, pt1, tid);
        // O_R sc0 before scale1 is published: warpgroup 0 rewrites scale0 only after it saw kScale1Ready.
        rescale_cols<T>(o, ss.scale0, lane);
        NamedBarrier::sync(kThreadsPerWarpGroup, uint32_t(NamedBarriers::kOwnP1));
      });
      NamedBarrier::sync(kNumConsumerThreads, uint32_t(NamedBarriers::kP0Ready));
    }

    // ---- O^T += V0^T P0^T (block b0) ----
    wait_kv_block<T>(ss, g0);  // the owner waited already; the other warpgroup's view of the stage
    block_key_words<T>(w.stop_eff - tok0, lane, sel);
    pv_block_vregs<T>(ss, int(stage_of(g0, T::kStages)), kWG, pt0, sel, tid, o);
    warp_arrive(ss.kv_empty[stage_of(g0, T::kStages)], lane);  // this warp's reads of block b0 are done

    // ---- warpgroup 1's scale1 (and P1): O^T sc1 ----
    if constexpr (kWG == 0) NamedBarrier::sync(kNumConsumerThreads, uint32_t(NamedBarriers::kScale1Ready));
    warpgroup_wait<0>();
    o.fence();
    if constexpr (kWG == 1) {
      if constexpr (kNext) NamedBarrier::arrive(kNumConsumerThreads, uint32_t(NamedBarriers::kP0Free));
    } else {
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < 2; ++v) row_sum[v] *= ss.scale1[ri.row[v]];
    }
    rescale_cols<T>(o, ss.scale1, lane);

    // ---- the next Q K^T, then O^T += V1^T P1^T (block b0 + 1) behind it: the tensor cores run the product while
    // the half-tiles' words are built ----
    if constexpr (kNext) qk_block<T>(tid, ss, g0 + 2 + uint32_t(kWG), tSrS);
    wait_kv_block<T>(ss, g0 + 1);
    block_key_words<T>(w.stop_eff - tok0 - kBlockN, lane, sel);
    pv_block_vregs<T>(ss, int(stage_of(g0 + 1, T::kStages)), kWG, pt1, sel, tid, o);
    warp_arrive(ss.kv_empty[stage_of(g0 + 1, T::kStages)], lane);
    warpgroup_wait<0>();
    o.fence();
    if constexpr (kNext) {
      warpgroup_fence_operand(tSrS);
      if constexpr (kWG == 0) NamedBarrier::arrive(kNumConsumerThreads, uint32_t(NamedBarriers::kP1Free));
    }
  };
  run_steps(nblk, step);
}

// ------------------------------------------------------------------------------------------------
// Epilogue: a thread's O^T values are value columns 256 wg + 64 m + 16 warp + 2 g (+ 1) of 16 query rows; the row
// sums and reference maxes of both warpgroups are in shared memory (the consumers synchronized after publishing).
// ------------------------------------------------------------------------------------------------
// Where row q of the tile goes (SharedStorage::row_off): elements from p.out (a request piece that is the whole
// request) or from p.o_accum (a split's partial row); -1 for a row past q_rows.
__device__ __forceinline__ int64_t vregs_row_offset(const DecodeParams& p, const RequestPiece& w, int m_block, int hk,
                                                    int q) {
  const int r = m_block * kBlockM + q;
  if (r >= p.q_rows) return -1;
  if (w.split) return ((int64_t(w.split_id) * p.num_heads_kv + hk) * p.q_rows + r) * kHeadDimV;
  const int s = r / p.ngroups;
  const int h = hk * p.ngroups + (r - s * p.ngroups);
  return int64_t(w.req) * p.out_stride_b + int64_t(s) * p.out_stride_s + int64_t(h) * p.out_stride_h;
}

template <class T>
__device__ __forceinline__ void store_output_vregs(const DecodeParams& p, const RequestPiece& w,
                                                   const typename T::SharedStorage& ss, int m_block, int hk, int wg,
                                                   int tid, const OTAcc<T>& o) {
  using Element = typename T::Out;
  const int warp = tid / 32, lane = tid & 31;
  const int col0 = wg * kHalfDimV + 16 * warp + 2 * (lane >> 2);
  CUTLASS_PRAGMA_UNROLL
  for (int c = 0; c < 16; ++c) {
    const int q = 8 * (c >> 1) + 2 * (lane & 3) + (c & 1);  // value i of a tile is row 8 (i >> 2) + 2 t + (i & 1)
    const int64_t off = ss.row_off[q];
    if (off < 0) continue;
    const float l = ss.row_sum[0][q] + ss.row_sum[1][q];
    const float inv = row_has_key(l) ? ss.value_scale / l : 0.f;
    const int i0 = 4 * (c >> 1) + (c & 1);  // value i0: column 2 g of row q; i0 + 2: column 2 g + 1
    if (!w.split) {
      Element* out = reinterpret_cast<Element*>(p.out) + off + col0;
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < 4; ++m) {
        const Element pair[2] = {static_cast<Element>(o.t[m](i0) * inv), static_cast<Element>(o.t[m](i0 + 2) * inv)};
        *reinterpret_cast<uint32_t*>(out + 64 * m) = *reinterpret_cast<const uint32_t*>(pair);
      }
    } else {
      float* oacc = p.o_accum + off + col0;
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < 4; ++m) {
        *reinterpret_cast<float2*>(oacc + 64 * m) = make_float2(o.t[m](i0) * inv, o.t[m](i0 + 2) * inv);
      }
    }
  }
  // lse: thread q of warpgroup 0 for row q. l carries P's 2^kPScaleLog2 (config.h), which the lse must not.
  if (wg == 0 && tid < kBlockM) {
    const int q = tid, r = m_block * kBlockM + q;
    if (r < p.q_rows) {
      const int s = r / p.ngroups;
      const int h = hk * p.ngroups + (r - s * p.ngroups);
      const float l = ss.row_sum[0][q] + ss.row_sum[1][q];
      const float m = ss.row_max[q] - kPScaleLog2;
      const bool has_key = row_has_key(l);
      if (!w.split) {
        p.lse[int64_t(w.req) * p.lse_stride_b + int64_t(h) * p.lse_stride_h + s] = has_key ? row_lse(m, l) : kNoKeyLse;
      } else {
        const int64_t row_id = (int64_t(w.split_id) * p.num_heads_kv + hk) * p.q_rows + r;
        p.lse_accum[row_id] = has_key ? row_lse(m, l) : kNoKeySplitLse;
      }
    }
  }
}

// The barriers of the V-in-registers tile, by one thread before the CTA's first barrier.
template <class T>
__device__ __forceinline__ void init_pipeline_barriers_vregs(typename T::SharedStorage& ss, const CUtensorMap* tmap) {
  cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(tmap));
  CUTLASS_PRAGMA_UNROLL
  for (int s = 0; s < T::kStages; ++s) {
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kNumPieces; ++j) ss.kv_full[s][j].init(1);
    ss.kv_empty[s].init(kKvEmptyArrivalsVRegs);
  }
  cutlass::arch::fence_barrier_init();
}

}  // namespace flashmla_backend::sm90::decode_fp8
