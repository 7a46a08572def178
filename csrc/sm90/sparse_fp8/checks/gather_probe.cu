// GPU probe of the sparse kernel's gather (sparse_fp8/gather.cuh) run as a pipeline, checked byte for byte:
//   nvcc -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -I csrc -I <cutlass include>
//        csrc/sm90/sparse_fp8/checks/gather_probe.cu -o /tmp/sparse_gather_probe && /tmp/sparse_gather_probe
// (one command) Not part of the extension build; tests/test_device_checks.py compiles it (no GPU needed) and runs it
// on a GPU.
//
// One CTA: warp 4 gathers the blocks of one query token's index row into a ring of two stages, one block's copies in
// flight while it issues the next (a commit group a block; cp.async.wait_group 1, fence.proxy.async, then every lane
// arrives on the stage's full barrier, lane 0 after writing the block's entry mask); warps 0..3 wait for each block,
// compare every 16-byte chunk of the stage with the token's bytes in global memory (zeros for an entry that names no
// token) and the mask with the one computed on the host, and release the stage (one arrival a warp). The index rows
// mix valid entries, FlashMLA's -1, indices past the cache (INT_MAX among them) and repeats, with n_used (the row's
// topk_length) cutting a block, a whole row, or nothing. Prints per case:
//   gather case <name>: <blocks> blocks, <n> wrong chunks, <m> wrong masks
// then "gather probe: ok" when nothing is wrong, else "gather probe: FAILED" (exit 1).
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include "sm90/decode/copies.cuh"  // cp_async_commit, cp_async_wait_all
#include "sm90/sparse_fp8/checks/probe_common.cuh"
#include "sm90/sparse_fp8/gather.cuh"
#include "sm90/sparse_fp8/layout.h"

using namespace flashmla_backend::sm90::sparse_fp8;
using flashmla_backend::sm90::sparse_fp8::probe::have_sm90;

constexpr int kStages = 2;
constexpr int kConsumerWarps = 4;
constexpr int kThreads = 32 * (kConsumerWarps + 1);

struct alignas(1024) Smem {
  uint8_t stage[kStages][kStageBytes];  // kStageBytes = 41 KB, a multiple of 1024
  uint64_t mask[kStages];
  cutlass::arch::ClusterBarrier full[kStages];   // 32 arrivals: the gather warp's lanes, once their copies landed
  cutlass::arch::ClusterBarrier empty[kStages];  // kConsumerWarps arrivals
};

__device__ __forceinline__ void wait_parity(cutlass::arch::ClusterBarrier& bar, uint32_t parity) { bar.wait(parity); }

