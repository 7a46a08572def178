// Tile-scheduler metadata kernel (get_mla_metadata): splits the KV work of a batch into
// num_sm_parts nearly equal contiguous chunks, one per persistent decode CTA column.
//
// The model (mirrored bit for bit by flashmla_backend/scheduler.py, which the tests compare):
//   request i costs w_i = nb_i + kFixedOverheadBlocks units, nb_i = ceil(max(len_i, 0) / kPageSize);
//   requests are laid end to end on a line of T = sum(w_i) units, request i at [C_i, C_i + w_i);
//   part p starts at unit u_p = p * P, P = max(M, ceil((T - kFixedOverheadBlocks) / num_sm_parts)), M the launch's
//   min_part_blocks (params.h: kMinPartBlocks for the dense kernels, which take blocks in pairs; kSparseMinPartBlocks)
//   (u_p >= T: empty part). The last request's trailing overhead is left out of P: the last part always
//   runs to the end of the batch, and counting it made b = 1 with 128 blocks on 66 parts take P = 3
//   (43 parts busy) instead of P = 2 (64 parts busy), measurably slower (docs/perf/journal.md).
//   Unit u = C_i + k maps to a position (request, block): (i, k) when k < nb_i or k == 0 (the first
//   unit of a request is its start, also for a zero-length request); (i + 1, 0) in the rest of its
//   overhead. Part p covers positions
//   [pos(u_p), pos(u_{p+1})), so every block and every zero-length request belongs to exactly one
//   part, and a part's cost is at most P units plus one overhead (the piece it ends on).
//   A part starting at (i, k) with 0 < k < nb_i cuts request i: each cut adds one split.
//
// Piece mode (batch <= min(num_sm_parts, 256); flashmla_backend/scheduler.py states it in full): request i is
// cut into s_i = max(1, ceil(nb_i / G)) nearly equal pieces, G the smallest grain in [M, P] with
// sum s_i <= num_sm_parts (if G = P does not fit: the line model), one piece per part in request order, the remaining
// parts empty. A piece has at most G <= P blocks, so a part costs at most P + overhead as in the line model,
// and a request that fits in one part stays whole.
//
// Whole-request mode (when piece mode does not apply; flashmla_backend/scheduler.py states it in full): each
// request goes whole to the part p = min(floor(C_i / P), num_sm_parts - 1) in which it starts, so no request is
// cut and no combine runs; chosen when the largest part then costs at most kWholeSlackPercent % more than the
// line model's bound P + overhead. For a uniform batch of 128 x 8192 keys on 66 parts the parts get two whole
// requests (266 units against 263), where the line model cut 63 of them, and uniform batches decode faster
// without the combine (docs/perf/journal.md). A batch that fails the bound after the pass (e.g. 200 x 8192
// keys on 66 parts) pays for that pass in get_mla_metadata; one request costlier than the bound (a varlen
// batch) skips it.
//
// Grid: one warp. Lane j of chunk c handles request i = 32c + j: it finds the parts whose start
// unit falls inside [C_i, C_i + w_i) and writes their begin fields and their predecessors' end
// fields. Loop trip count ~ batch / 32, so b in the thousands stays cheap.
#include <cuda_runtime.h>

#include "../common/check.h"
#include "../common/device.cuh"
#include "../launch.h"
#include "../params.h"

namespace flashmla_backend {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kPieceModeMaxBatch = 256;  // piece mode only for batch <= this (and <= num_sm_parts)
constexpr int kWholeSlackPercent = 3;    // whole-request mode when its largest part <= 103% of the line bound

__device__ __forceinline__ long long warp_inclusive_scan(long long v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    long long o = __shfl_up_sync(kFullMask, v, d);
    if (lane >= d) v += o;
  }
  return v;
}

__device__ __forceinline__ long long warp_inclusive_max_scan(long long v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    long long o = __shfl_up_sync(kFullMask, v, d);
    if (lane >= d) v = max(v, o);
  }
  return v;
}

__device__ __forceinline__ long long warp_max(long long v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v = max(v, __shfl_xor_sync(kFullMask, v, d));
  return v;
}

