// Tile work of the sm90 decode kernel: what one CTA does for one row of the scheduler metadata.
//
// CTA (m_block, hk, part) owns query rows [64 m_block, 64 m_block + 64) of KV head hk; metadata row `part`
// (params.h: SchedMetaRow) names the requests it visits, the first and last possibly only in part (a "request
// piece": keys [start, stop) of the request). This header turns a (row, request) pair into the piece's key
// bounds, its KV blocks and the visible key range of every row of the tile; nothing here touches shared memory.
#pragma once

#include <cutlass/cutlass.h>

#include <type_traits>

#include "common/device.cuh"  // pdl_launch_dependents
#include "params.h"
#include "sm90/decode/config.h"

namespace flashmla_backend::sm90::decode {

// The requests [begin_req, end_req] of metadata row `part` (end_req clamped to the batch), read after
// pdl_wait_primary() (the row is an earlier kernel's output). An empty row (begin_req < 0 or past end_req) lets the
// dependent grid start and returns false: the CTA has no work. The sm90 decode kernels (16-bit and FP8) share it.
struct CtaRequests {
  SchedMetaRow meta;
  int begin_req;
  int end_req;
};
__device__ __forceinline__ bool cta_requests(const DecodeParams& p, int part, CtaRequests& r) {
  r.meta = reinterpret_cast<const SchedMetaRow*>(p.sched_meta)[part];
  r.begin_req = r.meta.begin_req;
  r.end_req = min(r.meta.end_req, p.batch - 1);
  if (r.begin_req < 0 || r.begin_req > r.end_req) {
    pdl_launch_dependents();
    return false;
  }
  return true;
}

// Query rows of a kernel's M tile: kBlockM, unless its Traits say kTileRows (the FP8 accurate mode's stacked Q tile:
// 32, sm90/decode_fp8/traits.h). Tile m_block holds rows [tile_rows m_block, tile_rows (m_block + 1)).
template <class T, class = void>
struct TileRowsOf : std::integral_constant<int, kBlockM> {};
template <class T>
struct TileRowsOf<T, std::void_t<decltype(T::kTileRows)>> : std::integral_constant<int, T::kTileRows> {};

// One request piece as seen by this CTA. All values are CTA-uniform; token bounds are request-local.
struct RequestPiece {
  int req;
  int start;        // first key of the piece (a multiple of kBlockN by the scheduler's contract)
  int stop;         // one past the last key of the piece, <= len
  int len;          // clamped cache length of the request
  int stop_eff;     // one past the last key any valid row of this M tile can see (<= stop)
  int min_row_end;  // smallest per-row visible end over the valid rows of the tile
  int first_page;   // start / kBlockN: block-table index of KV block 0
  int num_blocks;   // KV blocks to process (0: no row of the tile sees a key in the piece)
  int split_id;     // global split id sid (only meaningful when split)
  bool split;       // request has more than one split: write o_accum / lse_accum
};

// tile_rows: query rows of an M tile (kBlockM, or 32 for the FP8 accurate mode's stacked Q tile).
__device__ __forceinline__ RequestPiece make_request_piece(const DecodeParams& p, const SchedMetaRow& meta,
                                                           int req, int m_block, int tile_rows = kBlockM) {
  RequestPiece w;
  w.req = req;
  const int max_len = kBlockN * p.max_pages_per_seq;
  const int len = min(max(__ldg(p.seqlens + req), 0), max_len);
  int start = req == meta.begin_req ? meta.begin_token : 0;
  int stop = req == meta.end_req ? meta.end_token : len;
  stop = min(max(stop, 0), len);
  start = min(max(start, 0), stop);
  w.len = len;
  w.start = start;
  w.stop = stop;
  // Rows of this tile: r in [tile_rows m_block, min(q_rows, tile_rows (m_block + 1))); row r is query token
  // r / ngroups.
  const int row_first = m_block * tile_rows;
  const int row_last = min(p.q_rows, row_first + tile_rows) - 1;
  if (p.causal) {
    // token s sees keys [0, len - s_q + s + 1)
    const int s_first = row_first / p.ngroups;
    const int s_last = row_last / p.ngroups;
    w.stop_eff = min(stop, len - p.seqlen_q + s_last + 1);
    w.min_row_end = min(stop, len - p.seqlen_q + s_first + 1);
  } else {
    w.stop_eff = stop;
    w.min_row_end = stop;
  }
  w.first_page = start / kBlockN;
  w.num_blocks = w.stop_eff > start ? (w.stop_eff + kBlockN - 1) / kBlockN - w.first_page : 0;
  const int split_index = req == meta.begin_req ? meta.begin_split : 0;
  const int split_begin = p.num_splits[req];
  const int n_splits = p.num_splits[req + 1] - split_begin;
  w.split = n_splits > 1;
  w.split_id = split_begin + split_index;
  return w;
}

// Cache page of KV block `blk` of the piece (block 0 = the block holding key `start`).
__device__ __forceinline__ int block_page(const DecodeParams& p, const RequestPiece& w, int blk) {
  return __ldg(p.block_table + int64_t(w.req) * p.block_table_stride_b + (w.first_page + blk));
}

// Rows of one thread's accumulator elements and the keys each row may see. The rows are fixed for the
// kernel (same in both warpgroups: element i of a 64xN wgmma fragment lies in row 16 * warp + lane / 4 +
// 8 * ((i >> 1) & 1), softmax.cuh); row_end is set per request piece by set_row_ends().
struct RowInfo {
  int row[2];      // tile-local rows of this thread's accumulator elements
  int row_end[2];  // one past the last visible key of each row (request-local)
};

// One past the last key each of the thread's two rows may see in piece w (causal: query token s of s_q sees
// keys [0, len - s_q + s + 1)).
__device__ __forceinline__ void set_row_ends(const DecodeParams& p, const RequestPiece& w, int m_block, RowInfo& ri,
                                             int tile_rows = kBlockM) {
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < 2; ++v) {
    const int r = m_block * tile_rows + ri.row[v];
    int end = w.stop_eff;  // rows past q_rows: any bound that keeps them finite
    if (r < p.q_rows) {
      end = w.stop;
      if (p.causal) end = min(end, w.len - p.seqlen_q + r / p.ngroups + 1);
    }
    ri.row_end[v] = end;
  }
}

}  // namespace flashmla_backend::sm90::decode
