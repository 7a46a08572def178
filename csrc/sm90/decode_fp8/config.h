// Tile constants of the sm90 FP8 tensor-core MLA decode kernel (e4m3 cache; Q K^T on e4m3 wgmma, P V on e4m3
// wgmma or, in the accurate mode, fp16 wgmma).
//
// Geometry in bytes: every operand is e4m3 (1 byte), so a 64-column piece is a 64-byte row, the row of a 64B
// swizzle atom (GMMA::Layout_K_SW64_Atom). docs/kernel-design.md ("FP8 tensor-core kernel") describes the
// pipeline; this header only fixes the numbers the roles agree on.
#pragma once

#include <cstdint>

#include "params.h"

namespace flashmla_backend::sm90::decode_fp8 {

constexpr int kBlockM = flashmla_backend::kBlockM;      // query rows per CTA
constexpr int kBlockN = flashmla_backend::kPageSize;    // keys per KV block = one cache page
constexpr int kHeadDimK = flashmla_backend::kHeadDimK;  // 576
constexpr int kHeadDimV = flashmla_backend::kHeadDimV;  // 512

// ---- Thread roles ----------------------------------------------------------------------------------
// Warpgroups 0 and 1 are the consumers (the two halves of the output, the seesaw of docs/kernel-design.md);
// warpgroup 2 is the producer: one lane of its warp 0 issues the KV copies (TMA), its warps 1..3 transpose V.
constexpr int kThreadsPerWarpGroup = 128;
constexpr int kNumConsumerWarpGroups = 2;
constexpr int kNumConsumerThreads = kThreadsPerWarpGroup * kNumConsumerWarpGroups;  // 256
constexpr int kNumThreads = kNumConsumerThreads + kThreadsPerWarpGroup;             // 384
constexpr int kHalfDimV = kHeadDimV / kNumConsumerWarpGroups;                       // 256
// Registers after setmaxnreg (Traits::kConsumerRegs / kProducerRegs, per variant): 2 x 128 x consumer + 128 x
// producer must not exceed the 64,512 the launch gave the CTA (__launch_bounds__(384, 1): 168 a thread).
constexpr int kCtaRegisters = 64512;

// ---- Pieces ----------------------------------------------------------------------------------------
// A Q term tile and a KV block are (64 rows, 576 e4m3) K-major; they are built of nine 64 x 64-byte pieces,
// each a 4 KB image of one TMA box with 64B swizzle (the rows of a piece are the rows of the tile).
constexpr int kPieceCols = 64;
constexpr int kNumPieces = kHeadDimK / kPieceCols;   // 9
constexpr int kNumVPieces = kHeadDimV / kPieceCols;  // 8
constexpr int kPieceBytes = kBlockN * kPieceCols;    // 4096
constexpr int kTileBytes = kNumPieces * kPieceBytes; // 36864: one Q term tile or one KV block
constexpr int kSwizzleRowBytes = 64;

// V^T of a block: (512 value columns, 64 keys) K-major (keys contiguous), 64B swizzle: 32 KB, kept as two halves of
// 16 KB (value columns [0, 256) for consumer warpgroup 0, [256, 512) for warpgroup 1), each in a ring of its own.
// Its key order is permuted within each group of 32 (kernel-design.md: a P accumulator converts to the e4m3 A
// fragment without moving registers between threads when V^T's key k' holds key kvt_key(k')), and its rows
// (value columns) within each group of 16 (layout.h: vt_row_column), so that every stmatrix writes eight
// consecutive rows.
constexpr int kVtBytes = kHeadDimV * kBlockN;        // 32768
constexpr int kVtHalfBytes = kVtBytes / 2;          // 16384: one consumer warpgroup's half
constexpr int kVPiecesPerHalf = kNumVPieces / 2;     // 4

// The accurate mode's fp16 V (Traits::kPvF16): a consumer warpgroup's 256 value columns x 64 keys, 2 bytes each, as
// four pieces of 64 columns, 128-byte rows (one key) with the 128B swizzle.
constexpr int kV16PieceBytes = kBlockN * kPieceCols * 2;             // 8192
constexpr int kV16HalfBytes = kVPiecesPerHalf * kV16PieceBytes;      // 32768

// The e4m3 A fragment of a 64 x 64 P tile is 32 bytes per consumer thread (two k32 slices of 16 bytes); the
// tile a warpgroup hands to the other is stored in that order (thread-major 16-byte chunks, conflict-free).
constexpr int kPFragBytes = kBlockM * kBlockN / kThreadsPerWarpGroup;  // 32

// P = exp2(s - m + kPScaleLog2): 2^8 times the probability relative to the running max (<= 1), so that small
// probabilities keep normal e4m3 exponents. The factor costs no multiplication (it rides in the exponent's offset);
// the row sums carry it too, so O / l is unchanged, and the epilogue takes it out of the lse.
constexpr float kPScaleLog2 = 8.f;
// Traits::kPTerms2: P's second e4m3 term is (P - e4m3(P)) times this power of two, so that it stays in e4m3's normal
// range for P down to about 2^-2 (2^-10 of the row's max); the epilogue divides its O by it (mainloop.cuh).
constexpr float kPLoFactor = 16.f;
// Traits::kPTerms2: P V runs on e4m3 tensor cores, whose accumulation into O keeps about 16 significant bits, so the
// error of a long chain grows with its length (against fp64 at b = 64, h_q 32: pieces of 64 blocks 2.2e-3, of 128
// 3.3e-3, of 32 1.8e-3; docs/kernel-design.md). A piece runs as runs of kPromoteBlocks blocks, O added into an fp32
// copy in global memory between runs (mainloop.cuh: run_promoted), so that no chain is longer.
constexpr int kPromoteBlocks = 32;
static_assert(kPromoteBlocks % 2 == 0, "runs of whole steps of two blocks: a piece's virtual block stays its last");
// The largest finite e4m3 value: a 16-bit q row is split with the scale amax / kE4m3Max.
constexpr float kE4m3Max = 448.f;

constexpr int kSmemAlign = 1024;
constexpr int kMaxSmemPerBlock = 227 * 1024;

static_assert(kBlockM == 64 && kBlockN == 64, "one warpgroup's wgmma covers 64 rows; a block is 64 keys");
static_assert(kPieceCols == kSwizzleRowBytes, "a piece row is one 64B swizzle row");
static_assert(kNumVPieces * kPieceCols == kHeadDimV, "V = the first eight pieces");

}  // namespace flashmla_backend::sm90::decode_fp8
