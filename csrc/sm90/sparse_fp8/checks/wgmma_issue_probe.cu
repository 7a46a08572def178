// GPU probe: how long does a warpgroup take to issue a batch of e4m3 wgmma (both operands in shared memory), and how
// long until the batch completes?
//   nvcc -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -I csrc -I <cutlass include>
//        csrc/sm90/sparse_fp8/checks/wgmma_issue_probe.cu -o /tmp/wgmma_issue_probe && /tmp/wgmma_issue_probe
// (one command) Not part of the extension build; tests/test_device_checks.py compiles it (no GPU needed).
//
// The question: the sparse kernel's timeline build shows warpgroup 0 spending 0.39-0.48 µs issuing the next block's
// first two group products (16 wgmma m64n64k32, 512 tensor-core cycles), about their execution time, so the
// products it issues "before the softmax" may not run under the softmax at all (docs/perf/journal.md, 2026-12-03). If
// issuing a wgmma waits for room in a short queue, a warpgroup only overlaps its own CUDA-core work with the last few
// products it issued, and instruction size (N) decides how much that is.
//
// One CTA an SM, one warpgroup (then two, issuing at once); for each instruction shape (m64nNk32 e4m3, N = 64, 128, 256) and batch size k, the
// warpgroup issues k products into one accumulator as one commit group, thread 0 reading the SM clock before the
// first, after the last (issue) and after the wait for the group (total); 20 repetitions, the median of CTA 0 printed
// with the tensor-core cycles of the batch (k N / 2: 64 x N x 32 at 8,192 e4m3 FLOP a cycle an SM). Then the same
// batch issued, followed by a loop of 50 dependent FMA (about 1,300 cycles), then the wait: the loop overlaps the
// products only where the issue returned before they ran. Every batch's products are added into the loop's value
// after its wait, so that none is dead code. The operands are zeros (the time does not depend on values).
// Measured (H200; docs/perf/journal.md, 2026-12-03): about eight products can be outstanding, and they are the SM's,
// not a warpgroup's: one warpgroup's 16 m64n64k32 return after 335 of their 574 cycles; two warpgroups issuing 4
// m64n64k32 each at once return after 62 and 100 cycles, 8 each after 306 and 380, 16 each after 819 and 889; 4
// m64n128k32 each after 62 and 139, 8 each after 682 and 562.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/float8.h>

#include "sm90/sparse_fp8/checks/probe_common.cuh"

using namespace cute;
using flashmla_backend::sm90::sparse_fp8::probe::have_sm90;
using F8 = cutlass::float_e4m3_t;

constexpr int kReps = 20;
constexpr int kMaxK = 16;  // k32 steps in the operand tiles

template <int N>
struct Shapes {
  using Mma = decltype(make_tiled_mma(
      GMMA::ss_op_selector<F8, F8, float, Shape<Int<64>, Int<N>, Int<32 * kMaxK>>, GMMA::Major::K, GMMA::Major::K>()));
  using ALayout = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<F8>{}, Shape<Int<64>, Int<32 * kMaxK>>{}));
  using BLayout = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<F8>{}, Shape<Int<N>, Int<32 * kMaxK>>{}));
};

// out[(rep * 2 + arith) * 2 + {0, 1}]: issue cycles and total cycles, without and with the arithmetic
// W warpgroups issue the same batch at once (from the same barrier), each into its own accumulator; the records are
// warpgroup 0's, and with W = 2 also warpgroup 1's at out[kReps * 4 + ...] in the same order.
template <int N, int K, int W>
__global__ void __launch_bounds__(128 * W, 1) wgmma_issue_kernel(long long* out, float* sink) {
  extern __shared__ __align__(1024) uint8_t raw[];
  using S = Shapes<N>;
  F8* a = reinterpret_cast<F8*>(raw);
  F8* b = reinterpret_cast<F8*>(raw + 64 * 32 * kMaxK);
  for (int i = threadIdx.x; i < (64 + N) * 32 * kMaxK / 16; i += 128 * W) reinterpret_cast<uint4*>(raw)[i] = uint4{};
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  __syncthreads();
  cutlass::arch::fence_view_async_shared();
  typename S::Mma mma;
  auto thr = mma.get_slice(tid);
  Tensor sA = make_tensor(make_smem_ptr(a), typename S::ALayout{});
  Tensor sB = make_tensor(make_smem_ptr(b), typename S::BLayout{});
  Tensor tA = thr.partition_fragment_A(sA);
  Tensor tB = thr.partition_fragment_B(sB);
  Tensor acc = partition_fragment_C(mma, Shape<Int<64>, Int<N>>{});
  float x = float(threadIdx.x);
  for (int rep = 0; rep < kReps; ++rep) {
#pragma unroll 1
    for (int arith = 0; arith < 2; ++arith) {  // rolled: one accumulator (two made N = 256 serialize, C7512)
      __syncwarp();
      asm volatile("bar.sync 1, %0;\n" ::"n"(128 * W) : "memory");
      const long long t0 = clock64();
      mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < K; ++k) {
        cute::gemm(mma, tA(_, _, k % kMaxK), tB(_, _, k % kMaxK), acc);
        mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      const long long t1 = clock64();
      if (arith) {
#pragma unroll 1
        for (int i = 0; i < 50; ++i) x = fmaf(x, 1.0001f, 0.5f);  // dependent FMA
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc);
      const long long t2 = clock64();
      for (int i = 0; i < size(acc); ++i) x += acc(i);  // every batch's products used
      if (tid == 0 && blockIdx.x == 0) {
        out[wg * kReps * 4 + (rep * 2 + arith) * 2 + 0] = t1 - t0;
        out[wg * kReps * 4 + (rep * 2 + arith) * 2 + 1] = t2 - t0;
      }
    }
  }
  if (x == 12345.f) sink[threadIdx.x] = x;  // keeps the products and the arithmetic
}