__device__ __forceinline__ long long warp_sum(long long v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(kFullMask, v, d);
  return v;
}

__device__ __forceinline__ long long ceil_div_ll(long long a, long long b) { return (a + b - 1) / b; }

// Writes the end fields of a row from the position (req, block) where the next part begins.
__device__ __forceinline__ void write_end(int32_t* row, const int32_t* seqlens, int req, int block) {
  if (block > 0) {  // ends inside request `req`, before token block * kPageSize
    row[2] = req;
    row[3] = block * kPageSize;
  } else {  // ends at the end of request req - 1
    row[2] = req - 1;
    row[3] = req > 0 ? scheduled_seqlen(seqlens, req - 1) : 0;
  }
}

// An empty row: begin_req = batch > end_req = batch - 1 (whose end token is the last request's length).
__device__ __forceinline__ void write_empty_row(int32_t* row, const int32_t* seqlens, int batch) {
  row[0] = batch;
  row[1] = 0;
  row[4] = row[5] = row[6] = row[7] = 0;
  write_end(row, seqlens, batch, 0);
}

__device__ __forceinline__ int num_blocks_of(const int32_t* seqlens, int i) {
  return (scheduled_seqlen(seqlens, i) + kPageSize - 1) / kPageSize;
}

// Piece mode: the number of pieces of a request of nb >= 0 blocks at the given grain.
__device__ __forceinline__ int pieces_of(int nb, int grain) { return max(1, (nb + grain - 1) / grain); }

// Piece mode (header comment). Returns false, having written nothing, when the line model is to be used.
// Warp-uniform control flow. The block counts stay in registers (kPieceModeMaxBatch / 32 per lane), so each
// pass over the batch is a few divisions and one warp reduction.
__device__ bool try_piece_mode(const SchedParams& p, int per_part) {
  constexpr int kPerLane = kPieceModeMaxBatch / 32;
  const int lane = threadIdx.x;
  const int batch = p.batch;
  const int parts = p.num_sm_parts;
  int nb[kPerLane];
  long long nb_sum = 0;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int i = lane + 32 * k;
    nb[k] = i < batch ? num_blocks_of(p.seqlens, i) : -1;  // -1: no request
    nb_sum += max(nb[k], 0);
  }
  nb_sum = warp_sum(nb_sum);
  auto count = [&](int grain) {  // sum over requests of max(1, ceil(nb / grain))
    int c = 0;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      if (32 * k >= batch) break;
      if (nb[k] >= 0) c += pieces_of(nb[k], grain);
    }
    return static_cast<int>(__reduce_add_sync(kFullMask, static_cast<unsigned>(c)));
  };
  if (count(per_part) > parts) return false;
  // Smallest grain <= per_part whose piece count fits; none below ceil(nb_sum / parts) can (count >= nb_sum / grain).
  int lo = static_cast<int>(max(static_cast<long long>(p.min_part_blocks),
                                min(static_cast<long long>(per_part), ceil_div_ll(nb_sum, parts)))),
      hi = per_part;
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (count(mid) <= parts) hi = mid; else lo = mid + 1;
  }
  const int grain = lo;

  if (lane == 0) p.num_splits[0] = 0;
  int part_base = 0;  // first part of the chunk's first request
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    if (32 * k >= batch) break;
    const int i = lane + 32 * k;
    const int s = nb[k] >= 0 ? pieces_of(nb[k], grain) : 0;
    const int incl = static_cast<int>(warp_inclusive_scan(s, lane));
    if (nb[k] >= 0) {
      // piece j = blocks [j q + min(j, r), (j + 1) q + min(j + 1, r)): q = nb / s, the first r = nb % s get one more
      const int q = nb[k] / s, r = nb[k] % s;
      const int len = scheduled_seqlen(p.seqlens, i);
      int4* row = reinterpret_cast<int4*>(p.metadata + (part_base + incl - s) * kSchedMetaInts);
      for (int j = 0; j < s; ++j, row += 2) {
        const int end = j == s - 1 ? len : ((j + 1) * q + min(j + 1, r)) * kPageSize;
        row[0] = make_int4(i, (j * q + min(j, r)) * kPageSize, i, end);
        row[1] = make_int4(j, 0, 0, 0);
      }
      p.num_splits[i + 1] = part_base + incl;
    }
    part_base += __shfl_sync(kFullMask, incl, 31);
  }
  for (int part = part_base + lane; part < parts; part += 32) {
    write_empty_row(p.metadata + part * kSchedMetaInts, p.seqlens, batch);
  }
  return true;
}