// errors[0]: wrong chunks, errors[1]: wrong masks.
__global__ void __launch_bounds__(kThreads, 1) gather_probe_kernel(const uint8_t* cache, int64_t num_tokens,
                                                                   const int* row, int n_used, int num_blocks,
                                                                   const uint64_t* expected_masks, int* errors) {
  extern __shared__ __align__(1024) uint8_t raw[];
  Smem& ss = *reinterpret_cast<Smem*>(raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      ss.full[s].init(32);
      ss.empty[s].init(kConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warp == kConsumerWarps) {  // the gather warp
    uint64_t prev_mask = 0;
    for (int b = 0; b <= num_blocks; ++b) {
      if (b < num_blocks) {
        const int s = b % kStages;
        if (b >= kStages) wait_parity(ss.empty[s], uint32_t((b / kStages - 1) & 1));
        const uint32_t stage_addr = uint32_t(__cvta_generic_to_shared(ss.stage[s]));
        const uint64_t mask = gather_block_warp(stage_addr, cache, num_tokens, row, 64 * b, n_used, lane);
        flashmla_backend::sm90::decode::cp_async_commit();
        if (b > 0) asm volatile("cp.async.wait_group 1;\n" ::: "memory");  // block b - 1 landed, block b in flight
        if (b > 0) {
          const int sp = (b - 1) % kStages;
          cutlass::arch::fence_view_async_shared();
          if (lane == 0) ss.mask[sp] = prev_mask;
          ss.full[sp].arrive();
        }
        prev_mask = mask;
      } else if (b > 0) {  // the last block
        flashmla_backend::sm90::decode::cp_async_wait_all();
        const int sp = (b - 1) % kStages;
        cutlass::arch::fence_view_async_shared();
        if (lane == 0) ss.mask[sp] = prev_mask;
        ss.full[sp].arrive();
      }
    }
    return;
  }

  // The checking warps.
  int wrong = 0, wrong_masks = 0;
  for (int b = 0; b < num_blocks; ++b) {
    const int s = b % kStages;
    wait_parity(ss.full[s], uint32_t((b / kStages) & 1));
    for (int i = tid; i < kBlockTokens * kTokenChunks; i += 32 * kConsumerWarps) {
      const int r = i / kTokenChunks, c = i % kTokenChunks, e = 64 * b + r;
      const int v = e < n_used ? row[e] : -1;
      const uint4 got = *reinterpret_cast<const uint4*>(ss.stage[s] + gather_chunk_offset(r, c));
      uint4 want = make_uint4(0, 0, 0, 0);
      if (index_valid(v, num_tokens)) want = *reinterpret_cast<const uint4*>(cache + int64_t(v) * kTokenBytes + 16 * c);
      wrong += (got.x != want.x) || (got.y != want.y) || (got.z != want.z) || (got.w != want.w);
    }
    if (tid == 0) wrong_masks += ss.mask[s] != expected_masks[b];
    __syncwarp();
    if (lane == 0) ss.empty[s].arrive();
  }
  atomicAdd(&errors[0], wrong);
  atomicAdd(&errors[1], wrong_masks);
}

struct Case {
  const char* name;
  int topk;    // entries in the row (a multiple of 64 here, as the engines' top-k are)
  int n_used;  // entries that count (topk_length)
};

int main() {
  if (!have_sm90("gather probe")) return 2;
  const int64_t num_tokens = 3000;  // a cache of 3000 tokens (not a multiple of 64: its last page is partly unused)
  std::mt19937 rng(20261128);
  std::vector<uint8_t> cache(size_t(num_tokens) * kTokenBytes);
  for (auto& x : cache) x = uint8_t(rng());
  uint8_t* cache_d = nullptr;
  CUDA_OK(cudaMalloc(&cache_d, cache.size()));
  CUDA_OK(cudaMemcpy(cache_d, cache.data(), cache.size(), cudaMemcpyHostToDevice));
  int* errors_d = nullptr;
  CUDA_OK(cudaMalloc(&errors_d, 2 * sizeof(int)));
  CUDA_OK(cudaFuncSetAttribute(gather_probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sizeof(Smem))));

  const Case cases[] = {{"all-used", 640, 640}, {"cut-mid-block", 640, 600}, {"cut-at-block", 640, 512},
                        {"none-used", 256, 0}, {"one-block", 64, 64}};
  bool ok = true;
  for (const Case& cs : cases) {
    std::vector<int> row(cs.topk);
    for (int e = 0; e < cs.topk; ++e) {
      const unsigned kind = rng() % 16;
      row[e] = kind == 0   ? -1                                      // FlashMLA's skip
               : kind == 1 ? int(num_tokens + rng() % 1000)          // past the cache
               : kind == 2 ? INT_MAX                                  // far past it
               : kind == 3 ? (e > 0 ? row[e - 1] : 0)                 // a repeat
                           : int(rng() % uint32_t(num_tokens));
    }
    const int num_blocks = cs.topk / kBlockTokens;
    std::vector<uint64_t> masks(num_blocks, 0);
    for (int e = 0; e < cs.topk; ++e)
      if (e < cs.n_used && index_valid(row[e], num_tokens)) masks[e / 64] |= uint64_t(1) << (e % 64);
    int* row_d = nullptr;
    uint64_t* masks_d = nullptr;
    CUDA_OK(cudaMalloc(&row_d, row.size() * sizeof(int)));
    CUDA_OK(cudaMalloc(&masks_d, masks.size() * sizeof(uint64_t)));
    CUDA_OK(cudaMemcpy(row_d, row.data(), row.size() * sizeof(int), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(masks_d, masks.data(), masks.size() * sizeof(uint64_t), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(errors_d, 0, 2 * sizeof(int)));
    gather_probe_kernel<<<1, kThreads, sizeof(Smem)>>>(cache_d, num_tokens, row_d, cs.n_used, num_blocks, masks_d,
                                                       errors_d);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    int errors[2];
    CUDA_OK(cudaMemcpy(errors, errors_d, sizeof(errors), cudaMemcpyDeviceToHost));
    printf("gather case %s: %d blocks, %d wrong chunks, %d wrong masks\n", cs.name, num_blocks, errors[0], errors[1]);
    ok = ok && errors[0] == 0 && errors[1] == 0;
    CUDA_OK(cudaFree(row_d));
    CUDA_OK(cudaFree(masks_d));
  }
  CUDA_OK(cudaFree(cache_d));
  CUDA_OK(cudaFree(errors_d));
  printf("gather probe: %s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
