// Split-KV combine: for every request computed in n > 1 splits, merges the splits' partial
// outputs with log-sum-exp weights and writes out / lse. Requests with one split were written by
// the decode kernel directly and are skipped here.
//
// Two kernels; the launcher picks one from the grid size and the number of splits a request can have.
//
// combine_kernel (rows in parallel): grid (ceil(q_rows / kRowsPerCta) * kChunks, h_kv, batch); one warp per
// query row and column chunk, the splits in sequence. kChunks = 1: lane j owns the 16 output columns
// {4j..4j+3} + 128 k, k = 0..3 (float4 loads, coalesced across the warp). kChunks = 4: CTA chunk c covers
// columns 128c .. 128c + 127 and lane j owns 4 of them; picked when the grid would otherwise leave most SMs
// idle. Each lane keeps 16 float4 loads in flight (4 or 16 splits), the first group's issued before the passes
// over the lse values so that both share a round trip; with kChunks = 4 and a grid of at most kWideMaxCtas CTAs
// (b = 1 at h_q <= 128) 32 splits' loads, so that a row of up to 32 splits is read in one round trip. For a request
// cut into tens of splits this kernel takes a large share of the decode step (docs/perf/journal.md; the sparse
// kernel at b = 1 top-k 2048, 32 one-block splits a row: the combine's work after its wait was 4.7 of a 22.8 µs call,
// and these two changes made the call 1.1-1.6 µs shorter).
//
// combine_splits_kernel (splits in parallel), for few requests cut into many splits (b = 1 at 8192 keys: 64 splits
// of two blocks, on 66 parts at h_q = 128 or 132 at h_q = 16): grid (q_rows * 4, h_kv, batch), one CTA per row and
// 128-column chunk, 8 warps; warp w takes splits w, w + 8, ..., lane j the float4 j of the chunk. Every thread
// issues the loads of all its splits (up to kPerWarp, a template parameter sized on the host from the largest
// possible split count) together with the log-sum-exp inputs, so the partials are read in one round trip, and the 8
// warps' sums are added in shared memory. combine_kernel walks the same splits in several dependent rounds of loads
// after two passes over the lse values, which is what makes it slower there (docs/perf/journal.md).
//
// Both accumulate in a fixed order (combine_kernel: split order; combine_splits_kernel: split order within
// a warp, then warps 0..7), so a run is bitwise reproducible; the two orders differ in the last bits.
// With PDL the kernels may start while the decode kernel still runs: they read num_splits (written by the
// scheduler, which completed before the decode kernel started) and then wait with pdl_wait_primary()
// before touching the accumulators. Addressing and the empty-row rule: common/device.cuh.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "../common/check.h"
#include "../common/check_params.h"
#include "../common/device.cuh"
#include "../launch.h"
#include "../params.h"

