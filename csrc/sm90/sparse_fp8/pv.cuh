// P V of one gathered block of the sm90 sparse (DeepSeek-V3.2) decode kernel, without dequantizing the cache: each
// 128-column group g of the output takes P with its key columns scaled by the tokens' group scales, P[:, t] s[t, g],
// cast to e4m3 in one or two terms, times V_g^T on e4m3 wgmma (m64n128k32, P from registers). V^T comes from the
// stage's latent tiles by the dense FP8 kernel's transposition (decode_fp8/producer.cuh: its units, key order and
// V^T row order), so a V^T half is two groups, 128 rows each. checks/block_probe.cu runs it on a GPU against fp64.
//
// The group factor: P s[t, g] spans the range of the scales (fp8_ds_mla: a group's amax / 448), so the caller
// passes a power-of-two factor per group that brings the block's largest P s[t, g] into (224, 448] (group_factor);
// the product is then O_g x factor. A kernel that accumulates O_g over blocks keeps one factor per group and
// rescales O_g when a block needs a smaller one, as it rescales O for a new running max.
#pragma once

#include <cuda_fp16.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/float8.h>

#include <cstdint>

#include "sm90/decode_fp8/layout.h"
#include "sm90/decode_fp8/producer.cuh"  // ldsm_x4_trans, unit_words, stsm_x4
#include "sm90/decode_fp8/q_tile.cuh"    // f32x4_to_e4m3x4
#include "sm90/sparse_fp8/layout.h"

namespace flashmla_backend::sm90::sparse_fp8 {

using namespace cute;

struct PvTypes {
  using F8 = cutlass::float_e4m3_t;
  // O_g += P_g V_g: P from registers (the e4m3 A fragment of decode_fp8/layout.h's key order), V_g^T K-major.
  using TiledMma = decltype(make_tiled_mma(
      GMMA::rs_op_selector<F8, F8, float, Shape<Int<64>, Int<128>, Int<kBlockTokens>>, GMMA::Major::K,
                           GMMA::Major::K>()));
  // One group's V^T: 128 rows (value columns in vt_row_column's order) x 64 keys (permuted), SW64.
  using VtGroupLayout = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<F8>{}, Shape<Int<128>, Int<kBlockTokens>>{}));
  static_assert(cosize_v<VtGroupLayout> == decode_fp8::kVtHalfBytes / 2, "a group is half a V^T half");
};

// V^T of the stage's latent region: the 64 transposition units of a block (eight pieces x (4 column chunks x 2 key
// halves)), pieces 4 h .. 4 h + 3 being V^T half h. All 64 keys are transposed: a token the block does not use must
// have been gathered as zeros (cp.async with the source ignored: value 0 and scale 0), since a zero P times a NaN value
// is NaN.
// transpose_part: the 16 units of pieces 4 h + 2 part and 4 h + 2 part + 1 (part 0 or 1: half of V^T half h), written
// to vt_half (the half's own buffer). Each unit's piece, column chunk and key half within the part are compile-time
// constants and the lane's offsets are computed once, so a unit is one ldmatrix, four byte permutes and one stmatrix
// (the form with the unit as a run-time loop variable spent about 32 instructions a unit on its offsets and had one
// ldmatrix in flight); kBatch ldmatrix are in flight before their permutes. h and part are run-time values that only
// move the two base addresses, so the kernel has one copy of this code (the size of the kernel's code is a cost:
// docs/perf/journal.md, instruction-fetch stalls).
constexpr int kUnitsPerPart = 16;
template <int kBatch = 4>
__device__ __forceinline__ void transpose_part(uint32_t stage_addr, uint32_t vt_half, int h, int part, int lane) {
  const decode_fp8::TransposeLane tl = decode_fp8::TransposeLane::of(lane);
  const uint32_t src0 = stage_addr + uint32_t((4 * h + 2 * part) * decode_fp8::kPieceBytes);
  const uint32_t dst0 = vt_half + uint32_t(2 * part * 64 * decode_fp8::kSwizzleRowBytes);
  uint32_t sx[4], dx[2];  // tl.src / tl.dst of the part's first piece, without their compile-time parts
  CUTLASS_PRAGMA_UNROLL
  for (int cc = 0; cc < 4; ++cc) sx[cc] = src0 + tl.src(0, cc, 0);
  CUTLASS_PRAGMA_UNROLL
  for (int th = 0; th < 2; ++th) dx[th] = dst0 + tl.dst(0, 0, th);
  CUTLASS_PRAGMA_UNROLL
  for (int k0 = 0; k0 < kUnitsPerPart; k0 += kBatch) {
    uint32_t d[kBatch][4];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kBatch; ++k) {
      const int u = k0 + k, jj = u >> 3, cc = (u >> 1) & 3, th = u & 1;
      decode_fp8::ldsm_x4_trans(sx[cc] + uint32_t(jj * decode_fp8::kPieceBytes + th * 32 * decode_fp8::kSwizzleRowBytes),
                                d[k]);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kBatch; ++k) {
      const int u = k0 + k, jj = u >> 3, cc = (u >> 1) & 3, th = u & 1;
      uint32_t o[4];
      decode_fp8::unit_words(d[k], o);
      decode_fp8::stsm_x4(dx[th] + uint32_t((64 * jj + 16 * cc) * decode_fp8::kSwizzleRowBytes), o);
    }
  }
}
// Both halves of a block by four warps (warp 0..3; the probes): warp w the part w % 2 of half w / 2, half h at
// vt_addr + h * kVtHalfBytes.
__device__ __forceinline__ void transpose_latent(uint32_t stage_addr, uint32_t vt_addr, int warp, int lane) {
  const int h = warp >> 1;
  transpose_part(stage_addr, vt_addr + uint32_t(h * decode_fp8::kVtHalfBytes), h, warp & 1, lane);
}