template <int N, int K, int W = 1>
void run(int sms, long long* d_out, float* d_sink) {
  const int smem = (64 + N) * 32 * kMaxK;
  auto kern = wgmma_issue_kernel<N, K, W>;
  CUDA_OK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kern<<<sms, 128 * W, smem>>>(d_out, d_sink);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<long long> h(kReps * 4 * W);
  CUDA_OK(cudaMemcpy(h.data(), d_out, h.size() * sizeof(long long), cudaMemcpyDeviceToHost));
  auto med = [&](int wg, int j) {  // j = arith * 2 + {0: issue, 1: total}
    std::vector<long long> v;
    for (int r = 2; r < kReps; ++r) v.push_back(h[wg * kReps * 4 + r * 4 + j]);
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  if (W == 1)
    printf("| m64n%dk32 | %d | %d | %lld | %lld | %lld | %lld |\n", N, K, K * N / 2, med(0, 0), med(0, 1), med(0, 2),
           med(0, 3));
  else
    printf("| 2 x m64n%dk32 | %d | %d | %lld / %lld | %lld / %lld |\n", N, K, 2 * K * N / 2, med(0, 0), med(1, 0),
           med(0, 1), med(1, 1));
}

int main() {
  if (!have_sm90("wgmma issue probe")) return 2;
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  long long* d_out = nullptr;
  float* d_sink = nullptr;
  CUDA_OK(cudaMalloc(&d_out, 2 * kReps * 4 * sizeof(long long)));
  CUDA_OK(cudaMalloc(&d_sink, 256 * sizeof(float)));
  printf("wgmma issue probe: %d SMs, one warpgroup each; SM cycles, medians of CTA 0\n", sms);
  printf("| instruction | batch | tensor cycles | issue | issue + wait | issue, FMA loop after | issue + FMA loop + wait |"
         "\n");
  printf("|---|---|---|---|---|---|---|\n");
  run<64, 1>(sms, d_out, d_sink);
  run<64, 2>(sms, d_out, d_sink);
  run<64, 4>(sms, d_out, d_sink);
  run<64, 8>(sms, d_out, d_sink);
  run<64, 16>(sms, d_out, d_sink);
  run<64, 32>(sms, d_out, d_sink);
  run<128, 1>(sms, d_out, d_sink);
  run<128, 2>(sms, d_out, d_sink);
  run<128, 4>(sms, d_out, d_sink);
  run<128, 8>(sms, d_out, d_sink);
  run<128, 16>(sms, d_out, d_sink);
  run<256, 1>(sms, d_out, d_sink);
  run<256, 2>(sms, d_out, d_sink);
  run<256, 4>(sms, d_out, d_sink);
  run<256, 8>(sms, d_out, d_sink);
  // Two warpgroups issuing at once: whether the room for outstanding products is a warpgroup's or the SM's.
  printf("\n| two warpgroups at once | batch each | tensor cycles (both) | issue (wg 0 / wg 1) | issue + wait |\n");
  printf("|---|---|---|---|---|\n");
  run<64, 4, 2>(sms, d_out, d_sink);
  run<64, 8, 2>(sms, d_out, d_sink);
  run<64, 16, 2>(sms, d_out, d_sink);
  run<128, 4, 2>(sms, d_out, d_sink);
  run<128, 8, 2>(sms, d_out, d_sink);
  printf("wgmma issue probe: ok\n");
  return 0;
}