namespace flashmla_backend {
namespace {

constexpr int kRowsPerCta = 4;
constexpr int kThreads = 32 * kRowsPerCta;
constexpr int kColsPerLane = kHeadDimV / 32;  // 16
constexpr int kVecsPerLane = kColsPerLane / 4;  // float4 loads per lane per split
static_assert(kHeadDimV % 128 == 0, "combine assumes 512 = 4 x (32 lanes x 4 floats)");

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Where one (request, kv head, query row) lives in the accumulators and in the outputs (common/device.cuh):
// the accumulator row of split i is (first_split + i) * split_stride + hk * q_rows + r (lse_accum in floats,
// o_accum in rows of kHeadDimV).
template <typename T>
struct CombineRow {
  long long split_stride;  // accumulator rows between one split and the next
  long long first;         // accumulator row of the request's first split
  float* lse_out;
  T* out;                  // column 0 of the output row
};

template <typename T>
__device__ __forceinline__ CombineRow<T> combine_row(const DecodeParams& p, int req, int hk, int row, int first_split) {
  const QueryRow qr = query_row(p, hk, row);
  CombineRow<T> r;
  r.split_stride = accum_split_stride(p);
  // accum_row(p, first_split, hk, row), written with the split stride computed just above.
  r.first = static_cast<int64_t>(first_split) * r.split_stride + static_cast<int64_t>(hk) * p.q_rows + row;
  r.lse_out = lse_at(p, req, qr.s, qr.h);
  r.out = out_row<T>(p, req, qr.s, qr.h);
  return r;
}

template <typename T, int kChunks, bool kWide>
__global__ void __launch_bounds__(kThreads) combine_kernel(DecodeParams p) {
  constexpr int kVecs = kVecsPerLane / kChunks;  // float4 per lane per split: 4 or 1
  // Splits whose loads are in flight together: 16 float4 a lane (4 or 16 splits), or with kWide (a quarter row a
  // warp, few CTAs) 32 splits, so that a request of up to 32 splits is read in one round trip (168 registers).
  constexpr int kUnroll = kWide ? 32 : 16 / kVecs;
  static_assert(!kWide || kVecs == 1, "the wide form is the quarter-row one");
  constexpr int kChunkCols = kHeadDimV / kChunks;
  static_assert(kVecsPerLane % kChunks == 0 && 32 % kUnroll == 0, "combine layout");
  const int req = blockIdx.z;
  const int hk = blockIdx.y;
  const int chunk = blockIdx.x % kChunks;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int row = (blockIdx.x / kChunks) * kRowsPerCta + warp;

  const int first_split = p.num_splits[req];
  const int n_splits = p.num_splits[req + 1] - first_split;
  if (n_splits <= 1 || row >= p.q_rows) return;

  pdl_wait_primary();

  const CombineRow<T> cr = combine_row<T>(p, req, hk, row, first_split);
  const long long row_stride = cr.split_stride;
  const float* lse_row = lse_accum_at(p, cr.first);
  // Lane-local float4 index of vector k: (chunk * kVecs + k) * 32 + lane.
  const float4* o_row = reinterpret_cast<const float4*>(o_accum_row(p, cr.first)) + chunk * kVecs * 32 + lane;
  const long long split_stride4 = row_stride * (kHeadDimV / 4);  // float4 between one split's row and the next's

  // The partials of splits j0 .. j0 + kUnroll - 1 (absent ones 0). The first group is loaded here, before the lse
  // passes, so that its loads and theirs share one round trip (a row of at most kUnroll splits is read in one).
  float4 v[kUnroll][kVecs];
  const auto load_group = [&](int j0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const float4* src = o_row + (j0 + u) * split_stride4;
#pragma unroll
      for (int k = 0; k < kVecs; ++k) v[u][k] = j0 + u < n_splits ? src[k * 32] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  load_group(0);

  // Pass 1: max and sum of exp over the splits' lse (each lane takes splits lane, lane+32, ...).
  float max_lse = -INFINITY;
  for (int i = lane; i < n_splits; i += 32) max_lse = nan_max(max_lse, lse_row[i * row_stride]);
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) max_lse = nan_max(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, d));

  float* lse_out = cr.lse_out;
  T* out = cr.out;

  if (max_lse == kNoKeySplitLse) {  // the row saw no key in any split: the empty-row rule
    for (int c = chunk * kChunkCols + lane; c < (chunk + 1) * kChunkCols; c += 32) out[c] = from_float<T>(0.f);
    if (lane == 0 && chunk == 0) *lse_out = kNoKeyLse;
    return;
  }

  float sum = 0.f;
  for (int i = lane; i < n_splits; i += 32) sum += expf(lse_row[i * row_stride] - max_lse);
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, d);
  const float final_lse = max_lse + logf(sum);