// The power of two that brings max_s * p_max into (224, 448] (max_s: the block's largest scale of the group, p_max:
// the largest P value, 2^8 in the kernel's P scaling). From the bits of m = max_s p_max = 1.f x 2^e: 448 = 1.75 x 2^8,
// so 2^(8 - e) puts m in [256, 448] when 1.f <= 1.75 and 2^(7 - e) in (224, 256) otherwise; exact, a dozen integer
// instructions (exp2f(floorf(log2f(448 / m))) took two MUFU, a division and their range fixes, per group and block).
// Subnormal or infinite m take that slow form.
__device__ __forceinline__ float group_factor(float max_s, float p_max) {
  static_assert(decode_fp8::kE4m3Max == 448.f, "448 = 1.75 x 2^8");
  const float m = max_s * p_max;
  if (!(m > 0.f)) return 1.f;
  const uint32_t b = __float_as_uint(m);
  const int biased = int(b >> 23);
  const int k = 135 - biased - ((b & 0x7fffffu) > 0x600000u ? 1 : 0);  // 8 - (biased - 127) - [1.f > 1.75]
  if (biased == 0 || biased == 255 || k < -126 || k > 127) return exp2f(floorf(log2f(decode_fp8::kE4m3Max / m)));
  return __uint_as_float(uint32_t(k + 127) << 23);
}
// The factor a group's words and output use: its running factor F, or 1 while no block with a token has set it
// (F = 0).
__device__ __forceinline__ float factor_in_use(float F) { return F == 0.f ? 1.f : F; }
// f / F for two powers of two f <= F of normal range (group factors): exact, by the exponents.
__device__ __forceinline__ float power_of_two_ratio(float f, float F) {
  return __uint_as_float(__float_as_uint(f) - __float_as_uint(F) + (127u << 23));
}

// The second e4m3 term of four values x whose first term is `hi` (their e4m3 bytes, x[0] lowest): e4m3(x - hi), with
// the difference taken in fp16x2. x rounded to fp16 (2^-11 relative) minus hi is exact in fp16 (hi is x to four
// significant bits, so the difference needs at most eight of fp16's eleven), and the second term's own rounding is
// 2^-8 of x, so the fp16 detour changes nothing that the two terms keep; it takes five instructions a pair of values
// instead of seven (the fp32 form widens each hi byte twice and subtracts one value at a time).
__device__ __forceinline__ uint32_t lo_term_e4m3x4(const float (&x)[4], uint32_t hi) {
  uint32_t lo2[2];
  CUTLASS_PRAGMA_UNROLL
  for (int h = 0; h < 2; ++h) {
    const __half2 x16 = __floats2half2_rn(x[2 * h], x[2 * h + 1]);  // x[2 h] low
    const uint32_t b = decode::e4m3x2_to_f16x2(uint16_t(hi >> (16 * h)));
    const __half2 r = __hsub2(x16, *reinterpret_cast<const __half2*>(&b));
    uint16_t d;
    asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(d) : "r"(*reinterpret_cast<const uint32_t*>(&r)));
    lo2[h] = d;
  }
  return lo2[0] | (lo2[1] << 16);
}

// The e4m3 A fragment (kTerms terms x 8 words, decode_fp8/mainloop.cuh's order) of P[:, t] s[t, g] f, from the
// 64 x 64 accumulator fragment p (P of the thread's two rows), the stage's scales and the group factor f (the probes'
// form, in fp32; the kernel uses p_chunk_words_f16 below).
template <int kTerms, class Frag>
__device__ __forceinline__ void p_group_words(const Frag& p, const float* scales, int g, float f, int lane,
                                              uint32_t (&words)[kTerms][8]) {
  CUTLASS_PRAGMA_UNROLL
  for (int kk = 0; kk < 2; ++kk) {
    CUTLASS_PRAGMA_UNROLL
    for (int q = 0; q < 4; ++q) {
      float x[4];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < 4; ++i) {
        const int idx = decode_fp8::p_source_index(kk, q, i);
        const int token = 8 * (idx >> 2) + 2 * (lane & 3) + (idx & 1);
        x[i] = p(idx) * (scales[token * kGroups + g] * f);
      }
      const uint32_t hi = decode_fp8::f32x4_to_e4m3x4(x[0], x[1], x[2], x[3]);
      words[0][4 * kk + q] = hi;
      if constexpr (kTerms == 2) words[1][4 * kk + q] = lo_term_e4m3x4(x, hi);
    }
  }
}

