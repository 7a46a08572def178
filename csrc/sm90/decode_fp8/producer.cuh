// Producer warpgroup of the sm90 FP8 tensor-core decode kernel: the KV copies (TMA) and the transposition of V.
//
// The producer walks the same blocks as the consumers: the CTA's request pieces in order, block g (counted over the
// whole metadata row) in KV stage g % kStages and V^T slots T::vt_slot(0, g), T::vt_slot(1, g) (its two halves).
// Parities follow from g: the n-th completion of a barrier (n = 0, 1, ...) is waited with parity n & 1.
//   warp 0, lane 0   issues every block in order (copy_loop): block x waits until stage x % kStages is empty (block
//                    x - kStages consumed by its Q K^T and transposed).
//   warps 1..3       block g: the four pairs of V pieces go round-robin over the three warps, shifted by one per
//                    block; a pair (half of a V^T half) waits until its half's slot is empty (the P V of the block
//                    that used the slot before done in that half's consumer warpgroup), is transposed as its pieces
//                    land, keys past the block's last visible key zeroed, then arrives on vt_full and kv_empty.
// Measured (docs/perf/journal.md): with the copies issued by one of the transposing warps instead, a copy waited for
// that warp's transposition and the kernel was 1.5x slower at h_q = 128.
#pragma once

#include <cuda.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include <cstdint>

#include "common/device.cuh"
#include "params.h"
#include "sm90/decode/copies.cuh"  // kEvictFirst / kEvictNormal
#include "sm90/decode/tile_work.cuh"
#include "sm90/decode_fp8/config.h"
#include "sm90/decode_fp8/decode.h"  // DebugFlags
#include "sm90/decode_fp8/layout.h"
#include "sm90/decode_fp8/traits.h"

#ifndef FMLA_SM90_WAIT_TIMEOUT_NS
#define FMLA_SM90_WAIT_TIMEOUT_NS 4000000000ull
#endif

namespace flashmla_backend::sm90::decode_fp8 {

using decode::RequestPiece;

// Waits until the completion number `n` (parity n & 1) of an mbarrier. The producer's waits trap after
// FMLA_SM90_WAIT_TIMEOUT_NS (a lost arrival becomes a launch error, not a hung GPU). The consumers' waits do not:
// a trap in the code after setmaxnreg.inc made ptxas give the consumer warpgroups about 184 of their 232 registers
// (wgmma serialized, O moved through local memory). A consumer waits only on what the producer provides; a lost
// arrival there leaves the producer waiting on the consumer in turn, and its wait traps.
template <class Barrier>
__device__ __forceinline__ void wait_barrier(Barrier& bar, uint32_t parity) {
  mbarrier_wait<uint64_t(FMLA_SM90_WAIT_TIMEOUT_NS)>(cute::cast_smem_ptr_to_uint(&bar), parity);
}
template <class Barrier>
__device__ __forceinline__ void consumer_wait(Barrier& bar, uint32_t parity) {
  mbarrier_wait<0>(cute::cast_smem_ptr_to_uint(&bar), parity);
}

__device__ __forceinline__ uint32_t stage_of(uint32_t g, int stages) { return g % uint32_t(stages); }

// A consumer's wait for all nine pieces of block g's KV stage, before the first wgmma of a product that reads it
// (mainloop.cuh: qk_block says why not piece by piece between the wgmma).
template <class T>
__device__ __forceinline__ void wait_kv_block(typename T::SharedStorage& ss, uint32_t g) {
  const int stage = int(stage_of(g, T::kStages));
  const uint32_t parity = (g / T::kStages) & 1u;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kNumPieces; ++j) consumer_wait(ss.kv_full[stage][j], parity);
}

