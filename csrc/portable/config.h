// Tile constants of the portable split-KV MLA decode kernel
// (mma.sync m16n8k16 + ldmatrix + cp.async; sm_80 and newer with >= 160 KB of shared memory per block).
//
// Supported: sm_80 (A100, 163 KB opt-in), sm_90 (H100/H200, 227 KB). NOT supported: sm_86 / sm_89
// (99 KB per block): the Q tile plus one KV block alone need ~146 KB. Python compares
// portable_decode_smem_bytes() with the device's sharedMemPerBlockOptin and refuses with a clear message.
// The shared-memory plan and the MMA atoms are in traits.h.
#pragma once

#include <cstdint>

#include "params.h"

namespace flashmla_backend::portable {

// ---- CTA shape -----------------------------------------------------------------------------------
constexpr int kNumWarps = 8;
constexpr int kNumThreads = kNumWarps * 32;   // 256
constexpr int kWarpsM = 4;                    // warps along the query rows (M) of S and O
constexpr int kWarpsN = 2;                    // warps along the keys of S, along the V columns of O
constexpr int kBlockN = kPageSize;            // keys per KV block: one cache page

// ---- mma.sync m16n8k16 (A row-major 16x16, B "col" 16x8, C/D fp32 16x8) ------------------------
constexpr int kMmaM = 16;
constexpr int kMmaN = 8;
constexpr int kMmaK = 16;

constexpr int kWarpRows = kBlockM / kWarpsM;             // 16 query rows per warp (S and O)
constexpr int kWarpKeys = kBlockN / kWarpsN;             // 32 keys per warp in S = Q K^T
constexpr int kWarpSTiles = kWarpKeys / kMmaN;           // 4 n-tiles of S per warp
constexpr int kWarpOCols = kHeadDimV / kWarpsN;          // 256 V columns per warp in O = P V
constexpr int kWarpOTiles = kWarpOCols / kMmaN;          // 32 n-tiles of O per warp (128 fp32 / thread)
constexpr int kPvKSteps = kBlockN / kMmaK;               // 4 k-steps of 16 keys in P V

// ---- Column chunks of a 576-wide row: the unit of loading, waiting and reuse ---------------------
// Chunks 0..7 hold V (= latent part of K); chunk 8 is the RoPE part, used only by Q K^T.
constexpr int kChunkCols = 64;
constexpr int kNumChunks = kHeadDimK / kChunkCols;       // 9
constexpr int kNumVChunks = kHeadDimV / kChunkCols;      // 8
constexpr int kRopeChunk = kNumVChunks;                  // 8
constexpr int kChunkKSteps = kChunkCols / kMmaK;         // 4 k-steps of Q K^T per chunk
constexpr int kPvSteps = kNumVChunks / kWarpsN;          // 4: warp column half n reads chunk n*4 + step
constexpr int kChunkOTiles = kChunkCols / kMmaN;         // 8 n-tiles of O per chunk

// cp.async commit groups of one KV block, in issue (= wait) order:
//   group 0: chunk 8 (+ the whole Q tile when the block starts a new request); free right after Q K^T
//   group 1 + i (i = 0..3): chunks i and 4 + i; free after P V step i
constexpr int kNumLoadGroups = 1 + kPvSteps;             // 5

// ---- Shared-memory rows ----------------------------------------------------------------------------
// Each row is padded by 8 elements (16 bytes): 584 elements = 1168 bytes = 73 16-byte units, an odd
// number, so the 8 row addresses of one ldmatrix 8x8 matrix fall into 8 different 16-byte bank groups.
constexpr int kElemBytes = 2;                            // bf16 / fp16
constexpr int kCopyBytes = 16;                           // one cp.async
constexpr int kElemsPerCopy = kCopyBytes / kElemBytes;   // 8
constexpr int kRowPad = kElemsPerCopy;
constexpr int kRowElems = kHeadDimK + kRowPad;           // 584: Q and KV rows
constexpr int kPRowElems = kBlockN + kRowPad;            // 72: P rows

// ---- Thread -> copy mapping ----------------------------------------------------------------------------
// Q tile: 4 threads per row, each 18 copies of 16 bytes (units tid%4 + 4*k of its row).
constexpr int kQThreadsPerRow = kNumThreads / kBlockM;                         // 4
constexpr int kQCopiesPerThread = kHeadDimK / kElemsPerCopy / kQThreadsPerRow;  // 18
// KV chunk (64 keys x 64 columns): 8 threads per row, rows tid/8 and tid/8 + 32.
constexpr int kKvThreadsPerRow = kChunkCols / kElemsPerCopy;                   // 8
constexpr int kKvRowsPerPass = kNumThreads / kKvThreadsPerRow;                 // 32
constexpr int kKvRowsPerThread = kBlockN / kKvRowsPerPass;                     // 2

// ---- Relations the kernel relies on --------------------------------------------------------------
static_assert(kWarpsM * kWarpsN == kNumWarps, "warp grid must cover the CTA");
static_assert(kWarpRows == kMmaM, "one m16 MMA row tile per warp");
static_assert(kWarpKeys == 2 * 2 * kMmaN, "Q K^T loads two x4 ldmatrix (2 n-tiles each) per k-step");
static_assert(kHeadDimK == kHeadDimV + kChunkCols, "the RoPE part is exactly one chunk");
static_assert(kHeadDimK % kChunkCols == 0 && kHeadDimV % kChunkCols == 0, "whole chunks");
static_assert(kNumVChunks % kWarpsN == 0 && kWarpOCols == kPvSteps * kChunkCols,
              "each warp column half owns kPvSteps whole V chunks");
static_assert(kChunkOTiles % 2 == 0, "P V loads two n-tiles per x4 ldmatrix.trans");
static_assert(kPvKSteps * kMmaK == kBlockN && kChunkKSteps * kMmaK == kChunkCols, "whole k-steps");
static_assert((kRowElems * kElemBytes) % kCopyBytes == 0 && ((kRowElems * kElemBytes) / kCopyBytes) % 2 == 1,
              "Q/KV row pitch must be an odd number of 16-byte units (conflict-free ldmatrix)");
static_assert((kPRowElems * kElemBytes) % kCopyBytes == 0 && ((kPRowElems * kElemBytes) / kCopyBytes) % 2 == 1,
              "P row pitch must be an odd number of 16-byte units (conflict-free ldmatrix)");
static_assert(kNumThreads % kBlockM == 0 && (kHeadDimK / kElemsPerCopy) % kQThreadsPerRow == 0,
              "Q tile copies divide evenly over the threads");
static_assert(kNumThreads % kKvThreadsPerRow == 0 && kBlockN % kKvRowsPerPass == 0,
              "KV chunk copies divide evenly over the threads");
static_assert(kBlockM == kWarpsM * kWarpRows, "M tile");

}  // namespace flashmla_backend::portable
