// Tile constants of the sm90 (Hopper, sm_90a) split-KV MLA decode kernel.
//
// Everything the kernel body, the shared-memory plan and the launcher need to agree on is derived
// here from the problem geometry of params.h; the static_asserts tie the pieces together so that a
// change of one constant cannot silently break another.
#pragma once

#include <cstdint>

#include "params.h"

namespace flashmla_backend::sm90::decode {

// ---- Problem tile --------------------------------------------------------------------------------
constexpr int kBlockM = flashmla_backend::kBlockM;      // query rows per CTA (one M tile)
constexpr int kBlockN = flashmla_backend::kPageSize;    // keys per KV block = one cache page
constexpr int kHeadDimK = flashmla_backend::kHeadDimK;  // 576: K row = 512 latent + 64 rope
constexpr int kHeadDimV = flashmla_backend::kHeadDimV;  // 512: V = first 512 columns of the K row

// ---- Thread roles ----------------------------------------------------------------------------------
// Two consumer warpgroups and no producer: TMA copies are issued by one thread of the warpgroup that
// has just released the buffer (see docs/kernel-design.md). Warpgroup w owns output columns
// [w * kHeadDimV / 2, (w + 1) * kHeadDimV / 2).
constexpr int kThreadsPerWarpGroup = 128;
constexpr int kNumWarpGroups = 2;
constexpr int kNumThreads = kThreadsPerWarpGroup * kNumWarpGroups;
constexpr int kHalfDimV = kHeadDimV / kNumWarpGroups;   // 256 output columns per warpgroup

// ---- KV pieces -------------------------------------------------------------------------------------
// A KV block (kBlockN x kHeadDimK) arrives as kNumPieces TMA boxes of kBlockN x kPieceCols, each with
// its own mbarrier; 64 bf16/fp16 columns = 128 bytes = exactly one 128B-swizzle row.
constexpr int kPieceCols = 64;
constexpr int kNumPieces = kHeadDimK / kPieceCols;            // 9
constexpr int kNumVPieces = kHeadDimV / kPieceCols;           // 8 (pieces 0..7 are also V)
constexpr int kVPiecesPerWarpGroup = kNumVPieces / kNumWarpGroups;  // 4
constexpr int kRopePiece = kNumPieces - 1;                    // piece 8: only read by Q K^T
constexpr int kElemBytes = 2;                                  // bf16 / fp16
constexpr int kPieceBytes = kBlockN * kPieceCols * kElemBytes;   // 8192: TMA transaction bytes / piece
constexpr int kPieceElems = kBlockN * kPieceCols;                // 4096
constexpr int kKVBlockBytes = kNumPieces * kPieceBytes;          // 73728
constexpr int kNumStages = 2;                                    // KV blocks resident in smem

// The probability tile P (kBlockM x kBlockN) that one warpgroup hands to the other is written into the
// rope piece of the KV stage it was computed from: once Q K^T of that block is done nobody reads the
// rope columns again, and the piece is refilled only after the P reader released it.
constexpr int kPTileBytes = kBlockM * kBlockN * kElemBytes;

// Which warpgroup re-issues the TMA of which piece of which stage after the last reader released it
// (bit j = piece j). Stage 0's block is multiplied by Q by warpgroup 0, stage 1's by warpgroup 1.
//   stage 0: pieces 0..3 (V left)  -> warpgroup 0 (after P0 V0L); pieces 4..8 -> warpgroup 1 (after P0 V0R,
//            the P0 it reads lives in piece 8)
//   stage 1: pieces 0..3 + 8        -> warpgroup 0 (after P1 V1L, reads P1 from piece 8);
//            pieces 4..7             -> warpgroup 1 (after P1 V1R)
constexpr uint32_t kRefillMask[kNumStages][kNumWarpGroups] = {
    {0x00Fu, 0x1F0u},
    {0x10Fu, 0x0F0u},
};

// ---- Query tile ------------------------------------------------------------------------------------
constexpr int kQBytes = kBlockM * kHeadDimK * kElemBytes;   // 73728, resident for a whole request
constexpr int kChunkElems = 8;                              // 16-byte cp.async chunk
constexpr int kQChunksPerRow = kHeadDimK / kChunkElems;     // 72
constexpr int kQChunks = kBlockM * kQChunksPerRow;          // 4608
constexpr int kQChunksPerThread = kQChunks / kNumThreads;   // 18

// ---- Shared memory ---------------------------------------------------------------------------------
constexpr int kSmemAlign = 1024;                 // 128B swizzle atoms repeat every 8 rows = 1024 bytes
constexpr int kMaxSmemPerBlock = 227 * 1024;     // sm_90 opt-in limit per CTA

static_assert(kHeadDimK % kPieceCols == 0 && kHeadDimV % kPieceCols == 0, "pieces tile K and V");
static_assert(kPieceCols * kElemBytes == 128, "a piece row must be exactly one 128B swizzle row");
static_assert(kNumVPieces % kNumWarpGroups == 0, "V pieces split evenly between warpgroups");
static_assert(kVPiecesPerWarpGroup * kPieceCols == kHalfDimV, "a warpgroup's V half = its V pieces");
static_assert(kBlockM == 64, "one warpgroup's wgmma covers exactly 64 rows");
static_assert(kBlockN == 64 && kBlockN == kPieceCols, "P tile must have the shape of one KV piece");
static_assert(kPTileBytes == kPieceBytes, "P tile reuses the rope piece");
static_assert(kQChunks % kNumThreads == 0, "Q chunks split evenly over the CTA");
static_assert(kPieceBytes % kSmemAlign == 0, "pieces keep 1024B alignment");
static_assert((kRefillMask[0][0] | kRefillMask[0][1]) == (1u << kNumPieces) - 1 &&
                  (kRefillMask[0][0] & kRefillMask[0][1]) == 0,
              "stage 0 pieces refilled exactly once");
static_assert((kRefillMask[1][0] | kRefillMask[1][1]) == (1u << kNumPieces) - 1 &&
                  (kRefillMask[1][0] & kRefillMask[1][1]) == 0,
              "stage 1 pieces refilled exactly once");

}  // namespace flashmla_backend::sm90::decode