// Whole-request mode's acceptance: a part of this cost is within kWholeSlackPercent % of the line bound P + overhead.
__device__ __forceinline__ bool within_whole_bound(long long cost, long long per_part) {
  return cost * 100 <= (per_part + kFixedOverheadBlocks) * (100 + kWholeSlackPercent);
}

// Whole-request mode (header comment), in one pass over the batch in chunks of 32: request i belongs to part
// q_i = min(floor(C_i / P), parts - 1) (non-decreasing in i); each part's first request writes its row's begin
// fields and its last the end fields, over rows written empty first; a part costs C(end of its last request) -
// C(start of its first). Returns false when the largest part costs more than kWholeSlackPercent % over the line
// model's bound; the rows and num_splits written here are then all rewritten by the line model.
__device__ bool try_whole_mode(const SchedParams& p, long long per_part) {
  const int lane = threadIdx.x;
  const int batch = p.batch;
  const int parts = p.num_sm_parts;
  auto part_of = [&](long long c) { return min(c / per_part, static_cast<long long>(parts - 1)); };

  for (int part = lane; part < parts; part += 32) write_empty_row(p.metadata + part * kSchedMetaInts, p.seqlens, batch);
  __syncwarp();
  if (lane == 0) p.num_splits[0] = 0;
  long long unit_base = 0;   // C of the chunk's first request
  long long prev_part = -1;  // part of the request before the chunk
  long long seg_begin = 0;   // C of the first request of that request's part
  long long largest = 0;
  for (int chunk = 0; chunk < batch; chunk += 32) {
    const int i = chunk + lane;
    const bool valid = i < batch;
    const int len = valid ? scheduled_seqlen(p.seqlens, i) : 0;
    const long long w = valid ? (len + kPageSize - 1) / kPageSize + kFixedOverheadBlocks : 0;
    const long long incl = warp_inclusive_scan(w, lane);
    const long long c_begin = unit_base + incl - w;
    const long long q = part_of(c_begin);
    long long q_prev = __shfl_up_sync(kFullMask, q, 1);
    if (lane == 0) q_prev = prev_part;
    const long long begin = max(warp_inclusive_max_scan(valid && q != q_prev ? c_begin : -1, lane), seg_begin);
    if (valid) {
      largest = max(largest, unit_base + incl - begin);
      int32_t* row = p.metadata + q * kSchedMetaInts;
      if (q != q_prev) {
        row[0] = i;
        row[1] = 0;
        row[4] = 0;
      }
      if (i == batch - 1 || part_of(unit_base + incl) != q) {  // the next request starts at C_i + w_i
        row[2] = i;
        row[3] = len;
      }
      p.num_splits[i + 1] = i + 1;
    }
    seg_begin = __shfl_sync(kFullMask, begin, 31);
    prev_part = __shfl_sync(kFullMask, q, 31);
    unit_base += __shfl_sync(kFullMask, incl, 31);
  }
  largest = warp_max(largest);
  __syncwarp();  // the line model may rewrite what other lanes wrote here
  return within_whole_bound(largest, per_part);
}

