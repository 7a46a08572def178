// GPU probe of the sparse kernel's Q K^T (sparse_fp8/qk.cuh) against fp64, on fp8_ds_mla tokens gathered by index:
//   nvcc -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -I csrc -I <cutlass include> \
//        csrc/sm90/sparse_fp8/checks/qk_probe.cu -o /tmp/sparse_qk_probe && /tmp/sparse_qk_probe
// Not part of the extension build; tests/test_device_checks.py compiles it (no GPU needed) and runs it on a GPU.
//
// One CTA, one warpgroup: it gathers 64 tokens of a pool (cp.async, 16 bytes a thread, at layout.h's offsets), builds
// the Q tile from a bf16 q (header of qk.cuh: one or two e4m3 terms of the latent part under a power-of-two row
// scale, the rope in bf16), runs sparse_qk_block and writes S times the row scale. The host compares with the
// scores in fp64 of the bf16 q and the dequantized tokens (e4m3 value x its group scale; bf16 rope), for token
// sets with one scale for all groups and with group scales spread over 2^[-2, 2], and prints one line per case:
//   case <name> terms <n>: rel-norm error <e> (max abs <a>, max |S| <m>)
// then "qk probe: ok" when every two-term error is within kTwoTermBound and at most half the one-term error of
// the same case, else "qk probe: FAILED" (exit 1). Tokens are quantized as fp8_ds_mla quantizes (group scale =
// the group's amax / 448).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <random>
#include <vector>

#include <cute/tensor.hpp>
#include <cutlass/bfloat16.h>
#include <cutlass/float8.h>

#include "sm90/sparse_fp8/layout.h"
#include "sm90/sparse_fp8/qk.cuh"

using namespace flashmla_backend::sm90::sparse_fp8;
using F8 = cutlass::float_e4m3_t;
using BF = cutlass::bfloat16_t;

constexpr int kRows = 64;
constexpr int kPool = 1024;           // tokens in the pool the indices point into
constexpr double kTwoTermBound = 4e-3;  // rel-norm of S; the precision model's q split error is ~1e-3

#define CUDA_OK(x)                                                                          \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__);       \
      std::exit(2);                                                                         \
    }                                                                                       \
  } while (0)

// Shared memory: the gathered stage, the Q tile's latent terms, its rope, the row scales.
constexpr int kQLatentAt = kStageBytes;                    // 1024-aligned (kStageBytes = 41 KB)
constexpr int kQRopeAt = kQLatentAt + 2 * kLatentBytes;
constexpr int kRowScaleAt = kQRopeAt + kRopeBytes;
constexpr int kSmemBytes = kRowScaleAt + kRows * 4;
static_assert(kQLatentAt % 1024 == 0 && kQRopeAt % 1024 == 0, "swizzled tiles start on 1024 bytes");

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

// Row r = tid / 2, channel half h = tid % 2 (256 latent and 32 rope channels a thread).
template <int kQTerms>
__device__ void build_q_tile(const BF* q, uint8_t* smem, int tid) {
  const int r = tid >> 1, h = tid & 1;
  const BF* qr = q + size_t(r) * 576;
  float amax = 0.f;
  for (int c = 256 * h; c < 256 * h + 256; ++c) amax = fmaxf(amax, fabsf(float(qr[c])));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  // s_r = 2^ceil(log2(amax / 448)): q / s_r fits e4m3 and s_r is exact in every format.
  const float s = amax > 0.f ? exp2f(ceilf(log2f(amax / 448.f))) : 1.f;
  const float inv = 1.f / s;
  if (h == 0) reinterpret_cast<float*>(smem + kRowScaleAt)[r] = s;
  for (int chunk = 16 * h; chunk < 16 * h + 16; ++chunk) {  // 16 latent channels a chunk
    uint8_t hi[16], lo[16];
    for (int j = 0; j < 16; ++j) {
      const float x = float(qr[16 * chunk + j]) * inv;
      const F8 a(x);
      hi[j] = reinterpret_cast<const uint8_t&>(a);
      const F8 b(x - float(a));
      lo[j] = reinterpret_cast<const uint8_t&>(b);
    }
    std::memcpy(smem + kQLatentAt + gather_chunk_offset(r, chunk), hi, 16);
    if (kQTerms == 2) std::memcpy(smem + kQLatentAt + kLatentBytes + gather_chunk_offset(r, chunk), lo, 16);
  }
  for (int chunk = 4 * h; chunk < 4 * h + 4; ++chunk) {  // 8 rope channels a chunk
    BF v[8];
    for (int j = 0; j < 8; ++j) v[j] = BF(float(qr[512 + 8 * chunk + j]) * inv);
    std::memcpy(smem + kQRopeAt + sw128_offset(r, chunk), v, 16);
  }
}

