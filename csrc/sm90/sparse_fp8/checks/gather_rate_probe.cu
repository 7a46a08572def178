// GPU probe: how fast can one SM gather fp8_ds_mla tokens, the sparse kernel's way and with the bulk copy engine?
//   nvcc -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -I csrc -I <cutlass include>
//        csrc/sm90/sparse_fp8/checks/gather_rate_probe.cu -o /tmp/gather_rate_probe && /tmp/gather_rate_probe
// (one command) Not part of the extension build; tests/test_device_checks.py compiles it (no GPU needed).
//
// The question it answers: in the sparse kernel the gather is late at warpgroup 0's softmax in about nine blocks of
// ten (docs/perf/journal.md, 2026-12-02 night), and its warps take ~1.8 µs from a free stage to their last copy
// issued, stalled on their own cp.async address registers (ncu): is a block's gather bound by the copies' issue (the
// load/store unit taking 82 warp-wide cp.async of 16 bytes a lane a block) or by the memory's latency, and would the
// bulk copy engine (one cp.async.bulk of a whole 656-byte token a lane, completing on the stage's mbarrier as bytes)
// deliver a block sooner? Alone on the SM (no consumer work), with the stages released as soon as they land, so the
// time a block is the gather's own.
//
// One CTA an SM (132 on an H100/H200, the shared memory asked for keeps it one), each gathering `blocks` blocks of 64
// random distinct-ish tokens of a 688 MB cache (the benchmark's b128 pool of 8192 tokens a request) through a ring of
// `stages` stages; one consumer warp waits for each stage and releases it at once. Variants:
//   cp.async  the kernel's gather (gather.cuh: gather_half_warp), two warps a half block each, each lane's copies
//             completing on the stage's mbarrier (cp.async.mbarrier.arrive.noinc), the stage's swizzled layout;
//   bulk      one warp: lane 0 arms the stage's mbarrier with the block's bytes, lane l copies tokens l and l + 32
//             (cp.async.bulk, 656 bytes each) into a token-major stage (64 x 656 bytes): what a gather by the bulk copy
//             engine would cost before a re-layout into the wgmma tiles (not measured here);
//   bulk2     the same with two warps, a half block each.
// Prints, per variant and stage count, the median kernel time over 20 launches, the time a block (kernel time /
// blocks, each SM gathering its own), and the bytes gathered per second over all SMs; a check that the last block of
// every CTA holds the right bytes (both layouts) fails the probe ("FAILED", exit 1) if it does not. Then the same with
// two stages on a half, a quarter and an eighth of the SMs: whether a block's time is an SM's limit or the memory's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include "sm90/sparse_fp8/checks/probe_common.cuh"
#include "sm90/sparse_fp8/gather.cuh"
#include "sm90/sparse_fp8/layout.h"

using namespace flashmla_backend::sm90::sparse_fp8;
using flashmla_backend::sm90::sparse_fp8::probe::have_sm90;

constexpr int kMaxStages = 4;
constexpr int kSmemBytes = 200 * 1024;  // one CTA an SM whatever the stage count
constexpr int kThreads = 96;            // warps 0, 1: gather; warp 2: the consumer

enum Variant : int { kCpAsync = 0, kBulk = 1, kBulk2 = 2 };

struct alignas(1024) Smem {
  uint8_t stage[kMaxStages][kStageBytes];  // 41 KB each; the bulk variants use 64 x 656 bytes of it, token-major
  cutlass::arch::ClusterBarrier full[kMaxStages];
  cutlass::arch::ClusterBarrier empty[kMaxStages];
};
static_assert(sizeof(Smem) <= kSmemBytes, "stages exceed the probe's shared memory");
static_assert(kBlockTokens * kTokenBytes <= kStageBytes, "a token-major block fits a stage");