__global__ void __launch_bounds__(32, 1) tile_scheduler_kernel(SchedParams p) {
  const int lane = threadIdx.x;
  const int batch = p.batch;
  const int parts = p.num_sm_parts;

  // Pass 1: T, the total cost, and P, the cost per part; the largest request cost, a lower bound of
  // whole-request mode's largest part (a varlen batch fails it here, without a pass of its own).
  long long total = 0;
  int widest = 0;
  for (int i = lane; i < batch; i += 32) {
    const int w = num_blocks_of(p.seqlens, i) + kFixedOverheadBlocks;
    total += w;
    widest = max(widest, w);
  }
  total = warp_sum(total);
  widest = __reduce_max_sync(kFullMask, widest);
  const long long spread = total - kFixedOverheadBlocks;  // >= 0: batch >= 1
  const long long per_part = max(static_cast<long long>(p.min_part_blocks), ceil_div_ll(spread, parts));

  if (batch <= parts && batch <= kPieceModeMaxBatch && try_piece_mode(p, static_cast<int>(per_part))) return;
  if (within_whole_bound(widest, per_part) && try_whole_mode(p, per_part)) return;

  // Pass 2: place the part boundaries, count cuts per request, prefix-sum splits.
  if (lane == 0) p.num_splits[0] = 0;
  long long unit_base = 0;  // C of the chunk's first request
  int split_base = 0;       // num_splits[chunk's first request]
  for (int chunk = 0; chunk < batch; chunk += 32) {
    const int i = chunk + lane;
    const bool valid = i < batch;
    const int len = valid ? scheduled_seqlen(p.seqlens, i) : 0;
    const int nb = (len + kPageSize - 1) / kPageSize;
    const long long w = valid ? nb + kFixedOverheadBlocks : 0;
    const long long incl = warp_inclusive_scan(w, lane);
    const long long c_begin = unit_base + incl - w;
    const long long c_end = unit_base + incl;

    int cuts = 0;
    if (valid) {
      const long long p_first = ceil_div_ll(c_begin, per_part);
      long long p_last = ceil_div_ll(c_end, per_part);  // exclusive
      if (p_last > parts) p_last = parts;
      for (long long part = p_first; part < p_last; ++part) {
        const long long off = part * per_part - c_begin;
        int begin_req, begin_block, begin_split;
        if (off < nb || off == 0) {
          begin_req = i;
          begin_block = static_cast<int>(off);
          begin_split = off > 0 ? ++cuts : 0;
        } else {
          begin_req = i + 1;
          begin_block = 0;
          begin_split = 0;
        }
        int32_t* row = p.metadata + part * kSchedMetaInts;
        row[0] = begin_req;
        row[1] = begin_block * kPageSize;
        row[4] = begin_split;
        row[5] = row[6] = row[7] = 0;
        if (part > 0) write_end(row - kSchedMetaInts, p.seqlens, begin_req, begin_block);
      }
    }
    const long long splits_incl = warp_inclusive_scan(valid ? 1 + cuts : 0, lane);
    if (valid) p.num_splits[i + 1] = split_base + static_cast<int>(splits_incl);
    unit_base += __shfl_sync(kFullMask, incl, 31);
    split_base += static_cast<int>(__shfl_sync(kFullMask, splits_incl, 31));
  }

  // Parts that start at or past T are empty; the part that contains T, and the last part (P * parts may
  // fall short of T by up to the last request's trailing overhead), end at the batch's end.
  for (int part = lane; part < parts; part += 32) {
    int32_t* row = p.metadata + part * kSchedMetaInts;
    if (static_cast<long long>(part) * per_part >= total) {
      write_empty_row(row, p.seqlens, batch);
    } else if (static_cast<long long>(part + 1) * per_part >= total || part == parts - 1) {
      write_end(row, p.seqlens, batch, 0);
    }
  }
}

}  // namespace

void run_tile_scheduler(const SchedParams& params) {
  FMLA_HOST_CHECK(params.batch >= 1, "tile scheduler needs batch >= 1, got " << params.batch);
  FMLA_HOST_CHECK(params.num_sm_parts >= 1, "tile scheduler needs num_sm_parts >= 1, got " << params.num_sm_parts);
  FMLA_HOST_CHECK(params.min_part_blocks >= 1,
                  "tile scheduler needs min_part_blocks >= 1, got " << params.min_part_blocks);
  tile_scheduler_kernel<<<1, 32, 0, static_cast<cudaStream_t>(params.stream)>>>(params);
  FMLA_CHECK_LAUNCH("tile_scheduler_kernel");
}

}  // namespace flashmla_backend