// ------------------------------------------------------------------------------------------------
// The 2-CTA clusters (Traits::kClusterPair: the shared transposition, the multicast copies)
// ------------------------------------------------------------------------------------------------
// The grid's x is the M tile and the cluster is (2, 1, 1): the CTA's rank in the cluster is blockIdx.x & 1, the
// rank of the other CTA its complement. Both CTAs run the same kernel, so a shared-memory object has the same
// address in both; mapa gives the peer's copy of it in the cluster's shared window.
__device__ __forceinline__ uint32_t cluster_rank() { return blockIdx.x & 1u; }
__device__ __forceinline__ uint32_t peer_address(uint32_t local_smem_addr) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local_smem_addr), "r"(cluster_rank() ^ 1u));
  return remote;
}
// One arrival on the peer's copy of a barrier, with mbarrier.arrive's default semantics (release at CTA scope), the
// form CUTLASS's cluster pipelines use for a consumer's release of a peer's buffer. The explicit .release.cluster
// form (here and on the sender's expect_tx arrival) made the cluster plan 1.5x slower (670 us against 436 at b128
// h_q 128 on an H100, same plan otherwise): a cluster-scope release waits until all of the arriving thread's earlier
// memory operations are visible to the whole cluster, and the consumer warps arrive after each P V of a copied half.
template <class Barrier>
__device__ __forceinline__ void arrive_on_peer(Barrier& bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(
                   peer_address(cute::cast_smem_ptr_to_uint(&bar)))
               : "memory");
}
// All threads of both CTAs (the non-.aligned form: the producer's warps reach it from divergent roles).
__device__ __forceinline__ void cluster_sync_all() {
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}

// A warp's release of KV stage `stage` (its last read of the stage done): one arrival on this CTA's kv_empty, and
// with the multicast copies (Traits::kMulticastKv) one on the peer's as well, whose producer writes this CTA's stage
// too.
template <class T>
__device__ __forceinline__ void release_kv_stage(typename T::SharedStorage& ss, int stage, int lane) {
  __syncwarp();
  if (lane == 0) {
    ss.kv_empty[stage].arrive();
    if constexpr (T::kMulticastKv) arrive_on_peer(ss.kv_empty[stage]);
  }
}

// ------------------------------------------------------------------------------------------------
// KV copies
// ------------------------------------------------------------------------------------------------
// L2 policy: the 16-bit kernel's (sm90/decode/copies.cuh: one M tile reads each block once, evict-normal; two M
// tiles read it at about the same time, evict-first).

template <class T>
__device__ __forceinline__ void issue_kv_block(const CUtensorMap* tmap, typename T::SharedStorage& ss, int stage,
                                               int page, int hk) {
  const uint64_t hint = gridDim.x == 1 ? decode::kEvictNormal : decode::kEvictFirst;
  uint8_t* dst = ss.kv.data() + stage * kTileBytes;
  // Not unrolled: the producer runs on few registers (Traits::kProducerRegs).
  CUTLASS_PRAGMA_NO_UNROLL
  for (int j = 0; j < kNumPieces; ++j) {
    ss.kv_full[stage][j].arrive_and_expect_tx(kPieceBytes);
    // tensor map dims (fastest first): (576 columns, h_kv, 64 tokens, num_pages)
    cute::SM90_TMA_LOAD_4D::copy(tmap, reinterpret_cast<uint64_t*>(&ss.kv_full[stage][j]), hint,
                                 dst + j * kPieceBytes, j * kPieceCols, hk, 0, page);
  }
}

// Traits::kMulticastKv: this CTA arms all nine pieces' barriers of its stage with their bytes and issues every other
// piece (j = first, first + 2, ...; the peer the others) as multicasts into both CTAs of the cluster, whose barriers
// at the same shared-memory offset each receive the piece's bytes. A piece of the peer may land before this CTA armed
// its barrier: the transaction count goes below zero for that while, and the phase still completes only with this
// CTA's arrival (PTX ISA, mbarrier tx-count). Both CTAs walk the same blocks (dispatch.cu: paired_tiles_apply), and a
// stage is refilled only after both CTAs released it (kv_empty counts the peer's releases too: release_kv_stage), so
// a multicast never lands in a stage the peer still reads.
template <class T>
__device__ __forceinline__ void issue_kv_block_multicast(const CUtensorMap* tmap, typename T::SharedStorage& ss,
                                                         int stage, int page, int hk, uint32_t first) {
  uint8_t* dst = ss.kv.data() + stage * kTileBytes;
  CUTLASS_PRAGMA_NO_UNROLL
  for (int j = 0; j < kNumPieces; ++j) ss.kv_full[stage][j].arrive_and_expect_tx(kPieceBytes);
  CUTLASS_PRAGMA_NO_UNROLL
  for (int j = int(first); j < kNumPieces; j += 2) {
    cute::SM90_TMA_LOAD_MULTICAST_4D::copy(tmap, reinterpret_cast<uint64_t*>(&ss.kv_full[stage][j]), uint16_t(0x3),
                                           decode::kEvictFirst, dst + j * kPieceBytes, j * kPieceCols, hk, 0, page);
  }
}