template <int kQTerms>
__global__ void __launch_bounds__(128, 1) qk_probe_kernel(const uint8_t* pool, const int* idx, const BF* q, float* out) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x;
  const uint32_t base = uint32_t(__cvta_generic_to_shared(smem));
  for (int i = tid; i < kBlockTokens * kTokenChunks; i += 128) {
    const int row = i / kTokenChunks, c = i % kTokenChunks;
    cp_async_16(base + gather_chunk_offset(row, c), pool + size_t(idx[row]) * kTokenBytes + c * kChunkBytes);
  }
  asm volatile("cp.async.commit_group;\n\tcp.async.wait_all;" ::: "memory");
  build_q_tile<kQTerms>(q, smem, tid);
  __syncthreads();
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic-proxy writes, read by wgmma
  __syncthreads();

  typename QkTypes::TiledMmaLatent mma;
  Tensor tSrS = partition_fragment_C(mma, Shape<Int<kRows>, Int<kBlockTokens>>{});
  Tensor tmp = partition_fragment_C(mma, Shape<Int<kRows>, Int<kBlockTokens>>{});
  sparse_qk_block<kQTerms>(tid, smem + kQLatentAt, smem + kQRopeAt, smem, tSrS, tmp);

  const int warp = tid >> 5, lane = tid & 31;
  const float* rs = reinterpret_cast<const float*>(smem + kRowScaleAt);
  for (int i = 0; i < size(tSrS); ++i) {
    const int row = 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1);
    const int col = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
    out[row * kBlockTokens + col] = tSrS(i) * rs[row];
  }
}

static float e4m3_value(uint8_t b) {
  F8 f;
  std::memcpy(&f, &b, 1);
  return float(f);
}

struct Case {
  const char* name;
  double spread_log2;  // each group's values times 2^U(-spread, spread) before quantization
};