  // Pass 2: weighted sum of the partial outputs, kUnroll splits at a time in split order.
  float acc[4 * kVecs];
#pragma unroll
  for (int k = 0; k < 4 * kVecs; ++k) acc[k] = 0.f;
  for (int base = 0; base < n_splits; base += 32) {
    const int i_mine = base + lane;
    const float w_mine = i_mine < n_splits ? expf(lse_row[i_mine * row_stride] - final_lse) : 0.f;
    const int count = min(32, n_splits - base);
    for (int j0 = 0; j0 < count; j0 += kUnroll) {
      if (base + j0 > 0) load_group(base + j0);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const float w = __shfl_sync(0xffffffffu, w_mine, j0 + u);
        if (j0 + u < count) {
#pragma unroll
          for (int k = 0; k < kVecs; ++k) {
            acc[4 * k + 0] += w * v[u][k].x;
            acc[4 * k + 1] += w * v[u][k].y;
            acc[4 * k + 2] += w * v[u][k].z;
            acc[4 * k + 3] += w * v[u][k].w;
          }
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
#pragma unroll
    for (int e = 0; e < 4; ++e) out[((chunk * kVecs + k) * 32 + lane) * 4 + e] = from_float<T>(acc[4 * k + e]);
  }
  if (lane == 0 && chunk == 0) *lse_out = final_lse;
}

// Splits-in-parallel combine (header comment). kPerWarp: splits per warp whose loads are issued together;
// a request with more than 8 * kPerWarp splits is handled in several rounds.
constexpr int kSplitWarps = 8;
constexpr int kSplitChunks = 4;  // 128 columns = 32 float4 per CTA

template <typename T, int kPerWarp>
__global__ void __launch_bounds__(32 * kSplitWarps) combine_splits_kernel(DecodeParams p) {
  constexpr int kRound = kSplitWarps * kPerWarp;
  constexpr int kLsePerLane = (kRound + 31) / 32;
  const int req = blockIdx.z;
  const int hk = blockIdx.y;
  const int chunk = blockIdx.x % kSplitChunks;
  const int row = blockIdx.x / kSplitChunks;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  const int first_split = p.num_splits[req];
  const int n_splits = p.num_splits[req + 1] - first_split;
  if (n_splits <= 1 || row >= p.q_rows) return;  // CTA-uniform

  pdl_wait_primary();

  const CombineRow<T> cr = combine_row<T>(p, req, hk, row, first_split);
  const long long row_stride = cr.split_stride;
  const float* lse_row = lse_accum_at(p, cr.first);
  const float4* o_row = reinterpret_cast<const float4*>(o_accum_row(p, cr.first)) + chunk * 32 + lane;
  const long long split_stride4 = row_stride * (kHeadDimV / 4);

  // This thread's partials and their lse in the round of splits [base, base + kRound): splits base + warp,
  // base + warp + 8, ...; absent splits read as 0 with lse -inf.
  float4 v[kPerWarp];
  float lse_mine[kPerWarp];
  auto load_round = [&](int base) {
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) {
      const int j = base + warp + kSplitWarps * i;
      const bool ok = j < n_splits;
      v[i] = ok ? o_row[j * split_stride4] : make_float4(0.f, 0.f, 0.f, 0.f);
      lse_mine[i] = ok ? lse_row[j * row_stride] : -INFINITY;
    }
  };
  // Round 0 together with the lse values this lane reduces, in one go.
  load_round(0);
  float lse_lane[kLsePerLane];
#pragma unroll
  for (int t = 0; t < kLsePerLane; ++t) {
    const int k = lane + 32 * t;
    lse_lane[t] = k < n_splits ? lse_row[k * row_stride] : -INFINITY;
  }
  float max_lse = -INFINITY;
#pragma unroll
  for (int t = 0; t < kLsePerLane; ++t) max_lse = nan_max(max_lse, lse_lane[t]);
  for (int k = lane + 32 * kLsePerLane; k < n_splits; k += 32) max_lse = nan_max(max_lse, lse_row[k * row_stride]);
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) max_lse = nan_max(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, d));

  float* lse_out = cr.lse_out;
  T* out = cr.out;
  const int col = chunk * (kHeadDimV / kSplitChunks) + 4 * lane;

  if (max_lse == kNoKeySplitLse) {  // the row saw no key in any split (same value in every warp)
    if (warp == 0) {
#pragma unroll
      for (int e = 0; e < 4; ++e) out[col + e] = from_float<T>(0.f);
      if (lane == 0 && chunk == 0) *lse_out = kNoKeyLse;
    }
    return;
  }

  float sum = 0.f;
#pragma unroll
  for (int t = 0; t < kLsePerLane; ++t) sum += expf(lse_lane[t] - max_lse);  // exp(-inf) = 0 for absent splits
  for (int k = lane + 32 * kLsePerLane; k < n_splits; k += 32) sum += expf(lse_row[k * row_stride] - max_lse);
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, d);
  const float final_lse = max_lse + logf(sum);

  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int base = 0;;) {
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) {
      const float w = expf(lse_mine[i] - final_lse);  // 0 for absent splits (their v is 0 too)
      acc.x += w * v[i].x;
      acc.y += w * v[i].y;
      acc.z += w * v[i].z;
      acc.w += w * v[i].w;
    }
    base += kRound;
    if (base >= n_splits) break;
    load_round(base);
  }

  __shared__ float4 partial[kSplitWarps][32];
  partial[warp][lane] = acc;
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int w = 1; w < kSplitWarps; ++w) {
      const float4 o = partial[w][lane];
      acc.x += o.x;
      acc.y += o.y;
      acc.z += o.z;
      acc.w += o.w;
    }
    out[col + 0] = from_float<T>(acc.x);
    out[col + 1] = from_float<T>(acc.y);
    out[col + 2] = from_float<T>(acc.z);
    out[col + 3] = from_float<T>(acc.w);
    if (lane == 0 && chunk == 0) *lse_out = final_lse;
  }
}