// A request piece's blocks, rounded up to an even count (mainloop.cuh: the pairs of the seesaw); the one virtual
// block of an odd piece has no data.
__device__ __forceinline__ int padded_blocks(int num_blocks) { return num_blocks > 0 ? (num_blocks + 1) & ~1 : 0; }

// The blocks of the CTA's metadata row in the consumers' order: fn(w, b, g) for block b of every request piece w
// (its blocks padded to an even count), g counting blocks over the whole row. The copy lane and the transposer
// warps walk the row with it (the consumers' loop is mainloop.cuh's run_steps, two blocks a step). T: the kernel's
// Traits (its M tile's query rows, decode::TileRowsOf).
template <class T, class Fn>
__device__ __forceinline__ void for_each_block(const DecodeParams& p, const SchedMetaRow& meta, int begin_req,
                                               int end_req, int m_block, Fn&& fn) {
  uint32_t g = 0;
  for (int req = begin_req; req <= end_req; ++req) {
    const RequestPiece w = decode::make_request_piece(p, meta, req, m_block, decode::TileRowsOf<T>::value);
    const int nblk = padded_blocks(w.num_blocks);
    for (int b = 0; b < nblk; ++b, ++g) fn(w, b, g);
  }
}

// Warp 0 of the producer, lane 0: issues every block in the consumers' order, waiting for each stage to be released.
// A virtual block's pieces complete without a copy (plain arrivals): its consumer multiplies whatever the stage holds
// and masks every key.
template <class T>
__device__ __forceinline__ void copy_loop(const DecodeParams& p, const CUtensorMap* tmap, typename T::SharedStorage& ss,
                                          const SchedMetaRow& meta, int begin_req, int end_req, int m_block, int hk) {
  for_each_block<T>(p, meta, begin_req, end_req, m_block, [&](const RequestPiece& w, int b, uint32_t g) {
    const int stage = int(stage_of(g, T::kStages));
    if (g >= uint32_t(T::kStages)) wait_barrier(ss.kv_empty[stage], (g / T::kStages + 1) & 1u);
    if (b < w.num_blocks) {
      if constexpr (T::kMulticastKv) {
        // The odd ninth piece alternates between the ranks from block to block.
        issue_kv_block_multicast<T>(tmap, ss, stage, decode::block_page(p, w, b), hk, (cluster_rank() + g) & 1u);
      } else {
        issue_kv_block<T>(tmap, ss, stage, decode::block_page(p, w, b), hk);
      }
    } else {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kNumPieces; ++j) ss.kv_full[stage][j].arrive();
    }
  });
}

// Sends V^T slot `slot` (written here, 16 KB) to the same slot of the peer CTA: one arrival with the expected bytes on
// the peer's vt_full[slot], then a shared-memory bulk copy that completes those bytes there. The caller has waited
// for this CTA's vt_full[slot] (both piece pairs written and fenced for the async proxy) and, before the pairs were
// written, for the slot's peer_empty (the peer's previous copy consumed), so the peer's slot is free. The source slot
// is rewritten only after the peer's consumers released this copy (peer_empty), which they do after its bytes
// arrived: the copy has read it by then.
template <class T>
__device__ __forceinline__ void send_vt_half(typename T::SharedStorage& ss, uint32_t slot) {
  const uint32_t src = cute::cast_smem_ptr_to_uint(ss.vt.data()) + slot * T::kVSlotBytes;
  const uint32_t dst = peer_address(src);
  const uint32_t full = peer_address(cute::cast_smem_ptr_to_uint(&ss.vt_full[slot]));
  asm volatile("mbarrier.arrive.expect_tx.shared::cluster.b64 _, [%0], %1;" ::"r"(full),
               "r"(uint32_t(T::kVSlotBytes))
               : "memory");
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "r"(src), "r"(uint32_t(T::kVSlotBytes)), "r"(full)
               : "memory");
}

