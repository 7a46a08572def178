// Split-KV combine: for every request computed in n > 1 splits, merges the splits' partial
// outputs with log-sum-exp weights and writes out / lse. Requests with one split were written by
// the decode kernel directly and are skipped here.
//
// Grid: (ceil(q_rows / kRowsPerCta), h_kv, batch); one warp per query row, lane j owns the
// 16 output columns {4j..4j+3} + 128 k, k = 0..3 (float4 loads, coalesced across the warp).
// The order of the sums is fixed, so results are bitwise reproducible.
// NOTE (measured, ncu on an H200): with few requests the loop over splits is latency-bound, e.g.
// b=1, h_q=128, 8192 keys: 43 splits, combine 24 us next to a 32 us decode kernel. A variant with one
// 128-thread CTA per row and 8 splits' loads in flight took b=1 from 44 to 37 us end to end, but on
// another H200 host b=128, h_q=128 came out ~5% slower (4x more CTAs, most exiting at once) and it was
// not run under compute-sanitizer, so it is not shipped. Next: pick the layout by batch size.
// With PDL the kernel may start while the decode kernel still runs: it reads num_splits (written
// by the scheduler, which completed before the decode kernel started) and then waits with
// griddepcontrol.wait before touching the accumulators.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "../common/check.h"
#include "../launch.h"
#include "../params.h"

namespace flashmla_backend {
namespace {

constexpr int kRowsPerCta = 4;
constexpr int kThreads = 32 * kRowsPerCta;
constexpr int kColsPerLane = kHeadDimV / 32;  // 16
constexpr int kVecsPerLane = kColsPerLane / 4;  // float4 loads per lane per split
static_assert(kHeadDimV % 128 == 0, "combine assumes 512 = 4 x (32 lanes x 4 floats)");

__device__ __forceinline__ void wait_for_primary_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

template <typename T>
__global__ void __launch_bounds__(kThreads) combine_kernel(DecodeParams p) {
  const int req = blockIdx.z;
  const int hk = blockIdx.y;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kRowsPerCta + warp;

  const int first_split = p.num_splits[req];
  const int n_splits = p.num_splits[req + 1] - first_split;
  if (n_splits <= 1 || row >= p.q_rows) return;

  wait_for_primary_grid();

  // Row r of kv head hk <-> query token s, head h.
  const int s = row / p.ngroups;
  const int h = hk * p.ngroups + row % p.ngroups;
  const long long row_stride = static_cast<long long>(p.num_heads_kv) * p.q_rows;  // per split
  const float* lse_row = p.lse_accum + static_cast<long long>(first_split) * row_stride +
                         static_cast<long long>(hk) * p.q_rows + row;

  // Pass 1: max and sum of exp over the splits' lse (each lane takes splits lane, lane+32, ...).
  float max_lse = -INFINITY;
  for (int i = lane; i < n_splits; i += 32) max_lse = fmaxf(max_lse, lse_row[i * row_stride]);
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, d));

  float* lse_out = p.lse + static_cast<long long>(req) * p.lse_stride_b + static_cast<long long>(h) * p.lse_stride_h + s;
  T* out = static_cast<T*>(p.out) + static_cast<long long>(req) * p.out_stride_b +
           static_cast<long long>(s) * p.out_stride_s + static_cast<long long>(h) * p.out_stride_h;

  if (max_lse == -INFINITY) {  // the row saw no key in any split
    for (int c = lane; c < kHeadDimV; c += 32) out[c] = from_float<T>(0.f);
    if (lane == 0) *lse_out = INFINITY;
    return;
  }

  float sum = 0.f;
  for (int i = lane; i < n_splits; i += 32) sum += expf(lse_row[i * row_stride] - max_lse);
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, d);
  const float final_lse = max_lse + logf(sum);

  // Pass 2: weighted sum of the partial outputs.
  float acc[kColsPerLane];
#pragma unroll
  for (int k = 0; k < kColsPerLane; ++k) acc[k] = 0.f;
  const float* o_row = p.o_accum + (static_cast<long long>(first_split) * row_stride +
                                    static_cast<long long>(hk) * p.q_rows + row) * kHeadDimV;
  for (int base = 0; base < n_splits; base += 32) {
    const int i_mine = base + lane;
    const float w_mine = i_mine < n_splits ? expf(lse_row[i_mine * row_stride] - final_lse) : 0.f;
    const int count = min(32, n_splits - base);
    for (int j = 0; j < count; ++j) {
      const float w = __shfl_sync(0xffffffffu, w_mine, j);
      const float4* src = reinterpret_cast<const float4*>(o_row + (base + j) * row_stride * kHeadDimV);
#pragma unroll
      for (int k = 0; k < kVecsPerLane; ++k) {
        const float4 v = src[k * 32 + lane];
        acc[4 * k + 0] += w * v.x;
        acc[4 * k + 1] += w * v.y;
        acc[4 * k + 2] += w * v.z;
        acc[4 * k + 3] += w * v.w;
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kVecsPerLane; ++k) {
#pragma unroll
    for (int e = 0; e < 4; ++e) out[(k * 32 + lane) * 4 + e] = from_float<T>(acc[4 * k + e]);
  }
  if (lane == 0) *lse_out = final_lse;
}

template <typename T>
void launch_combine(const DecodeParams& p) {
  dim3 grid((p.q_rows + kRowsPerCta - 1) / kRowsPerCta, p.num_heads_kv, p.batch);
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = 0;
  config.stream = static_cast<cudaStream_t>(p.stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = p.pdl ? 1 : 0;
  FMLA_CUDA_CHECK(cudaLaunchKernelEx(&config, combine_kernel<T>, p));
}

}  // namespace

void run_combine(const DecodeParams& params) {
  FMLA_HOST_CHECK(params.batch <= 65535, "combine supports batch <= 65535, got " << params.batch);
  switch (params.dtype) {
    case DType::kBF16: launch_combine<__nv_bfloat16>(params); break;
    case DType::kFP16: launch_combine<__half>(params); break;
    default: FMLA_HOST_CHECK(false, "unsupported dtype " << static_cast<int>(params.dtype));
  }
}

}  // namespace flashmla_backend
