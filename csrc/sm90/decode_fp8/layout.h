// The hand-written index formulas of the sm90 FP8 tensor-core decode kernel, host and device: where a byte of a
// 64B-swizzled tile lives, the lane addresses of the V transposition, and which S accumulator value goes into which
// byte of the e4m3 P fragment. checks/layout_check.cu compares them with the CuTe layouts and plays the
// transposition on the host.
#pragma once

#include <cstdint>

#include "sm90/decode_fp8/config.h"

#if defined(__CUDACC__)
#define FMLA_HD __host__ __device__ __forceinline__
#else
#define FMLA_HD inline
#endif

namespace flashmla_backend::sm90::decode_fp8 {

// Byte offset of 16-byte chunk `chunk` (0..3) of row `row` in a 64B-swizzled K-major tile (rows of 64 bytes, the
// tile 512-byte aligned): the chunk index is XORed with bits 1..2 of the row.
FMLA_HD uint32_t sw64_offset(int row, int chunk) {
  return uint32_t(row * kSwizzleRowBytes + ((chunk ^ ((row >> 1) & 3)) << 4));
}

// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` in a 128B-swizzled K-major tile of 16-bit values (rows of
// 128 bytes, 1024-byte aligned): the chunk index is XORed with bits 0..2 of the row. The accurate mode's fp16 V
// (config.h: kV16PieceBytes) is built of such pieces, one row per key.
FMLA_HD uint32_t sw128_offset(int row, int chunk) { return uint32_t(row * 128 + ((chunk ^ (row & 7)) << 4)); }

// Byte offset of fp16 value column n (0..255) of key k in a consumer warpgroup's fp16 V half.
FMLA_HD uint32_t v16_offset(int k, int n) {
  return uint32_t((n >> 6) * kV16PieceBytes) + sw128_offset(k, (n & 63) >> 3) + uint32_t((n & 7) * 2);
}

// Byte offset of 16-byte chunk c (0..35) of row r in a Q term tile or a KV block (nine 4 KB pieces of 64 columns).
FMLA_HD uint32_t tile_chunk_offset(int r, int c) { return uint32_t((c >> 2) * kPieceBytes) + sw64_offset(r, c & 3); }

// The accurate mode's stacked Q tile (Traits::kStackedTerms, at most 32 query rows a KV head): one (64 rows, 576)
// tile holds both e4m3 terms of 32 query rows. Query row r = 8 w + g (w = 0..3, g = 0..7) has its hi term in tile
// row 16 w + g and its lo term in row 16 w + 8 + g: the two rows that one thread of warp w holds together in a
// 64 x N accumulator (rows g and g + 8 of the warp's 16), so a single product gives that thread both terms' scores
// of its query row, which it adds in fp32. Rows m and m + 8 (m & 8 = 0) share the swizzle XOR (bits 1..2), so the
// lo chunk of a row is its hi chunk + kStackedLoDelta bytes.
FMLA_HD int stacked_term_row(int r, int term) { return 16 * (r >> 3) + 8 * term + (r & 7); }
constexpr uint32_t kStackedLoDelta = 8 * kSwizzleRowBytes;

// V^T rows within each group of 16 value columns: row 16 a + i holds column 16 a + 2 i for i < 8 and column
// 16 a + 2 (i - 8) + 1 for i >= 8 (even columns first, then odd ones), so that each 8 x 16-byte matrix of a
// stmatrix lands on eight consecutive 64-byte rows, which the 64B swizzle spreads over all 32 banks (with the
// natural order a matrix's rows were two rows apart and every store was a 2-way bank conflict). The P V
// accumulator's column n is then value column vt_row_column(n); the epilogue writes it there.
FMLA_HD int vt_row_column(int n) { return (n & ~15) + (n & 8 ? 2 * (n & 7) + 1 : 2 * (n & 7)); }

// The V transposition, per lane (producer.cuh). One unit = keys 32 th .. + 31 x value columns 16 cc .. + 15 of V
// piece j: one ldmatrix.x4.trans (matrix m = keys 32 th + 8 m .. + 7, the lane supplying row lane % 8 of matrix
// lane / 8) and one stmatrix.x4 (matrix mm = lane / 8 holds the even (mm & 1 = 0) or odd value columns of the unit,
// 16 bytes at k' = 32 th + 16 (mm >> 1); the lane supplies V^T row 16 cc + 8 (mm & 1) + lane % 8 of the piece).
// Offsets in the destination are relative to the V^T half that holds piece j (pieces 0..3 and 4..7).
struct TransposeLane {
  uint32_t src_lane;  // this lane's ldmatrix row within a unit's 32 keys
  int src_x;          // the swizzle XOR of that row's chunk
  uint32_t dst_lane;  // this lane's stmatrix row within a unit's 16 V^T rows
  int dst_x;          // the swizzle XOR of that row's chunk
  int mm;             // the stmatrix matrix this lane addresses