// The pipeline's mbarriers, by one thread of the CTA before the CTA's first barrier, for both kernels (kernel.cuh,
// keys_on_m.cuh; arrival counts: traits.h). kv_empty: the four warps of the consumer warpgroup that multiplies the
// block by Q, and the block's V piece pairs (with the shared transposition only this CTA's two). vt_full: the pairs
// that fill a slot, or, for a slot the peer CTA copies here (the shared transposition), the peer's one arrival with
// the bytes. vt_empty: the four warps of the warpgroup that reads the slot.
template <class T>
__device__ __forceinline__ void init_pipeline_barriers(typename T::SharedStorage& ss, const CUtensorMap* tmap) {
  static_assert(T::kKeysOnM || T::kVSlotPairs == int(kVtFullArrivals), "a V^T half: the pairs traits.h counts");
  cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(tmap));
  CUTLASS_PRAGMA_UNROLL
  for (int s = 0; s < T::kStages; ++s) {
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kNumPieces; ++j) ss.kv_full[s][j].init(1);
    // The multicast copies: both CTAs' releases (release_kv_stage).
    ss.kv_empty[s].init(T::kShareVt ? kKvEmptyArrivalsShared : (T::kMulticastKv ? 2 : 1) * kKvEmptyArrivals);
  }
  CUTLASS_PRAGMA_UNROLL
  for (int b = 0; b < T::kVtSlots; ++b) {
    bool copied = false;
    if constexpr (T::kShareVt) copied = uint32_t(T::vt_half_of_slot(b)) != cluster_rank();
    ss.vt_full[b].init(copied ? kVtFullArrivalsCopied : uint32_t(T::kVSlotPairs));
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < T::kVtEmptyCopies; ++c) ss.vt_empty[b][c].init(kVtEmptyArrivals);
    if constexpr (T::kShareVt) {
      ss.share.peer_empty[b].init(kPeerEmptyArrivals);
      ss.share.vt_pairs_sent[b] = 0;
    }
  }
  cutlass::arch::fence_barrier_init();
}

// ------------------------------------------------------------------------------------------------
// V transposition
// ------------------------------------------------------------------------------------------------
// One unit = 32 keys x 16 value columns (cc = chunk 0..3 of the piece, th = key half 0..1) of a block (512 bytes):
// one ldmatrix.x4.trans and one stmatrix.x4 per warp.
// Source: KV piece j (64 keys x 64 columns, row = key, 64B swizzle). ldmatrix matrix m (m = 0..3) is keys
// 32 th + 8 m .. + 7 x columns 16 cc .. + 15, read as 8 x 8 16-bit pairs and transposed, so that register m of
// lane l holds the bytes (key a, col c), (a, c + 1), (a + 1, c), (a + 1, c + 1) with a = 32 th + 8 m + 2 (l % 4),
// c = 16 cc + 2 (l / 4). Two byte permutes of registers (0, 1) give column c's and column c + 1's keys
// {a, a + 1, a + 8, a + 9} (m = 0): the four bytes at k' = 32 th + 4 (l % 4) .. + 3 of V^T's rows c and c + 1; those
// of (2, 3) the bytes at k' + 16. That key order, k' = 4 q + i -> key 2 q + (i & 1) + 8 (i >> 1) within each 16,
// is the order in which a thread's S accumulator values form its e4m3 A fragment (mainloop.cuh: p_fragment).
// stmatrix writes the four 8 x 16-byte matrices: (even columns, k' 0..15), (odd, 0..15), (even, 16..31),
// (odd, 16..31) of the group.
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&d)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(addr));
}
__device__ __forceinline__ void stsm_x4(uint32_t addr, const uint32_t (&d)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(d[0]), "r"(d[1]),
               "r"(d[2]), "r"(d[3])
               : "memory");
}

// A unit's four ldmatrix registers to its four stmatrix registers: column c's and column c + 1's keys (above).
__device__ __forceinline__ void unit_words(const uint32_t (&d)[4], uint32_t (&o)[4]) {
  o[0] = __byte_perm(d[0], d[1], 0x6420);
  o[1] = __byte_perm(d[0], d[1], 0x7531);
  o[2] = __byte_perm(d[2], d[3], 0x6420);
  o[3] = __byte_perm(d[2], d[3], 0x7531);
}