// The same words from P in fp16 and the group's s[t, g] f of the thread's 16 tokens as eight f16x2 pairs, sf[a] =
// (s[t] f, s[t + 1] f) with t = 8 a + 2 (lane % 4) (the kernel's transposer warps make them once a block: common.cuh,
// block_group_factors), a 16-byte chunk of P at a time: chunk c (0..3) is P's fp16 words 4 c .. 4 c + 3 (word k =
// (P(2 k), P(2 k + 1)), decode_fp8::p16_fragment's order, one 16-byte chunk of decode_fp8::store_p's), which with
// the pairs sf[2 c], sf[2 c + 1] make words 2 c and 2 c + 1 of each term (word q of k32 slice kk, 4 kk + q, takes
// values p_source_index(kk, q, .): P words 8 kk + 4 (q >> 1) + (q & 1) + {0, 2}, pairs 4 kk + 2 (q >> 1) + {0, 1}),
// so a caller may load P and the pairs a chunk at a time (common.cuh: build_words). x = P s f formed in f16x2, one
// HMUL2 a pair of values, the first term converted from f16x2 and the second from the f16x2 difference (exact, as in
// lo_term_e4m3x4). The fp16 roundings of P, s f and the product (2^-11 each, relative) stay below the second term's
// own (2^-8 of x). About 30% fewer instructions than the fp32 form, which multiplies and converts one value at a time.
template <int kTerms>
__device__ __forceinline__ void p_chunk_words_f16(const uint32_t (&p4)[4], const __half2 (&sf2)[2], int c,
                                                  uint32_t (&words)[kTerms][8]) {
  CUTLASS_PRAGMA_UNROLL
  for (int ql = 0; ql < 2; ++ql) {
    uint32_t hi2[2], lo2[2];
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < 2; ++h) {
      const __half2 x = __hmul2(*reinterpret_cast<const __half2*>(&p4[ql + 2 * h]), sf2[h]);
      uint16_t d;
      asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(d) : "r"(*reinterpret_cast<const uint32_t*>(&x)));
      hi2[h] = d;
      if constexpr (kTerms == 2) {
        const uint32_t b = decode::e4m3x2_to_f16x2(d);
        const __half2 r = __hsub2(x, *reinterpret_cast<const __half2*>(&b));
        uint16_t e;
        asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(e) : "r"(*reinterpret_cast<const uint32_t*>(&r)));
        lo2[h] = e;
      }
    }
    words[0][2 * c + ql] = hi2[0] | (hi2[1] << 16);
    if constexpr (kTerms == 2) words[1][2 * c + ql] = lo2[0] | (lo2[1] << 16);
  }
}

// O_g (64 x 128 fp32 accumulator fragment) += P_g V_g; vt_group: group g's 128 V^T rows (V^T half g / 2, rows
// 128 (g % 2) ..); tid: the thread's index in its warpgroup. One commit group; the caller waits, and keeps `words`
// unchanged until then (the wgmma reads them from the registers).
template <int kTerms, class FragO>
__device__ __forceinline__ void sparse_pv_group(int tid, uint32_t (&words)[kTerms][8], uint8_t* vt_group,
                                                FragO& tOrO) {
  using F8 = PvTypes::F8;
  typename PvTypes::TiledMma mma;
  auto thr = mma.get_slice(tid);
  Tensor sV = make_tensor(make_smem_ptr(reinterpret_cast<F8*>(vt_group)), typename PvTypes::VtGroupLayout{});
  Tensor tOrV = thr.partition_fragment_B(sV);  // (MMA, 1, 2)
  using ALayout = decltype(make_layout(partition_shape_A(typename PvTypes::TiledMma{},
                                                         Shape<Int<64>, Int<kBlockTokens>>{})));
  static_assert(cosize_v<ALayout> == 32, "32 e4m3 values a thread");
  mma.accumulate_ = GMMA::ScaleOut::One;
  CUTLASS_PRAGMA_UNROLL
  for (int t = 0; t < kTerms; ++t) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 8; ++i) asm volatile("" : "+r"(words[t][i]));
  }
  warpgroup_fence_operand(tOrO);
  warpgroup_arrive();
  CUTLASS_PRAGMA_UNROLL
  for (int t = 0; t < kTerms; ++t) {
    Tensor tOrP = make_tensor(make_rmem_ptr<F8>(reinterpret_cast<F8*>(&words[t][0])), ALayout{});
    CUTLASS_PRAGMA_UNROLL
    for (int kb = 0; kb < size<2>(tOrV); ++kb) cute::gemm(mma, tOrP(_, _, kb), tOrV(_, _, kb), tOrO);
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(tOrO);
  CUTLASS_PRAGMA_UNROLL
  for (int t = 0; t < kTerms; ++t) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 8; ++i) asm volatile("" : "+r"(words[t][i]));
  }
}

}  // namespace flashmla_backend::sm90::sparse_fp8
