// The gather of the sm90 sparse (DeepSeek-V3.2) decode kernel: one warp copies a block of 64 fp8_ds_mla tokens,
// named by a query token's index row, into a stage of layout.h (cp.async, 16 bytes a lane), and returns which of the
// block's 64 entries name a token.
//
// Indices are FlashMLA's: entry v of a query token's row is page * page_size + offset, i.e. a token of the whole
// cache viewed as [num_tokens, 656] bytes. An entry counts when it lies before the row's n_used (topk_length, or the
// row's length) and names a token: v >= 0 (FlashMLA's -1 skips) and v < num_tokens (FlashMLA's kernel would read such
// an index out of bounds; here it is never read). A skipped entry's 41 chunks are written as zeros (cp.async with
// source size 0 reads nothing): its values and scales are 0, so its P V term is 0 even where a NaN would have been,
// and the consumers mask its scores with the returned bits.
//
// How a warp covers the 64 x 41 chunks of a block with coalesced reads: the 32 latent chunks of a token are one
// instruction of the warp (lane l: chunk l, 512 contiguous bytes), 64 of them; the 9 chunks of scales and rope of
// three tokens are one instruction (lanes 0..26; lane l: token 3 i + l / 9, chunk 32 + l % 9), 22 of them. The lanes
// get the tokens' indices by shuffles from the two entries each lane loaded (entries l and 32 + l).
//
// Completion is the caller's: the copies are the calling lane's cp.async operations. A lane that issued a block either
// commits them as a group, waits for the group (cp.async.wait_group) and makes them visible to the tensor cores
// (fence.proxy.async) before it signals the block, as checks/gather_probe.cu does, or hands their completion to an
// mbarrier (cp_async_arrive_on below: the kernel's gather warp, whose consumers fence after their wait: split.cuh,
// lead.cuh).
#pragma once

#include <cstdint>

#include "sm90/decode/copies.cuh"  // cp_async_16
#include "sm90/sparse_fp8/layout.h"

namespace flashmla_backend::sm90::sparse_fp8 {

// Whether an index entry names a token of a cache of num_tokens tokens (header).
__host__ __device__ __forceinline__ bool index_valid(int v, int64_t num_tokens) {
  return v >= 0 && int64_t(v) < num_tokens;
}

// Block entries [first, first + 64) of a query token's index row `row` (n_used entries count) into the stage at
// stage_addr (a shared address, 1024-byte aligned), the tokens' scales to scale_addr (token r's four at
// scale_addr + 16 r: the stage's own scale region, or a ring of their own). Called by all 32 lanes of a warp;
// returns the mask of the block's entries that name a token (bit e: entry first + e), the same in every lane.
__device__ __forceinline__ uint64_t gather_block_warp(uint32_t stage_addr, uint32_t scale_addr, const uint8_t* cache,
                                                      int64_t num_tokens, const int* row, int first, int n_used,
                                                      int lane) {
  int v[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int e = first + 32 * h + lane;
    v[h] = e < n_used ? __ldg(row + e) : -1;
    if (!index_valid(v[h], num_tokens)) v[h] = -1;
  }
  const uint64_t mask = uint64_t(__ballot_sync(0xffffffffu, v[0] >= 0)) |
                        (uint64_t(__ballot_sync(0xffffffffu, v[1] >= 0)) << 32);
  // The latent part: one token an instruction, lane l its chunk l. (Two loops, so that v[h] is a register: indexed
  // by a loop variable, the array went to local memory.)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll 8
    for (int i = 0; i < 32; ++i) {
      const int r = 32 * h + i;
      const int t = __shfl_sync(0xffffffffu, v[h], i);
      const uint8_t* src = cache + int64_t(t < 0 ? 0 : t) * kTokenBytes + lane * kChunkBytes;
      decode::cp_async_16(stage_addr + gather_chunk_offset(r, lane), src, t >= 0);
    }
  }
  // Scales and rope: three tokens an instruction, lane l token r0 + l / 9, chunk 32 + l % 9 (lanes 27..31 idle).
  const int sub = lane / 9, c = kScaleChunk + lane % 9;
#pragma unroll 1
  for (int r0 = 0; r0 < kBlockTokens; r0 += 3) {
    const int r = r0 + sub;
    const int src_lane = r & 31;
    const int t0 = __shfl_sync(0xffffffffu, v[0], src_lane), t1 = __shfl_sync(0xffffffffu, v[1], src_lane);
    if (lane < 27 && r < kBlockTokens) {
      const int t = r < 32 ? t0 : t1;
      const uint8_t* src = cache + int64_t(t < 0 ? 0 : t) * kTokenBytes + c * kChunkBytes;
      const uint32_t dst = c == kScaleChunk ? scale_addr + uint32_t(r * kChunkBytes)
                                            : stage_addr + gather_chunk_offset(r, c);
      decode::cp_async_16(dst, src, t >= 0);
    }
  }
  return mask;
}
// The scales into the stage's own region (layout.h).
__device__ __forceinline__ uint64_t gather_block_warp(uint32_t stage_addr, const uint8_t* cache, int64_t num_tokens,
                                                      const int* row, int first, int n_used, int lane) {
  return gather_block_warp(stage_addr, stage_addr + kScalesAt, cache, num_tokens, row, first, n_used, lane);
}

// An arrival on the mbarrier at bar_addr once every cp.async this lane issued so far has completed (.noinc: the
// barrier's expected count includes it).
__device__ __forceinline__ void cp_async_arrive_on(uint32_t bar_addr) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar_addr) : "memory");
}

}  // namespace flashmla_backend::sm90::sparse_fp8