// Warps 1..3 of the producer (tw = 0..kNumTransposeWarps - 1, traits.h) transpose: the four pairs of V pieces of a
// block go round-robin over the three warps, shifted by one per block (each warp handles four pairs every three
// blocks); units_in_flight<T>() units (ldmatrix in flight) at a time. A pair is one V^T half's worth of work for its
// barriers: the warp waits for the half's slot to be empty, transposes, and arrives once on the half's vt_full and on
// the stage's kv_empty (traits.h: the arrival counts count pairs).
// Units in flight: 8 where the producer has 88 registers (the fast plans), else 4 (8 spilled at 80, and the accurate
// mode's 72 spilled more). Measured at b128 h_q 128 (docs/perf/journal.md, 2026-11-27): 4 faster than 2, and 8 faster
// than 4 by 3-4% (336-341 us against 346-352): the transposer's pair is a chain of ldmatrix -> byte permutes ->
// stmatrix batches, and warpgroup 1 waited on it (ncu: 31% of that warpgroup's stall samples at the V^T wait before
// its first P V of a step).
template <class T>
constexpr int units_in_flight() {
  return T::kProducerRegs >= 88 ? 8 : 4;
}

// kMask: the block has keys past its last visible one (zeroed). A separate instantiation: predicated-off mask
// instructions still take issue slots, which the consumer warps on the same schedulers need (measured: extra
// instructions in this loop cost the kernel more than the loads and stores of the transposition).
template <class T, int kUnits, bool kMask>
__device__ __forceinline__ void transpose_pair(typename T::SharedStorage& ss, uint32_t stage_addr, uint32_t vt_addr,
                                               int stage, uint32_t parity, int pair, int valid,
                                               const TransposeLane& tl, int lane, int debug) {
  CUTLASS_PRAGMA_UNROLL
  for (int jj = 0; jj < 2; ++jj) {
    const int j = 2 * pair + jj;
    wait_barrier(ss.kv_full[stage][j], parity);
    if (debug & kDebugNoTranspose) continue;
    CUTLASS_PRAGMA_UNROLL
    for (int batch = 0; batch < 8 / kUnits; ++batch) {
      // Units (cc, th) of piece j, kUnits at a time.
      uint32_t d[kUnits][4];
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kUnits; ++k) {
        const int unit = kUnits * batch + k, cc = unit >> 1, th = unit & 1;
        ldsm_x4_trans(stage_addr + tl.src(j, cc, th), d[k]);
      }
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kUnits; ++k) {
        const int unit = kUnits * batch + k, cc = unit >> 1, th = unit & 1;
        if constexpr (kMask) {
          // key = transposed_key(th, m, lane) = 32 th + 8 m + 2 (lane % 4): compared as 32 th + 8 m against
          // valid - 2 (lane % 4), so that no per-lane key is kept in a register (the producer has few).
          const int lane_valid = valid - transposed_key(0, 0, lane);
          CUTLASS_PRAGMA_UNROLL
          for (int m = 0; m < 4; ++m) {
            const int key = transposed_key(th, m, 0);
            d[k][m] &= (key < lane_valid ? 0x0000ffffu : 0u) | (key + 1 < lane_valid ? 0xffff0000u : 0u);
          }
        }
        uint32_t o[4];
        unit_words(d[k], o);
        stsm_x4(vt_addr + tl.dst(j, cc, th), o);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The accurate mode's fp16 V (Traits::kPvF16): widened, not transposed
// ------------------------------------------------------------------------------------------------
// V piece j (64 keys x 64 columns, e4m3, 64B swizzle) to fp16 piece j % 4 of its half's buffer (64 keys x 64
// columns, 128-byte rows, 128B swizzle; layout.h: v16_offset): a lane takes 16-byte chunk lane % 4 of key 8 i +
// lane / 4 (i = 0..7) and writes the two fp16 chunks of those 16 columns. A quarter warp reads two whole 64-byte
// rows and writes two chunks of 8 different 128-byte bank rows: no bank conflicts. kMask: keys at and past `valid`
// are written as zeros (unused slots may hold NaN; P is 0 there, and 0 x NaN would be NaN).
template <bool kMask>
__device__ __forceinline__ void widen_piece(uint32_t src_piece, uint32_t dst_piece, int valid, int lane) {
  constexpr int kBatch = 4;  // chunks in flight
  const int c = lane & 3;
  CUTLASS_PRAGMA_UNROLL
  for (int i0 = 0; i0 < 8; i0 += kBatch) {
    uint4 v[kBatch];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kBatch; ++k) {
      const int r = 8 * (i0 + k) + (lane >> 2);
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v[k].x), "=r"(v[k].y), "=r"(v[k].z), "=r"(v[k].w)
                   : "r"(src_piece + sw64_offset(r, c)));
    }
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kBatch; ++k) {
      const int r = 8 * (i0 + k) + (lane >> 2);
      uint4 lo = decode::e4m3x8_to_f16x8(v[k].x, v[k].y), hi = decode::e4m3x8_to_f16x8(v[k].z, v[k].w);
      if constexpr (kMask) {
        if (r >= valid) lo = hi = make_uint4(0, 0, 0, 0);
      }
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(dst_piece + sw128_offset(r, 2 * c)), "r"(lo.x),
                   "r"(lo.y), "r"(lo.z), "r"(lo.w)
                   : "memory");
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(dst_piece + sw128_offset(r, 2 * c + 1)),
                   "r"(hi.x), "r"(hi.y), "r"(hi.z), "r"(hi.w)
                   : "memory");
    }
  }
}