__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// rows: [gridDim.x][blocks * 64] token indices. check: [gridDim.x][kStageBytes], the last block's stage as landed.
__global__ void __launch_bounds__(kThreads, 1)
    gather_rate_kernel(int variant, int stages, int blocks, const uint8_t* cache, int64_t num_tokens, const int* rows,
                       uint8_t* check) {
  extern __shared__ __align__(1024) uint8_t raw[];
  Smem& ss = *reinterpret_cast<Smem*>(raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gather_warps = variant == kBulk ? 1 : 2;
  if (tid == 0) {
    for (int s = 0; s < stages; ++s) {
      // cp.async: each gather lane's arrival once its copies landed (noinc: counted here); bulk: lane 0 of each warp
      ss.full[s].init(variant == kCpAsync ? 2 * 32 : gather_warps);
      ss.empty[s].init(1);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const int* row = rows + int64_t(blockIdx.x) * blocks * kBlockTokens;

  if (warp < gather_warps) {
    for (int b = 0; b < blocks; ++b) {
      const int s = b % stages;
      if (b >= stages) ss.empty[s].wait(uint32_t((b / stages - 1) & 1));
      const uint32_t stage_addr = uint32_t(__cvta_generic_to_shared(ss.stage[s]));
      const uint32_t bar = uint32_t(__cvta_generic_to_shared(&ss.full[s]));
      if (variant == kCpAsync) {
        const int t = half_index(row, b * kBlockTokens, blocks * kBlockTokens, warp, lane);
        gather_half_warp(stage_addr, cache, num_tokens, t, warp, lane);
        cp_async_arrive_on(bar);
      } else {
        const int per_warp = kBlockTokens / gather_warps;  // 64 or 32 tokens
        if (lane == 0) arrive_expect_tx(bar, uint32_t(per_warp * kTokenBytes));
        __syncwarp();
        for (int e = lane; e < per_warp; e += 32) {
          const int entry = warp * per_warp + e;
          const int v = __ldg(row + b * kBlockTokens + entry);
          bulk_copy(stage_addr + uint32_t(entry * kTokenBytes), cache + int64_t(v) * kTokenBytes, kTokenBytes, bar);
        }
      }
    }
  } else if (warp == 2) {  // the consumer: waits for each block and gives its stage back at once
    for (int b = 0; b < blocks; ++b) {
      const int s = b % stages;
      ss.full[s].wait(uint32_t((b / stages) & 1));
      if (b + 1 == blocks) {  // the last block's bytes, for the host's check
        uint4* dst = reinterpret_cast<uint4*>(check + int64_t(blockIdx.x) * kStageBytes);
        const uint4* src = reinterpret_cast<const uint4*>(ss.stage[s]);
        for (int i = lane; i < kStageBytes / 16; i += 32) dst[i] = src[i];
      }
      __syncwarp();
      if (lane == 0) ss.empty[s].arrive();
    }
  }
}

int main() {
  if (!have_sm90("gather rate probe")) return 2;
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t num_tokens = 128LL * 8192;  // 688 MB
  const int blocks = 62;                    // b128 top-k 2048 h_q 128: 8192 blocks of 64 over 132 SMs
  std::mt19937_64 rng(7);
  std::vector<uint8_t> h_cache(size_t(num_tokens) * kTokenBytes);
  for (size_t i = 0; i < h_cache.size(); i += 8) {
    const uint64_t r = rng();
    std::memcpy(&h_cache[i], &r, std::min<size_t>(8, h_cache.size() - i));
  }
  std::vector<int> h_rows(size_t(sms) * blocks * kBlockTokens);
  std::uniform_int_distribution<int64_t> pick(0, num_tokens - 1);
  for (auto& v : h_rows) v = int(pick(rng));
  uint8_t *cache = nullptr, *check = nullptr;
  int* rows = nullptr;
  CUDA_OK(cudaMalloc(&cache, h_cache.size()));
  CUDA_OK(cudaMalloc(&rows, h_rows.size() * sizeof(int)));
  CUDA_OK(cudaMalloc(&check, size_t(sms) * kStageBytes));
  CUDA_OK(cudaMemcpy(cache, h_cache.data(), h_cache.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(rows, h_rows.data(), h_rows.size() * sizeof(int), cudaMemcpyHostToDevice));
  CUDA_OK(cudaFuncSetAttribute(gather_rate_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  // an L2-sized scrub between launches, so that no launch finds the tokens of the one before in L2
  uint8_t* scrub = nullptr;
  const size_t scrub_bytes = 256u << 20;
  CUDA_OK(cudaMalloc(&scrub, scrub_bytes));
  cudaEvent_t t0, t1;
  CUDA_OK(cudaEventCreate(&t0));
  CUDA_OK(cudaEventCreate(&t1));
  std::vector<uint8_t> h_check(size_t(sms) * kStageBytes);
  bool ok = true;
  const char* names[] = {"cp.async", "bulk", "bulk2"};
  printf("gather rate probe: %d SMs, %d blocks of 64 tokens an SM, a 688 MB cache, random tokens\n", sms, blocks);
  printf("| variant | stages | kernel us | us a block | GB/s gathered |\n|---|---|---|---|---|\n");
  // One configuration: the median of 20 launches (after one more), each after the scrub; its row of the table.
  const auto time_row = [&](int variant, int stages, int ctas, int shown) {
    std::vector<float> ms;
    for (int rep = 0; rep < 21; ++rep) {
      CUDA_OK(cudaMemsetAsync(scrub, rep, scrub_bytes));
      CUDA_OK(cudaEventRecord(t0));
      gather_rate_kernel<<<ctas, kThreads, kSmemBytes>>>(variant, stages, blocks, cache, num_tokens, rows, check);
      CUDA_OK(cudaEventRecord(t1));
      CUDA_OK(cudaEventSynchronize(t1));
      CUDA_OK(cudaGetLastError());
      float m = 0.f;
      CUDA_OK(cudaEventElapsedTime(&m, t0, t1));
      if (rep > 0) ms.push_back(m);
    }
    std::sort(ms.begin(), ms.end());
    const double us = 1e3 * ms[ms.size() / 2];
    const double bytes = double(ctas) * blocks * kBlockTokens * kTokenBytes;
    printf("| %s | %d | %.1f | %.3f | %.0f |\n", names[variant], shown, us, us / blocks, bytes / us * 1e-3);
  };
  for (int variant = 0; variant < 3; ++variant) {
    for (int stages = 1; stages <= kMaxStages; ++stages) {
      time_row(variant, stages, sms, stages);
      // the last block of every CTA, byte for byte
      CUDA_OK(cudaMemcpy(h_check.data(), check, h_check.size(), cudaMemcpyDeviceToHost));
      int64_t wrong = 0;
      for (int cta = 0; cta < sms; ++cta) {
        const uint8_t* got = h_check.data() + size_t(cta) * kStageBytes;
        const int* r = h_rows.data() + (size_t(cta) * blocks + blocks - 1) * kBlockTokens;
        for (int e = 0; e < kBlockTokens; ++e) {
          const uint8_t* tok = h_cache.data() + size_t(r[e]) * kTokenBytes;
          for (int c = 0; c < kTokenChunks; ++c) {
            const uint8_t* at = variant == kCpAsync ? got + gather_chunk_offset(e, c) : got + e * kTokenBytes + 16 * c;
            wrong += std::memcmp(at, tok + 16 * c, 16) != 0;
          }
        }
      }
      if (wrong) {
        printf("  %s, %d stages: %lld wrong chunks in the last blocks\n", names[variant], stages, (long long)wrong);
        ok = false;
      }
    }
  }
  // The same with fewer SMs gathering (two stages): a block's time that stays the same is an SM's own limit (its
  // copies in flight), one that drops is the memory's (all SMs together).
  printf("\n| variant | SMs gathering | kernel us | us a block | GB/s gathered |\n|---|---|---|---|---|\n");
  for (int variant = 0; variant < 3; variant += 2) {
    for (int ctas : {sms, sms / 2, sms / 4, sms / 8}) time_row(variant, 2, ctas, ctas);
  }
  printf("gather rate probe: %s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
