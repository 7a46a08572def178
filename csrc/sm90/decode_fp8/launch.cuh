// Host side of the sm90 FP8 tensor-core decode kernel: KV tensor map, shared-memory attribute, launch.
// Included by the instantiation files only.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>

#include "common/check.h"
#include "common/check_params.h"
#include "params.h"
#include "sm90/decode/launch.cuh"  // get_encode_tiled, decode_requirements, launch_on_decode_grid
#include "sm90/decode_fp8/decode.h"
#include "sm90/decode_fp8/keys_on_m.cuh"
#include "sm90/decode_fp8/kernel.cuh"
#include "sm90/decode_fp8/vregs.h"

namespace flashmla_backend::sm90::decode_fp8 {

// e4m3 cache [num_pages, 64, h_kv, 576] as a 4-d tensor map (576 columns, h_kv, 64 tokens, num_pages); box = one
// piece of 64 columns x 64 tokens, 64B swizzle (the shared-memory layout of traits.h). A box reads 64 bytes of each
// of 64 tokens 576 bytes apart. With one M tile (every block read once), L2 promotion to 128 bytes was measured
// faster on an H100 (docs/perf/journal.md, 2026-11-27; fast mode: b128 h_q 16 224.3-224.5 against 230.3-230.4 us,
// b64 h_q 32 127.4-127.6 / 130.7-131.1, varlen h_q 16 137.7-138.0 / 141.6-141.7; accurate keys-on-M b128 h_q 16
// 233.5 / 237.0; 256 bytes the same or a little slower), but slower with two M tiles, which read each block twice
// (b128 h_q 128: 354-367 against 343), so those keep none. The multicast plan (Traits::kMulticastKv) reads each
// block once a cluster and takes the promotion too (H200, b128-sk8192-h128, 1 s of back-to-back replays: 389.4
// against 393.6 us without; s_q 2 749.4 against 754.3; docs/perf/journal.md, 2026-11-30).
inline CUtensorMap make_kv_tensor_map(const DecodeParams& p, int debug, bool each_block_once) {
  CUtensorMap tmap;
  const cuuint64_t dims[4] = {cuuint64_t(kHeadDimK), cuuint64_t(p.num_heads_kv), cuuint64_t(kBlockN),
                              cuuint64_t(p.num_pages)};
  const int64_t stride_h = p.num_heads_kv == 1 ? int64_t(kHeadDimK) : p.kv_stride_h;
  const cuuint64_t strides[3] = {cuuint64_t(stride_h), cuuint64_t(p.kv_stride_token), cuuint64_t(p.kv_stride_page)};
  const cuuint32_t box[4] = {cuuint32_t(kPieceCols), 1u, cuuint32_t(kBlockN), 1u};
  const cuuint32_t elem_strides[4] = {1u, 1u, 1u, 1u};
  const CUresult res = decode::get_encode_tiled()(
      &tmap, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<void*>(p.kv), dims, strides, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_64B,
      each_block_once != bool(debug & kDebugOtherL2Promotion) ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
                                                                     : CU_TENSOR_MAP_L2_PROMOTION_NONE,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  FMLA_HOST_CHECK(res == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed for the FP8 KV cache (CUresult "
                                           << int(res) << "; strides in elements: page " << p.kv_stride_page
                                           << ", token " << p.kv_stride_token << ", head " << p.kv_stride_h << ")");
  return tmap;
}


template <Variant V>
struct VariantTraits;
// The fast mode with three or more M tiles (s_q h_q / h_kv > 128) runs 2 KV stages, a ring of 2 left V^T halves
// and one of 4 right halves (docs/perf/journal.md: the
// V^T buffers gate the transposition, and warpgroup 1 needs the right half of a block soon after the right half
// of the block three earlier is released), consumers on 208 registers and the producer on 88 (eight ldmatrix in
// flight, producer.cuh: units_in_flight; at 80 that spilled, and with four in flight it spilled at 56 and 72).
template <>
struct VariantTraits<Variant::kFastE4m3Q> {
  using type = Traits<cutlass::float_e4m3_t, 1, 2, 2, 4, 208, 88>;
};
// 3 KV stages and V^T rings of 2 + 2 (the shared memory of both plans is ~210 KB), the fast mode's plan at every M-tile
// count (dispatch.cu): on an H100 faster once the transposer and the rescale got lighter, 1-4% at b128 h_q 16, 32 and
// 128, on the varlen h_q 128 batch and at b = 1, 1% slower at four M tiles (s_q 2, h_q 128); on an H200 without the
// kernels' in-kernel switches also 2-3% faster at four and eight M tiles (docs/perf/journal.md, 2026-11-27 and
// 2026-11-30).
template <>
struct VariantTraits<Variant::kFastE4m3QStream> {
  using type = Traits<cutlass::float_e4m3_t, 1, 3, 2, 2, 208, 88>;
};
// Two M tiles as 2-CTA clusters: each CTA transposes one V^T half and copies it to the other (producer.cuh,
// Traits::kShareVt). Measured (H100, b128 x 8192, h_q 128; docs/perf/journal.md): 2 KV stages and rings of 3 + 3
// 363 us against the one-CTA plan's 348 (3 KV stages and 2 + 2: 436), so it stays behind FLASHMLA_BACKEND_FP8_DEBUG
// bit 8: the transposition's share halves (21 us against 46-51) but the hand-off between the CTAs costs more (the
// kernel without the transposition: 342 us against 302). The producer needs 88 registers (at 80 it spilled).
template <>
struct VariantTraits<Variant::kFastE4m3QCluster> {
  using type = Traits<cutlass::float_e4m3_t, 1, 2, 3, 3, 208, 88, true>;
};
// The default fast plan as 2-CTA clusters over pairs of M tiles whose KV blocks are read from L2 once a cluster (TMA
// multicast, Traits::kMulticastKv; each CTA still transposes all of its V): the two M tiles of b128 h_q 128 read
// every block twice, 1.18 GB from L2 a call (docs/perf/journal.md). Measured on an H200 (journal, 2026-11-30): with
// 1 s of back-to-back replays (the board at its power cap, as in serving) 2.5-2.7% faster than the one-CTA plan at
// b128-sk8192-h128 (389-390 against 399-402 us), 1.7% at s_q 2 and 2% on the varlen h_q 128 batch, at about the same
// energy a call (its clock stays higher); in 25 ms windows 2-3% slower at s_q 1 and 2, and 3-5% slower at b = 1 (the
// two CTAs of a cluster wait on each other's releases). So it stays behind FLASHMLA_BACKEND_FP8_DEBUG bit 8192.
template <>
struct VariantTraits<Variant::kFastE4m3QMulticast> {
  using type = Traits<cutlass::float_e4m3_t, 1, 3, 2, 2, 208, 88, false, false, false, true>;
};
// The accurate mode: Q K^T on e4m3 tensor cores with two q terms, P V on fp16 tensor cores (Traits::kPvF16), 2 KV
// stages and one fp16 V half a consumer warpgroup (64 KB; with the two-term Q and the fp16 P hand-off the plan is
// 227 KB).
template <>
struct VariantTraits<Variant::kAccurateBF16> {
  using type = Traits<cutlass::bfloat16_t, 2, 2, 1, 1, 224, 56, false, true>;
};
template <>
struct VariantTraits<Variant::kAccurateFP16> {
  using type = Traits<cutlass::half_t, 2, 2, 1, 1, 224, 56, false, true>;
};

// The accurate mode's tile with both q terms stacked in one Q tile (Traits::kStackedTerms), M tiles of 32 query rows:
// one Q K^T product a block instead of two, and the Q tile's freed 36 KB for a third KV stage (fp16 V rings of 1 + 1,
// 224 KB) or a second slot of the left fp16 V half (2 stages, 220 KB). Measured on an H100 (docs/perf/journal.md,
// 2026-11-27, h_q 32, us): 3 stages faster from 8 (request, KV head) pairs (b8 45.1 against 46.7, b64 147-150 against
// 157-160), the left ring of two below (b2 25.4 / 26.4, b4 36.1 / 39.0; dispatch.cu); right ring of two slower
// everywhere (b64 164.8, b4 37.8), not kept.
template <>
struct VariantTraits<Variant::kAccurateStackedBF16> {
  using type = Traits<cutlass::bfloat16_t, 2, 3, 1, 1, 224, 56, false, true, true>;
};
template <>
struct VariantTraits<Variant::kAccurateStackedBF16Left2> {
  using type = Traits<cutlass::bfloat16_t, 2, 2, 2, 1, 224, 56, false, true, true>;
};
template <>
struct VariantTraits<Variant::kAccurateStackedFP16> {
  using type = Traits<cutlass::half_t, 2, 3, 1, 1, 224, 56, false, true, true>;
};
template <>
struct VariantTraits<Variant::kAccurateStackedFP16Left2> {
  using type = Traits<cutlass::half_t, 2, 2, 2, 1, 224, 56, false, true, true>;
};

// The stacked Q tile with P V on e4m3 tensor cores (Traits::kPTerms2): the fast 64-row tile's pipeline and shared
// memory (3 KV stages, V^T rings 2 + 2, 216 KB) and registers, its second accumulator row carrying P's second term.
// The stacked tile's form at up to 32 rows (dispatch.cu); O promoted every kPromoteBlocks blocks (config.h), which
// keeps the e4m3 accumulator's error within the accurate mode's (docs/kernel-design.md).
template <>
struct VariantTraits<Variant::kAccurateStackedP2BF16> {
  using type = Traits<cutlass::bfloat16_t, 2, 3, 2, 2, 208, 88, false, false, true>;
};
template <>
struct VariantTraits<Variant::kAccurateStackedP2FP16> {
  using type = Traits<cutlass::half_t, 2, 3, 2, 2, 208, 88, false, false, true>;
};

// The accurate mode's V-in-registers tile (vregs.h): 3 KV stages (Q 72 KB + 108 KB + P 16 KB), consumers on 240
// registers, the producer (one copy lane) on 24.
template <>
struct VariantTraits<Variant::kAccurateVRegsBF16> {
  using type = TraitsVR<cutlass::bfloat16_t, 3, 240, 24>;
};
template <>
struct VariantTraits<Variant::kAccurateVRegsFP16> {
  using type = TraitsVR<cutlass::half_t, 3, 240, 24>;
};
// The fast mode's V-in-registers tile: one e4m3 Q tile (36 KB) leaves room for 4 KV stages (Q 36 KB + 144 KB + P 8 KB).
template <>
struct VariantTraits<Variant::kFastVRegs> {
  using type = TraitsVR<cutlass::float_e4m3_t, 4, 240, 24>;
};

// The accurate mode's keys-on-M tile (keys_on_m.h) for at most 16 query rows a KV head. Plans measured on an H100
// (docs/perf/journal.md, 2026-11-27; KV stages, fp16 V in halves with left and right rings or in quarters of one
// slot): 3 stages and halves in rings of 2 + 1 (226 KB; 236-238 us at b128 h_q 16 against 245-249 with quarters, 252
// for 2 stages with 2 + 2, 276 for 3 with 1 + 1). (Its R = 32 plan, 3 stages and quarters, was slower than the stacked
// Q tile at every batch measured and was removed: dispatch.cu.)
template <>
struct VariantTraits<Variant::kAccurateKmBF16R16> {
  using type = TraitsKM<cutlass::bfloat16_t, 16, 3, 2, 2, 1>;
};
template <>
struct VariantTraits<Variant::kAccurateKmFP16R16> {
  using type = TraitsKM<cutlass::half_t, 16, 3, 2, 2, 1>;
};
// The fast mode's keys-on-M tile (an e4m3 q: one term, P V on e4m3 tensor cores with the transposed V^T) for at most
// 16 rows: its Q tile (9 KB) and V^T halves (16 KB) leave room for 4 KV stages with V^T rings of 2 + 2 (218 KB).
// (An R = 32 plan, 4 stages with rings of 2 + 1 or 1 + 2, was slower than the 64-row tile at every batch measured:
// dispatch.cu.)
template <>
struct VariantTraits<Variant::kFastKmR16> {
  using type = TraitsKM<cutlass::float_e4m3_t, 16, 4, 2, 2, 2>;
};

template <Variant V>
void run_decode_kernel(const DecodeParams& p, int debug) {
  using T = typename VariantTraits<V>::type;
  FMLA_HOST_CHECK(p.kv_format == KvFormat::kFP8E4M3 && p.q_fp8 == T::kQFp8,
                  "sm90 FP8 decode: kv_format / q_fp8 do not match the kernel variant " << int(V));
  DecodeRequirements req = decode::decode_requirements(int(sizeof(typename T::QIn)), 1);
  req.formats = kv_format_bit(KvFormat::kFP8E4M3);
  // The epilogue writes four consecutive output columns (8 bytes) and four o_accum floats (16 bytes) at a time
  // (T::kOutColumnsInterleaved).
  req.out = AccessRule{8, 4, true};
  req.o_accum = AccessRule{16, 1, false};
  check_decode_params(p, req);

  if constexpr (!T::kKeysOnM) {
    if constexpr (T::kStackedTerms) {
      // M tiles of 32 query rows: the grid's x is the tile count (nothing on the device reads num_m_blocks; the
      // scheduler's metadata names request pieces, whatever the tiles).
      DecodeParams q = p;
      q.num_m_blocks = (p.q_rows + T::kTileRows - 1) / T::kTileRows;
      decode::launch_on_decode_grid(&sm90_fp8_decode_kernel<T>, kNumThreads, T::kSmemBytes, "sm90_fp8_decode_kernel",
                                    q, q, make_kv_tensor_map(q, debug, q.num_m_blocks == 1), debug);
      return;
    }
  }
  const CUtensorMap tmap = make_kv_tensor_map(p, debug, p.num_m_blocks == 1 || T::kMulticastKv);
  if constexpr (T::kKeysOnM) {
    FMLA_HOST_CHECK(p.q_rows <= T::kRows && p.num_m_blocks == 1,
                    "sm90 FP8 decode: the keys-on-M tile serves at most " << T::kRows << " query rows a KV head, got "
                                                                           << p.q_rows);
    if (T::kStepAhead != bool(debug & kDebugKmOtherOrder)) {
      decode::launch_on_decode_grid(&sm90_fp8_decode_km_kernel<T, true>, T::kNumThreads, T::kSmemBytes,
                                    "sm90_fp8_decode_km_kernel", p, p, tmap, debug);
    } else {
      decode::launch_on_decode_grid(&sm90_fp8_decode_km_kernel<T, false>, T::kNumThreads, T::kSmemBytes,
                                    "sm90_fp8_decode_km_kernel", p, p, tmap, debug);
    }
  } else if constexpr (T::kClusterPair) {
    if constexpr (T::kShareVt) {
      FMLA_HOST_CHECK(cluster_plan_applies(p), "sm90 FP8 decode: the 2-CTA cluster plan needs two M tiles whose rows "
                                               "see the same keys (num_m_blocks "
                                                   << p.num_m_blocks << ", s_q " << p.seqlen_q << ")");
    } else {
      FMLA_HOST_CHECK(paired_tiles_apply(p), "sm90 FP8 decode: the multicast plan needs pairs of M tiles whose rows "
                                             "see the same keys (num_m_blocks "
                                                 << p.num_m_blocks << ", s_q " << p.seqlen_q << ")");
    }
    auto kernel = &sm90_fp8_decode_kernel<T>;
    FMLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes));
    cudaLaunchAttribute attrs[2];
    attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[0].val.programmaticStreamSerializationAllowed = p.pdl ? 1 : 0;
    attrs[1].id = cudaLaunchAttributeClusterDimension;
    attrs[1].val.clusterDim.x = 2;
    attrs[1].val.clusterDim.y = 1;
    attrs[1].val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(p.num_m_blocks, p.num_heads_kv, p.num_sm_parts);
    cfg.blockDim = dim3(kNumThreads, 1, 1);
    cfg.dynamicSmemBytes = T::kSmemBytes;
    cfg.stream = static_cast<cudaStream_t>(p.stream);
    cfg.attrs = attrs;
    cfg.numAttrs = 2;
    FMLA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, tmap, debug));
    FMLA_CHECK_LAUNCH("sm90_fp8_decode_kernel (2-CTA clusters)");
  } else {
    decode::launch_on_decode_grid(&sm90_fp8_decode_kernel<T>, kNumThreads, T::kSmemBytes, "sm90_fp8_decode_kernel", p,
                                  p, tmap, debug);
  }
}

}  // namespace flashmla_backend::sm90::decode_fp8