template <class T, bool kMask>
__device__ __forceinline__ void widen_pair(typename T::SharedStorage& ss, uint32_t stage_addr, uint32_t v_addr,
                                           int stage, uint32_t parity, int pair, int valid, int lane, int debug) {
  CUTLASS_PRAGMA_UNROLL
  for (int jj = 0; jj < 2; ++jj) {
    const int j = 2 * pair + jj;
    wait_barrier(ss.kv_full[stage][j], parity);
    if (debug & kDebugNoTranspose) continue;
    widen_piece<kMask>(stage_addr + j * kPieceBytes, v_addr + (j % (2 * T::kVSlotPairs)) * kV16PieceBytes, valid,
                       lane);
  }
}

// One pair of V pieces of block g (its stage, the masked or unmasked instantiation): transposed to V^T, or widened
// to fp16 (Traits::kPvF16).
template <class T>
__device__ __forceinline__ void transpose_one_pair(typename T::SharedStorage& ss, uint32_t kv_addr, uint32_t vt_addr0,
                                                   int stage, uint32_t parity, uint32_t slot, int pair, int valid,
                                                   const TransposeLane& tl, int lane, int debug) {
  const uint32_t stage_addr = kv_addr + stage * kTileBytes, vt_addr = vt_addr0 + slot * T::kVSlotBytes;
  if constexpr (T::kPvF16) {
    if (valid < kBlockN) {
      widen_pair<T, true>(ss, stage_addr, vt_addr, stage, parity, pair, valid, lane, debug);
    } else {
      widen_pair<T, false>(ss, stage_addr, vt_addr, stage, parity, pair, valid, lane, debug);
    }
  } else if (valid < kBlockN) {
    transpose_pair<T, 2, true>(ss, stage_addr, vt_addr, stage, parity, pair, valid, tl, lane, debug);
  } else {
    transpose_pair<T, units_in_flight<T>(), false>(ss, stage_addr, vt_addr, stage, parity, pair, valid, tl, lane,
                                                   debug);
  }
  cutlass::arch::fence_view_async_shared();  // V^T is read by wgmma and by the bulk copy (async proxy)
  __syncwarp();
}

