// The gather of the sm90 sparse (DeepSeek-V3.2) decode kernel: a warp copies half a block of 64 fp8_ds_mla tokens,
// named by a query token's index row, into a stage of layout.h (cp.async, 16 bytes a lane), and returns which of the
// half's 32 entries name a token; the kernel's two gather warps take a half each.
//
// Indices are FlashMLA's: entry v of a query token's row is page * page_size + offset, i.e. a token of the whole
// cache viewed as [num_tokens, 656] bytes. An entry counts when it lies before the row's n_used (topk_length, or the
// row's length) and names a token: v >= 0 (FlashMLA's -1 skips) and v < num_tokens (FlashMLA's kernel would read such
// an index out of bounds; here it is never read). A skipped entry's 41 chunks are written as zeros (cp.async with
// the source ignored reads nothing): its values and scales are 0, so its P V term is 0 even where a NaN would have been,
// and the consumers mask its scores with the returned bits.
//
// How a warp covers the 32 x 41 chunks of half a block with coalesced reads: the 32 latent chunks of a token are one
// instruction of the warp (lane l: chunk l, 512 contiguous bytes), 32 of them; the scale chunks of the 32 tokens are
// one instruction (lane l: the entry whose index it loaded itself); the 8 rope chunks of four tokens are one
// instruction (128 contiguous bytes a token), 8 of them. The lanes get the other tokens' indices by shuffles.
// Copying by tokens instead (lane l all 41 chunks of its own entry's token: no shuffles, one predicate, every address
// a base plus a constant; about 90 instructions a half block against 250, and no shared-memory bank conflicts) was
// measured 2.07x slower at b128 top-k 2048 (405 against 195 µs; docs/perf/journal.md, 2026-12-02 evening): an
// instruction whose lanes read 16 bytes of 32 different tokens is 32 separate requests, so what the gather costs is
// its requests, more than its instructions.
//
// Completion is the caller's: the copies are the calling lane's cp.async operations. A lane that issued a block either
// commits them as a group, waits for the group (cp.async.wait_group) and makes them visible to the tensor cores
// (fence.proxy.async) before it signals the block, as checks/gather_probe.cu does, or hands their completion to an
// mbarrier (cp_async_arrive_on below: the kernel's gather warps, whose consumers fence after their wait: lead.cuh).
#pragma once

#include <cstdint>

#include "sm90/sparse_fp8/layout.h"

namespace flashmla_backend::sm90::sparse_fp8 {

// Whether an index entry names a token of a cache of num_tokens tokens (header).
__host__ __device__ __forceinline__ bool index_valid(int v, int64_t num_tokens) {
  return v >= 0 && int64_t(v) < num_tokens;
}

// A 16-byte cp.async that writes zeros instead of reading when `skip` (PTX's ignore-src operand: gmem is not read).
__device__ __forceinline__ void cp_async_16_or_zeros(uint32_t smem_addr, const void* gmem, bool skip) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n cp.async.cg.shared.global [%0], [%1], 16, p;\n}\n" ::"r"(smem_addr),
      "l"(gmem), "r"(int(skip))
      : "memory");
}

// The address of token t's bytes at `base` (the cache's address plus the lane's chunk offset): base + t * 656. The
// C++ expression compiles to one IMAD.WIDE.U32 with the 64-bit addend (about 100 fewer instructions in the gather's
// loops than PTX's mad.wide.u32, which ptxas 13.0 turns into a wide multiply and a 64-bit add). ptxas 13.0 aborts on
// checks/gather_probe.cu and attention_probe.cu with that form ("C7600: Register allocation failed with register
// count of '7'"), so the probes define FMLA_SPARSE_TOKEN_ADDRESS_PTX (checks/probe_common.cuh) and get the PTX form:
// the same address.
__device__ __forceinline__ const void* token_address(uint64_t base, uint32_t t) {
#if defined(FMLA_SPARSE_TOKEN_ADDRESS_PTX)
  uint64_t a;
  asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(a) : "r"(t), "r"(uint32_t(kTokenBytes)), "l"(base));
  return reinterpret_cast<const void*>(a);
#else
  return reinterpret_cast<const void*>(base + uint64_t(t) * uint32_t(kTokenBytes));
#endif
}

// Lane l's entry of half h of a block: entry first + 32 h + l of a query token's index row `row`, of which n_used
// entries count (-1 for one that does not).
__device__ __forceinline__ int half_index(const int* row, int first, int n_used, int h, int lane) {
  const int e = first + 32 * h + lane;
  return e < n_used ? __ldg(row + e) : -1;
}