// Below this many CTAs of the one-chunk layout the grid is split 4 ways by columns (2 waves of 132 SMs).
constexpr long long kFewCtas = 264;

void launch_combine_kernel(const DecodeParams& p, void (*kernel)(DecodeParams), dim3 grid, dim3 block) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = 0;
  config.stream = static_cast<cudaStream_t>(p.stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = p.pdl ? 1 : 0;
  FMLA_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
}

template <typename T, int kChunks, bool kWide = false>
void launch_combine(const DecodeParams& p, dim3 grid) {
  grid.x *= kChunks;
  launch_combine_kernel(p, combine_kernel<T, kChunks, kWide>, grid, dim3(kThreads));
}

// The quarter-row grid at most this large takes the wide form: 128 CTAs is b = 1 at h_q 128. With the wide form on
// every quarter-row grid the bf16 calls of 256 CTAs (b = 2 at h_q 128) were 3% and of 512 CTAs (b = 4, where three of
// its CTAs of 168 registers fit an SM, so two waves) 8% slower (H200; docs/perf/journal.md, 2026-12-03 19:58).
constexpr long long kWideMaxCtas = 128;

// Splits in parallel when a request can have at least this many splits on average (num_sm_parts / batch):
// b = 1 at h_q = 128 (66 parts), b <= 2 at h_q = 16 (132 parts). Against combine_kernel it wins at b = 1 and
// loses from 33 splits per request down (b = 2 at h_q = 128, b >= 4, b = 8 at h_q = 16), where most of its
// warps idle and its CTAs run in several waves (docs/perf/journal.md).
constexpr int kManySplits = 48;

template <typename T>
void launch_combine(const DecodeParams& p) {
  const dim3 grid((p.q_rows + kRowsPerCta - 1) / kRowsPerCta, p.num_heads_kv, p.batch);
  const long long ctas = static_cast<long long>(grid.x) * grid.y * grid.z;
  if (ctas < kFewCtas && p.num_sm_parts >= kManySplits * p.batch) {
    // Most splits one request can have: every part but one per other request, and no more than its blocks in
    // parts of the schedule's smallest size (params.h: kMinPartBlocks, kSparseMinPartBlocks for sparse decode; plus
    // one for a part boundary inside its overhead), block_table's width bounding its blocks. Beyond 8 x 17 (more
    // than 136 splits) combine_splits_kernel takes several rounds; a request with more splits than the kernel's bound
    // is combined correctly, in more rounds.
    const int min_blocks = p.indices != nullptr ? kSparseMinPartBlocks : kMinPartBlocks;
    const int max_splits = std::min(p.num_sm_parts - p.batch + 1,
                                    (p.max_pages_per_seq + min_blocks - 1) / min_blocks + 1);
    const dim3 split_grid(p.q_rows * kSplitChunks, p.num_heads_kv, p.batch);
    const dim3 block(32 * kSplitWarps);
    if (max_splits <= kSplitWarps * 9) {
      launch_combine_kernel(p, combine_splits_kernel<T, 9>, split_grid, block);
    } else {
      launch_combine_kernel(p, combine_splits_kernel<T, 17>, split_grid, block);
    }
  } else if (ctas < kFewCtas) {
    if (ctas * 4 <= kWideMaxCtas) {
      launch_combine<T, 4, true>(p, grid);
    } else {
      launch_combine<T, 4>(p, grid);
    }
  } else {
    launch_combine<T, 1>(p, grid);
  }
}

}  // namespace

void run_combine(const DecodeParams& params) {
  DecodeRequirements requirements;
  requirements.kernel = "combine";
  requirements.formats = ~0u;  // any cache: it reads only the fp32 split accumulators
  check_decode_params(params, requirements);  // includes the grid limit batch <= 65535
  switch (params.dtype) {
    case DType::kBF16: launch_combine<__nv_bfloat16>(params); break;
    case DType::kFP16: launch_combine<__half>(params); break;
    default: FMLA_HOST_CHECK(false, "unsupported dtype " << static_cast<int>(params.dtype));
  }
}

}  // namespace flashmla_backend