// The shared transposition (Traits::kShareVt): this CTA transposes the two pairs of its own half r (= its cluster
// rank) of every block, in turn over the three warps. A pair waits for its slot's local release (vt_empty) and for
// the peer's release of the copy it got of the slot's last use (peer_empty). The warp that writes the half's second
// pair sends the half to the peer (send_vt_half). The keys masked here are those past the block's last key any row of
// this CTA sees; the host runs this plan only where both CTAs of a cluster see the same keys (dispatch.cu).
template <class T>
__device__ __forceinline__ void transpose_loop_shared(const DecodeParams& p, typename T::SharedStorage& ss,
                                                      const SchedMetaRow& meta, int begin_req, int end_req,
                                                      int m_block, int tw, int lane, int debug) {
  const uint32_t kv_addr = cute::cast_smem_ptr_to_uint(ss.kv.data());
  const uint32_t vt_addr0 = cute::cast_smem_ptr_to_uint(ss.vt.data());
  const TransposeLane tl = TransposeLane::of(lane);
  const int half = int(cluster_rank());
  for_each_block<T>(p, meta, begin_req, end_req, m_block, [&](const RequestPiece& w, int b, uint32_t g) {
    const int stage = int(stage_of(g, T::kStages));
    const uint32_t parity = (g / T::kStages) & 1u;
    const int valid = w.stop_eff - (w.first_page + b) * kBlockN;
    const uint32_t slot = T::vt_slot(half, g), use = T::vt_use(half, g);
    CUTLASS_PRAGMA_NO_UNROLL
    for (int i = 0; i < 2; ++i) {
      if (int((2 * g + uint32_t(i)) % kNumTransposeWarps) != tw) continue;
      if (use > 0) {
        wait_barrier(T::vt_empty_of(ss, slot, use - 1), T::vt_empty_parity(use - 1));
        wait_barrier(ss.share.peer_empty[slot], (use - 1) & 1u);  // after vt_empty: see traits.h, ShareVtState
      }
      transpose_one_pair<T>(ss, kv_addr, vt_addr0, stage, parity, slot, 2 * half + i, valid, tl, lane, debug);
      if (lane == 0) {
        ss.vt_full[slot].arrive();
        ss.kv_empty[stage].arrive();
        if (atomicAdd(&ss.share.vt_pairs_sent[slot], 1u) & 1u) {  // the half's second pair: both are written
          wait_barrier(ss.vt_full[slot], use & 1u);                // the other pair's stores, acquired
          send_vt_half<T>(ss, slot);
        }
      }
      __syncwarp();
    }
  });
}

template <class T>
__device__ __forceinline__ void transpose_loop(const DecodeParams& p, typename T::SharedStorage& ss,
                                               const SchedMetaRow& meta, int begin_req, int end_req, int m_block,
                                               int tw, int lane, int debug) {
  if constexpr (T::kShareVt) {
    transpose_loop_shared<T>(p, ss, meta, begin_req, end_req, m_block, tw, lane, debug);
    return;
  }
  const uint32_t kv_addr = cute::cast_smem_ptr_to_uint(ss.kv.data());
  const uint32_t vt_addr0 = cute::cast_smem_ptr_to_uint(ss.vt.data());
  const TransposeLane tl = TransposeLane::of(lane);  // layout.h
  for_each_block<T>(p, meta, begin_req, end_req, m_block, [&](const RequestPiece& w, int b, uint32_t g) {
    const int stage = int(stage_of(g, T::kStages));
    const uint32_t parity = (g / T::kStages) & 1u;
    const int valid = w.stop_eff - (w.first_page + b) * kBlockN;  // keys of the block any row may see (<= 0: none)
    const int first_pair = int((tw + kNumTransposeWarps - g % kNumTransposeWarps) % kNumTransposeWarps);
    CUTLASS_PRAGMA_NO_UNROLL
    for (int pair = first_pair; pair < kNumVPairs; pair += kNumTransposeWarps) {
      // The V slot the pair writes: halves (pairs 0, 1: the left half, pieces 0..3; 2, 3: the right one), or with one
      // pair a slot (the keys-on-M tile's quarters) slot h = pair.
      const int h = pair / T::kVSlotPairs;
      const uint32_t slot = T::vt_slot(h, g), use = T::vt_use(h, g);
      if (use > 0) wait_barrier(T::vt_empty_of(ss, slot, use - 1), T::vt_empty_parity(use - 1));
      transpose_one_pair<T>(ss, kv_addr, vt_addr0, stage, parity, slot, pair, valid, tl, lane, debug);
      if (lane == 0) ss.vt_full[slot].arrive();
      release_kv_stage<T>(ss, stage, lane);
    }
  });
}

// The producer warpgroup's warp `warp` (0..3): warp 0's lane 0 issues the copies, warps 1..3 transpose V (or widen
// it to fp16). The 64-row and the keys-on-M kernel share it.
template <class T>
__device__ __forceinline__ void producer_warp(const DecodeParams& p, const CUtensorMap* tmap,
                                              typename T::SharedStorage& ss, const SchedMetaRow& meta, int begin_req,
                                              int end_req, int m_block, int hk, int warp, int lane, int debug) {
  if (warp == 0) {
    if (lane == 0) copy_loop<T>(p, tmap, ss, meta, begin_req, end_req, m_block, hk);
  } else {
    transpose_loop<T>(p, ss, meta, begin_req, end_req, m_block, warp - 1, lane, debug);
  }
}

}  // namespace flashmla_backend::sm90::decode_fp8