// Half h of a block, entries first + 32 h .. first + 32 h + 31 of a query token's index row, into the stage at
// stage_addr (a shared address, 1024-byte aligned; layout.h), t_lane the lane's entry (half_index). Called by all 32
// lanes of a warp; returns the mask of the half's entries that name a token (bit e: entry first + 32 h + e),
// the same in every lane. Lane l holds entry l of the half; every copy's row within the half is a compile-time
// constant and every lane-dependent part of its address is computed once, so a latent copy is a shuffle, a wide
// multiply-add, a predicate and the cp.async (with run-time rows and the swizzle computed per copy, one warp issued
// about 1,400 instructions a block and was the kernel's bottleneck: docs/perf/journal.md, the lead plan's profile).
// A skipped entry's token index is 0 for its address, which the copy then does not read.
__device__ __forceinline__ uint32_t gather_half_warp(uint32_t stage_addr, const uint8_t* cache, int64_t num_tokens,
                                                     int t_lane, int h, int lane) {
  const bool ok = index_valid(t_lane, num_tokens);
  const uint32_t bits = __ballot_sync(0xffffffffu, ok);
  const int v = ok ? t_lane : 0;
  // The latent part: one token an instruction, lane l its chunk l (piece l / 4, chunk l % 4 of the piece's 64-byte
  // row, XORed with bits 1..2 of the row: decode_fp8::sw64_offset; row 32 h + i has the bits of i). The eight pieces
  // are 4 KB apart, so a token's 32 chunks land on the same 16 banks: 8 shared-memory wavefronts for 512 bytes. Two
  // tokens an instruction (lanes 16..31 on the pair's other row, the other 16 banks: 4 wavefronts) made each copy's
  // shuffle lane, row and mask bit run-time values, about 55 more instructions a half block, and the kernel 12%
  // slower (even with the one-token order through the same code): the gather's instruction stream is on the kernel's
  // path, its bank conflicts are not (docs/perf/journal.md, 2026-12-02).
  {
    const uint64_t src_lane = reinterpret_cast<uint64_t>(cache) + uint32_t(lane * kChunkBytes);
    const uint32_t base = stage_addr + uint32_t(32 * h * decode_fp8::kSwizzleRowBytes) +
                          uint32_t((lane >> 2) * decode_fp8::kPieceBytes);
    uint32_t dst[4];
#pragma unroll
    for (int x = 0; x < 4; ++x) dst[x] = base + uint32_t(((lane & 3) ^ x) << 4);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const uint32_t t = uint32_t(__shfl_sync(0xffffffffu, v, i));
      cp_async_16_or_zeros(dst[(i >> 1) & 3] + uint32_t(i * decode_fp8::kSwizzleRowBytes), token_address(src_lane, t),
                           ((bits >> i) & 1u) == 0);
    }
  }
  // The scales: lane l copies those of its own entry.
  cp_async_16_or_zeros(stage_addr + uint32_t(kScalesAt + (32 * h + lane) * kChunkBytes),
                       token_address(reinterpret_cast<uint64_t>(cache) + kScaleChunk * kChunkBytes, uint32_t(v)), !ok);
  // The rope: four tokens an instruction, lane l chunk c = l % 8 of the half's token 4 i + q, q = l / 8, into the
  // 128B-swizzled rope tile (layout.h: sw128_offset; the row's bits 0..2 are 4 (i % 2) + q).
  {
    const int q = lane >> 3, c = lane & 7;
    const uint64_t src_lane = reinterpret_cast<uint64_t>(cache) + uint32_t((kRopeChunk0 + c) * kChunkBytes);
    const uint32_t base = stage_addr + uint32_t(kRopeAt + (32 * h + q) * kRopeRowBytes);
    uint32_t dst[2];
#pragma unroll
    for (int x = 0; x < 2; ++x) dst[x] = base + uint32_t((c ^ (4 * x + q)) << 4);
    const uint32_t lane_bits = bits >> q;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t t = uint32_t(__shfl_sync(0xffffffffu, v, 4 * i + q));
      cp_async_16_or_zeros(dst[i % 2] + uint32_t(4 * i * kRopeRowBytes), token_address(src_lane, t),
                           ((lane_bits >> (4 * i)) & 1u) == 0);
    }
  }
  return bits;
}

// The whole block by one warp (the probes): both halves; bit e of the mask is entry first + e.
__device__ __forceinline__ uint64_t gather_block_warp(uint32_t stage_addr, const uint8_t* cache, int64_t num_tokens,
                                                      const int* row, int first, int n_used, int lane) {
  const uint32_t lo =
      gather_half_warp(stage_addr, cache, num_tokens, half_index(row, first, n_used, 0, lane), 0, lane);
  const uint32_t hi =
      gather_half_warp(stage_addr, cache, num_tokens, half_index(row, first, n_used, 1, lane), 1, lane);
  return uint64_t(lo) | (uint64_t(hi) << 32);
}

// An arrival on the mbarrier at bar_addr once every cp.async this lane issued so far has completed (.noinc: the
// barrier's expected count includes it).
__device__ __forceinline__ void cp_async_arrive_on(uint32_t bar_addr) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar_addr) : "memory");
}

}  // namespace flashmla_backend::sm90::sparse_fp8