  FMLA_HD static TransposeLane of(int lane) {
    const int mm = lane >> 3;
    return {uint32_t((8 * mm + (lane & 7)) * kSwizzleRowBytes), (lane >> 1) & 3,
            uint32_t((8 * (mm & 1) + (lane & 7)) * kSwizzleRowBytes), (lane >> 1) & 3, mm};
  }
  // Byte offsets of this lane's ldmatrix row in the KV stage and of its stmatrix row in piece j's V^T half.
  FMLA_HD uint32_t src(int j, int cc, int th) const {
    return uint32_t(j * kPieceBytes + th * 32 * kSwizzleRowBytes) + src_lane + uint32_t((cc ^ src_x) << 4);
  }
  FMLA_HD uint32_t dst(int j, int cc, int th) const {
    return uint32_t((64 * (j % kVPiecesPerHalf) + 16 * cc) * kSwizzleRowBytes) + dst_lane +
           uint32_t(((2 * th + (mm >> 1)) ^ dst_x) << 4);
  }
};

// The 16-bit halves of ldmatrix register m of `lane` hold keys 32 th + 8 m + 2 (lane % 4) and that + 1.
FMLA_HD int transposed_key(int th, int m, int lane) { return 32 * th + 8 * m + 2 * (lane & 3); }

// P as the e4m3 A fragment: byte i of word q of k32 slice kk (k' = 32 kk + 16 (q >> 1) + 4 (lane % 4) + i, row
// g + 8 (q & 1)) holds the S accumulator value with this index (row g + 8 ((idx >> 1) & 1), key 8 (idx >> 2) +
// 2 (lane % 4) + (idx & 1)), i.e. key 32 kk + 16 (q >> 1) + 2 (lane % 4) + (i & 1) + 8 (i >> 1).
FMLA_HD int p_source_index(int kk, int q, int i) {
  return 16 * kk + 8 * (q >> 1) + 2 * (q & 1) + (i & 1) + 4 * (i >> 1);
}

// ---- The keys-on-M tile of the accurate mode for few query rows (keys_on_m.h) ----------------------------------
// Its Q tile is (2 R rows, 576) e4m3, K-major, 64B swizzle, nine pieces of 64 columns (each 2 R x 64 bytes): rows
// 0..R-1 hold the hi terms of query rows 0..R-1, rows R..2R-1 their lo terms. Byte offset of 16-byte chunk c (0..35)
// of tile row r. For R a multiple of 8 the swizzle XOR of row r + R is that of row r, so a row's lo chunk is its hi
// chunk + 64 R bytes (km_q_lo_delta).
FMLA_HD uint32_t km_q_chunk_offset(int rows2, int r, int c) {
  return uint32_t((c >> 2) * rows2 * kSwizzleRowBytes) + sw64_offset(r, c & 3);
}
FMLA_HD uint32_t km_q_lo_delta(int rows) { return uint32_t(rows * kSwizzleRowBytes); }

// P^T of a block in fp16, (R rows, 64 keys) MN-major (rows contiguous): eight 8-key atoms of 2 R bytes a key, with
// the swizzle of a 2 R-byte row (R = 16: 32B swizzle, R = 32: 64B): 16-byte chunk c of key k is chunk
// c ^ ((k >> s) & (R / 8 - 1)), s = 2 for 32-byte rows and 1 for 64-byte rows. Byte offset of row n (even or odd)
// of key k.
FMLA_HD uint32_t km_pt_offset(int rows, int n, int k) {
  const int shift = rows == 16 ? 2 : 1;
  const int chunk = (n >> 3) ^ ((k >> shift) & (rows / 8 - 1));
  return uint32_t((k >> 3) * 8 * rows * 2 + (k & 7) * rows * 2 + chunk * 16 + (n & 7) * 2);
}

// The fast mode's P^T (keys_on_m.cuh): the position k' that V^T (the transposition above) gives block key `key`, the
// inverse of its key order: within each 16 keys, key 2 t + b + 8 h sits at k' = 4 t + b + 2 h.
FMLA_HD int vt_kprime_of_key(int key) {
  const int r = key & 15;
  return (key & ~15) + 4 * ((r & 7) >> 1) + (r & 1) + 2 * (r >> 3);
}

}  // namespace flashmla_backend::sm90::decode_fp8

#undef FMLA_HD
