// KV-cache formats of the sm90 decode kernel: one struct per format of the cache in global memory. Traits
// (traits.h) takes one as its KvFormat parameter and the role headers call its members, so a new format is a new
// struct here, a Variant (decode.h) with its VariantTraits line (launch.cuh) and an instantiation file.
//
// What every format states:
//   Stored, kStoredBytes        the cache tensor's element type in global memory and its size in bytes
//   Operand                     the wgmma operand type of the KV pieces in shared memory (= Traits::Element)
//   kKvFp8Param                 the value of DecodeParams::kv_fp8 that selects this format
//   kTmaDataType, kTmaSwizzle   element type and swizzle of the KV tensor map (launch.cuh: make_kv_tensor_map); the
//                               box is always 64 columns x 64 tokens of one head
//   kLoadBytes, load_offset(j)  the bytes one TMA box of piece j brings, and the byte offset in its KV stage where
//                               they land; the piece's Operand image is the 8 KB slot at j * kPieceBytes
//   kWidens, widen_piece<j>()   whether a landed piece is rewritten in place as its Operand image before its first
//                               reader, and the step that does it (run by the 128 threads of the warpgroup that
//                               multiplies the stage by Q, after the piece's mbarrier wait; bar_id: that
//                               warpgroup's local named barrier)
//   kScaled, score_factor(),    how the format's scale folds: true value = stored value x score_factor in Q K^T
//   value_scale()               (folded into the softmax scale) and x value_scale in P V (applied to the output),
//                               both per (request, kv head). kernel.cuh folds them once per request; the split
//                               accumulators carry the value scale, so the combine does not see it. kScaled ==
//                               false: both are 1 and nothing is read.
#pragma once

#include <cuda.h>  // CUtensorMapDataType, CUtensorMapSwizzle

#include <cutlass/float8.h>
#include <cutlass/numeric_types.h>

#include <cstdint>
#include <type_traits>

#include "common/device.cuh"
#include "params.h"
#include "sm90/decode/config.h"
#include "sm90/decode/copies.cuh"

namespace flashmla_backend::sm90::decode {

// bf16 / fp16 cache, stored as the operand type: each piece lands in its slot as it is (128B swizzle, the smem
// layout of traits.h), nothing to widen, no scale.
template <class Element>
struct KvFormat16 {
  static_assert(std::is_same_v<Element, cutlass::bfloat16_t> || std::is_same_v<Element, cutlass::half_t>,
                "bf16 or fp16 only");
  using Stored = Element;
  using Operand = Element;
  static constexpr int kStoredBytes = int(sizeof(Stored));
  static constexpr bool kKvFp8Param = false;

  static constexpr CUtensorMapDataType kTmaDataType = std::is_same_v<Element, cutlass::bfloat16_t>
                                                          ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                          : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  static constexpr CUtensorMapSwizzle kTmaSwizzle = CU_TENSOR_MAP_SWIZZLE_128B;
  static constexpr int kLoadBytes = kPieceElems * kStoredBytes;  // 8192: the whole slot
  static constexpr int load_offset(int j) { return j * kPieceBytes; }

  static constexpr bool kWidens = false;
  template <int kPiece>
  __device__ static __forceinline__ void widen_piece(uint8_t*, int, uint32_t) {}

  static constexpr bool kScaled = false;
  __device__ static __forceinline__ float score_factor(const DecodeParams&, int, int) { return 1.f; }
  __device__ static __forceinline__ float value_scale(const DecodeParams&, int, int) { return 1.f; }
};

// float8_e4m3fn cache (vLLM's and SGLang's fp8 MLA cache), true value = stored value x descale_k of (request, kv
// head). Widened to fp16 in shared memory: every e4m3 value is exactly an fp16 value (3 mantissa bits, exponents
// -9..8), so the products are those of the dequantized cache up to the scale, which folds into the softmax scale
// and the output. A piece (64 keys x 64 bytes) is loaded unswizzled into the upper half of its slot, from where
// copies.cuh's widen_kv_piece rewrites the whole slot as the fp16 piece before its first reader. An e4m3 block
// therefore lands on exactly the slots of a 16-bit one, and the refill protocol (config.h: kRefillMask) is the
// same. (A layout with the e4m3 block packed into 36 KB that one warpgroup releases, refilled at once, needed
// fewer barriers but delayed the refill of stage 0, and measured slower: docs/perf/journal.md.)
struct KvFormatE4m3 {
  using Stored = cutlass::float_e4m3_t;
  using Operand = cutlass::half_t;
  static constexpr int kStoredBytes = int(sizeof(Stored));
  static constexpr bool kKvFp8Param = true;

  static constexpr CUtensorMapDataType kTmaDataType = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  static constexpr CUtensorMapSwizzle kTmaSwizzle = CU_TENSOR_MAP_SWIZZLE_NONE;
  static constexpr int kLoadBytes = kPieceElems * kStoredBytes;  // 4096: half the slot
  static constexpr int load_offset(int j) { return j * kPieceBytes + (kPieceBytes - kLoadBytes); }

  static constexpr bool kWidens = true;
  template <int kPiece>
  __device__ static __forceinline__ void widen_piece(uint8_t* stage_base, int tid_in_wg, uint32_t bar_id) {
    widen_kv_piece<kPiece, load_offset(kPiece)>(stage_base, tid_in_wg, bar_id);
  }

  static constexpr bool kScaled = true;
  __device__ static __forceinline__ float score_factor(const DecodeParams& p, int req, int hk) {
    return descale_k_at(p, req, hk);
  }
  __device__ static __forceinline__ float value_scale(const DecodeParams& p, int req, int hk) {
    return descale_k_at(p, req, hk);
  }

  static_assert(kLoadBytes * 2 == kPieceBytes, "an e4m3 piece fills the upper half of its fp16 slot");
};

}  // namespace flashmla_backend::sm90::decode