// Returns {rel-norm error, max abs error, max |S|}.
template <int kQTerms>
static void run_case(const std::vector<uint8_t>& pool, const std::vector<int>& idx, const std::vector<BF>& q,
                     double (&res)[3]) {
  uint8_t* d_pool;
  int* d_idx;
  BF* d_q;
  float* d_out;
  CUDA_OK(cudaMalloc(&d_pool, pool.size()));
  CUDA_OK(cudaMalloc(&d_idx, idx.size() * sizeof(int)));
  CUDA_OK(cudaMalloc(&d_q, q.size() * sizeof(BF)));
  CUDA_OK(cudaMalloc(&d_out, kRows * kBlockTokens * sizeof(float)));
  CUDA_OK(cudaMemcpy(d_pool, pool.data(), pool.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_idx, idx.data(), idx.size() * sizeof(int), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_q, q.data(), q.size() * sizeof(BF), cudaMemcpyHostToDevice));
  CUDA_OK(cudaFuncSetAttribute(qk_probe_kernel<kQTerms>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  qk_probe_kernel<kQTerms><<<1, 128, kSmemBytes>>>(d_pool, d_idx, d_q, d_out);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> out(kRows * kBlockTokens);
  CUDA_OK(cudaMemcpy(out.data(), d_out, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double err2 = 0, ref2 = 0, maxabs = 0, maxref = 0;
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < kBlockTokens; ++t) {
      const uint8_t* tok = &pool[size_t(idx[t]) * kTokenBytes];
      float sc[kGroups];
      std::memcpy(sc, tok + 512, sizeof(sc));
      double ref = 0;
      for (int c = 0; c < 512; ++c) ref += double(float(q[r * 576 + c])) * double(e4m3_value(tok[c])) * sc[c / 128];
      for (int j = 0; j < 64; ++j) {
        BF k;
        std::memcpy(&k, tok + 528 + 2 * j, 2);
        ref += double(float(q[r * 576 + 512 + j])) * double(float(k));
      }
      const double d = double(out[r * kBlockTokens + t]) - ref;
      err2 += d * d;
      ref2 += ref * ref;
      maxabs = std::fmax(maxabs, std::fabs(d));
      maxref = std::fmax(maxref, std::fabs(ref));
    }
  }
  res[0] = std::sqrt(err2 / ref2);
  res[1] = maxabs;
  res[2] = maxref;
  cudaFree(d_pool);
  cudaFree(d_idx);
  cudaFree(d_q);
  cudaFree(d_out);
}

int main() {
  int dev_count = 0;
  if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
    printf("qk probe: no CUDA device\n");
    return 2;
  }
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9) {
    printf("qk probe: needs an sm_90 GPU (this is sm_%d%d)\n", prop.major, prop.minor);
    return 2;
  }
  const Case cases[] = {{"one-scale", 0.0}, {"spread-scales", 2.0}};
  bool ok = true;
  for (const Case& cs : cases) {
    std::mt19937 rng(20261127);
    std::normal_distribution<float> gauss(0.f, 1.f);
    std::uniform_real_distribution<double> uni(-1.0, 1.0);
    std::vector<uint8_t> pool(size_t(kPool) * kTokenBytes);
    for (int p = 0; p < kPool; ++p) {
      uint8_t* tok = &pool[size_t(p) * kTokenBytes];
      float x[512], sc[kGroups];
      for (int g = 0; g < kGroups; ++g) {  // the group's values times a gain 2^U(-spread, spread)
        const float gain = float(std::exp2(cs.spread_log2 * uni(rng)));
        float amax = 0.f;
        for (int c = 128 * g; c < 128 * g + 128; ++c) amax = std::fmax(amax, std::fabs(x[c] = gain * gauss(rng)));
        sc[g] = amax / 448.f;
      }
      for (int c = 0; c < 512; ++c) {  // stored as e4m3(x / scale)
        const F8 v(x[c] / sc[c / 128]);
        std::memcpy(tok + c, &v, 1);
      }
      std::memcpy(tok + 512, sc, sizeof(sc));
      for (int j = 0; j < 64; ++j) {
        const BF v(gauss(rng));
        std::memcpy(tok + 528 + 2 * j, &v, 2);
      }
    }
    std::vector<int> all(kPool);
    for (int i = 0; i < kPool; ++i) all[i] = i;
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int> idx(all.begin(), all.begin() + kBlockTokens);
    std::vector<BF> q(size_t(kRows) * 576);
    for (auto& v : q) v = BF(0.1f * gauss(rng));
    double one[3], two[3];
    run_case<1>(pool, idx, q, one);
    run_case<2>(pool, idx, q, two);
    printf("case %s terms 1: rel-norm error %.3e (max abs %.3e, max |S| %.3e)\n", cs.name, one[0], one[1], one[2]);
    printf("case %s terms 2: rel-norm error %.3e (max abs %.3e, max |S| %.3e)\n", cs.name, two[0], two[1], two[2]);
    if (!(two[0] <= kTwoTermBound && two[0] <= 0.5 * one[0])) ok = false;
  }
  printf("qk probe: %s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
