// Split-KV combine: for every request computed in n > 1 splits, merges the splits' partial
// outputs with log-sum-exp weights and writes out / lse. Requests with one split were written by
// the decode kernel directly and are skipped here.
//
// Grid: (q_rows, h_kv, batch), 128 threads per query row; thread t owns output columns 4t .. 4t+3
// (one float4 per split, coalesced across the CTA). The split loop issues kUnroll independent loads
// before using them: with few requests (b = 1) a row has tens of splits, and a loop that waits on one
// split at a time was latency-bound (24 us for b=1, h_q=128, 43 splits, measured with ncu on an H200).
// The order of the sums is fixed, so results are bitwise reproducible.
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

constexpr int kThreads = kHeadDimV / 4;  // 128: one float4 of the 512 columns per thread
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 8;               // splits whose loads are in flight together
static_assert(kHeadDimV % 128 == 0 && kThreads % 32 == 0, "combine assumes 512 = 128 threads x float4");

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

// Reductions over the CTA in a fixed order (deterministic). `scratch` holds one value per warp.
template <bool kMax>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, v, d);
    v = kMax ? fmaxf(v, o) : v + o;
  }
  __syncthreads();  // scratch may still be read by a previous reduction
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) v = kMax ? fmaxf(v, scratch[w]) : v + scratch[w];
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) combine_kernel(DecodeParams p) {
  const int req = blockIdx.z;
  const int hk = blockIdx.y;
  const int row = blockIdx.x;
  const int tid = threadIdx.x;
  __shared__ float scratch[kWarps];

  const int first_split = p.num_splits[req];
  const int n_splits = p.num_splits[req + 1] - first_split;
  if (n_splits <= 1) return;

  wait_for_primary_grid();

  // Row r of kv head hk <-> query token s, head h.
  const int s = row / p.ngroups;
  const int h = hk * p.ngroups + row % p.ngroups;
  const long long row_stride = static_cast<long long>(p.num_heads_kv) * p.q_rows;  // rows per split
  const float* lse_row = p.lse_accum + static_cast<long long>(first_split) * row_stride +
                         static_cast<long long>(hk) * p.q_rows + row;
  float* lse_out = p.lse + static_cast<long long>(req) * p.lse_stride_b + static_cast<long long>(h) * p.lse_stride_h + s;
  T* out = static_cast<T*>(p.out) + static_cast<long long>(req) * p.out_stride_b +
           static_cast<long long>(s) * p.out_stride_s + static_cast<long long>(h) * p.out_stride_h + 4 * tid;

  // Pass 1: max and sum of exp over the splits' lse.
  float max_lse = -INFINITY;
  for (int i = tid; i < n_splits; i += kThreads) max_lse = fmaxf(max_lse, lse_row[i * row_stride]);
  max_lse = block_reduce<true>(max_lse, scratch);
  if (max_lse == -INFINITY) {  // the row saw no key in any split
#pragma unroll
    for (int e = 0; e < 4; ++e) out[e] = from_float<T>(0.f);
    if (tid == 0) *lse_out = INFINITY;
    return;
  }
  float sum = 0.f;
  for (int i = tid; i < n_splits; i += kThreads) sum += expf(lse_row[i * row_stride] - max_lse);
  sum = block_reduce<false>(sum, scratch);
  const float final_lse = max_lse + logf(sum);

  // Pass 2: weighted sum of the partial outputs, kUnroll splits in flight.
  const float4* o_col = reinterpret_cast<const float4*>(
      p.o_accum + (static_cast<long long>(first_split) * row_stride + static_cast<long long>(hk) * p.q_rows + row) *
                      kHeadDimV) + tid;
  const long long split_step = row_stride * (kHeadDimV / 4);  // float4s between splits
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  int i = 0;
  for (; i + kUnroll <= n_splits; i += kUnroll) {
    float4 v[kUnroll];
    float l[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      v[j] = o_col[(i + j) * split_step];
      l[j] = lse_row[(i + j) * row_stride];
    }
    asm volatile("" ::: "memory");  // keep every load of the group ahead of the first use (latency)
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const float w = expf(l[j] - final_lse);
      acc.x += w * v[j].x;
      acc.y += w * v[j].y;
      acc.z += w * v[j].z;
      acc.w += w * v[j].w;
    }
  }
  for (; i < n_splits; ++i) {
    const float4 v = o_col[i * split_step];
    const float w = expf(lse_row[i * row_stride] - final_lse);
    acc.x += w * v.x;
    acc.y += w * v.y;
    acc.z += w * v.z;
    acc.w += w * v.w;
  }
  out[0] = from_float<T>(acc.x);
  out[1] = from_float<T>(acc.y);
  out[2] = from_float<T>(acc.z);
  out[3] = from_float<T>(acc.w);
  if (tid == 0) *lse_out = final_lse;
}

template <typename T>
void launch_combine(const DecodeParams& p) {
  dim3 grid(p.q_rows, p.num_heads_kv, p.batch);
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
