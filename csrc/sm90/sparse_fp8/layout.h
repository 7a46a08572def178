// Where the bytes of gathered fp8_ds_mla tokens go in shared memory: the first building block of the sm90 sparse
// (DeepSeek-V3.2) decode kernel, which multiplies e4m3 values with the group scales folded into S and P instead of
// dequantizing them (docs/perf/journal.md, 2026-11-27: the plan, and the precision model that asks for two e4m3
// terms of q and of P). Host and device; checks/layout_check.cu compares these formulas with the CuTe layouts the
// wgmma operands use and replays a gather on the host.
//
// A token (flashmla_backend/fp8_ds_mla.py) is 656 bytes = 41 chunks of 16 bytes: chunks 0..31 the 512 e4m3 latent
// channels (16 a chunk), chunk 32 the four fp32 group scales, chunks 33..40 the 64 bf16 rope channels (8 a chunk).
// Every part starts on a chunk, so a block of 64 gathered tokens is copied chunk by chunk (cp.async, 16 bytes a
// thread, any token order) into one stage of three regions:
//   latent  64 rows x 512 e4m3 as eight 64 x 64-byte pieces with 64B swizzle: the dense FP8 kernel's KV tile
//           (decode_fp8/layout.h: tile_chunk_offset), so Q K^T per group and the V transposition are its code;
//   scales  64 x 16 bytes, row-major (one float4 a token: the four group scales);
//   rope    64 rows x 64 bf16 as one K-major 128B-swizzled tile (128-byte rows), the B operand of the bf16
//           Q_pe K_pe^T product (m64n64k16).
#pragma once

#include <cstdint>

#include "sm90/decode_fp8/layout.h"

#if defined(__CUDACC__)
#define FMLA_HD __host__ __device__ __forceinline__
#else
#define FMLA_HD inline
#endif

namespace flashmla_backend::sm90::sparse_fp8 {

constexpr int kTokenBytes = 656;
constexpr int kChunkBytes = 16;
constexpr int kTokenChunks = kTokenBytes / kChunkBytes;   // 41
constexpr int kLatentChunks = 32;                         // bytes [0, 512)
constexpr int kScaleChunk = 32;                           // bytes [512, 528)
constexpr int kRopeChunk0 = 33;                           // bytes [528, 656)
constexpr int kRopeChunks = kTokenChunks - kRopeChunk0;    // 8
constexpr int kGroups = 4;                                // latent channels 128 g .. 128 g + 127 share scale g
constexpr int kBlockTokens = 64;                          // gathered tokens a block (one wgmma N of Q K^T)
constexpr int kRopeRowBytes = 128;                        // 64 bf16

constexpr int kLatentBytes = kBlockTokens * 512;          // 32 KB: eight SW64 pieces
constexpr int kScaleBytes = kBlockTokens * kChunkBytes;   // 1 KB
constexpr int kRopeBytes = kBlockTokens * kRopeRowBytes;  // 8 KB
constexpr int kScalesAt = kLatentBytes;                   // region offsets in a stage
constexpr int kRopeAt = kScalesAt + kScaleBytes;          // 1024-byte aligned: the 128B swizzle's period
constexpr int kStageBytes = kRopeAt + kRopeBytes;         // 41 KB

static_assert(kTokenChunks * kChunkBytes == kTokenBytes, "a token is whole chunks");
static_assert(kRopeAt % 1024 == 0, "the rope tile starts on the 128B swizzle's 1024-byte period");

// Byte offset of 16-byte chunk c (0..7) of row r in a K-major tile with 128-byte rows and 128B swizzle (the tile
// 1024-byte aligned): the chunk index is XORed with bits 0..2 of the row.
FMLA_HD uint32_t sw128_offset(int row, int chunk) {
  return uint32_t(row * kRopeRowBytes + ((chunk ^ (row & 7)) << 4));
}

// Byte offset in a stage of chunk c (0..40) of the token gathered into row `row` (0..63).
FMLA_HD uint32_t gather_chunk_offset(int row, int c) {
  if (c < kLatentChunks) return decode_fp8::tile_chunk_offset(row, c);
  if (c == kScaleChunk) return uint32_t(kScalesAt + row * kChunkBytes);
  return uint32_t(kRopeAt) + sw128_offset(row, c - kRopeChunk0);
}

}  // namespace flashmla_backend::sm90::sparse_fp8

#undef FMLA_HD
