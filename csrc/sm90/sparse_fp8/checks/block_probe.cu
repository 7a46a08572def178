// GPU probe of the sparse kernel's two products of a gathered block against fp64, on fp8_ds_mla tokens gathered by
// index (sparse_fp8/qk.cuh: Q K^T; sparse_fp8/pv.cuh: P V):
//   nvcc -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -I csrc -I <cutlass include>
//        csrc/sm90/sparse_fp8/checks/block_probe.cu -o /tmp/sparse_block_probe && /tmp/sparse_block_probe
// (one command)
// Not part of the extension build; tests/test_device_checks.py compiles it (no GPU needed) and runs it on a GPU.
//
// One CTA, one warpgroup. Both kernels gather 64 tokens of a pool (cp.async, 16 bytes a thread, at layout.h's
// offsets). The Q K^T kernel builds the Q tile from a bf16 q (qk.cuh's header: one or two e4m3 terms of the latent
// part under a power-of-two row scale, the rope in bf16), runs sparse_qk_block and writes S times the row scale;
// the host compares with the scores in fp64 of the bf16 q and the dequantized tokens (e4m3 value x its group scale;
// bf16 rope). The P V kernel transposes the latent tiles, takes a P of 64 rows x 64 tokens with values in (0, 256]
// (the kernel's P scaling), runs sparse_pv_group per group with one or two e4m3 terms of P s[t, g] and writes O / the
// group factor; the host compares with P times the dequantized latent values in fp64. Tokens are quantized as
// fp8_ds_mla quantizes (a group's scale = its amax / 448), with every group's values drawn at one gain ("one-scale")
// and at gains spread over 2^[-2, 2] ("spread-scales"). One line per product, case and term count:
//   <qk|pv> case <name> terms <n>: rel-norm error <e> (max abs <a>, max |ref| <m>)
// Then the chain: P V over kChainBlocks gathered blocks (a top-k of 2,048 tokens, one CTA's whole piece) with two
// e4m3 terms of P and one group factor for the whole chain (from the chain's largest scale of the group, as a kernel
// that only lowers its factor ends up with), into one accumulator for the chain ("piece", as a kernel would keep O)
// and into a fresh accumulator every block added into O in fp32 ("block"). The first measures what the e4m3 wgmma's
// accumulator keeps over a top-k (benchmarks/sparse_fp8_precision_model.py: 1.9e-3 with 16 bits, 4.3e-3 with 14, 8.4e-3
// with 13, spread scales); the second is the remedy's:
//   pv-chain case <name> terms 2 accumulator <piece|block>: rel-norm error <e> (max abs <a>, max |ref| <m>)
// and the same chain at other lengths (kChainLengths; past the pool's 64 blocks of distinct tokens the tokens repeat):
//   pv-chain-length case <name> blocks <n> accumulator <piece|block>: rel-norm error <e> (...)
// then "block probe: ok" when every two-term error of one block is within kTwoTermBound and at most half the one-term
// error of the same product and case, the chain's per-block accumulator within kTwoTermBound and its one accumulator
// within kChainBound, else "block probe: FAILED" (exit 1).
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

#include "sm90/decode/copies.cuh"  // cp_async_16 / commit / wait_all
#include "sm90/sparse_fp8/layout.h"
#include "sm90/sparse_fp8/pv.cuh"
#include "sm90/sparse_fp8/qk.cuh"
#include "sm90/sparse_fp8/checks/probe_common.cuh"

using namespace flashmla_backend::sm90::sparse_fp8;
using namespace flashmla_backend::sm90::sparse_fp8::probe;

constexpr int kRows = 64;
constexpr int kChainBlocks = 32;      // the chain's blocks: a top-k of 2,048
// Every chain length run: kChainBlocks, then shorter and longer chains, for what the accumulator keeps over a dense
// request piece (docs/perf/journal.md, 2026-11-30: the accurate mode's stacked tile with a two-term P).
constexpr int kChainLengths[] = {kChainBlocks, 8, 16, 64, 128};
constexpr int kPool = 4096;           // tokens in the pool the indices point into
constexpr double kTwoTermBound = 4e-3;  // rel-norm of S or O; the precision model: ~1e-3 for two terms
constexpr double kChainBound = 2e-2;    // the chain in one accumulator: a bound on the measurement, not a target

// Shared memory: the gathered stage, the Q tile's latent terms, its rope, the row scales.
constexpr int kQLatentAt = kStageBytes;                    // 1024-aligned (kStageBytes = 41 KB)
constexpr int kQRopeAt = kQLatentAt + 2 * kLatentBytes;
constexpr int kRowScaleAt = kQRopeAt + kRopeBytes;
constexpr int kSmemBytes = kRowScaleAt + kRows * 4;
static_assert(kQLatentAt % 1024 == 0 && kQRopeAt % 1024 == 0, "swizzled tiles start on 1024 bytes");

// The 64 tokens idx[0..63] of the pool into the stage at smem (layout.h), 16 bytes a thread at a time; returns the
// stage's shared address once this thread's copies landed.
__device__ uint32_t gather_block(uint8_t* smem, const uint8_t* pool, const int* idx, int tid) {
  const uint32_t base = uint32_t(__cvta_generic_to_shared(smem));
  if (base & 1023u) __trap();  // the swizzled tiles need 1024-byte alignment
  for (int i = tid; i < kBlockTokens * kTokenChunks; i += 128) {
    const int row = i / kTokenChunks, c = i % kTokenChunks;
    flashmla_backend::sm90::decode::cp_async_16(base + gather_chunk_offset(row, c),
                                                pool + size_t(idx[row]) * kTokenBytes + c * kChunkBytes, true);
  }
  flashmla_backend::sm90::decode::cp_async_commit();
  flashmla_backend::sm90::decode::cp_async_wait_all();
  return base;
}

template <int kQTerms>
__global__ void __launch_bounds__(128, 1) qk_probe_kernel(const uint8_t* pool, const int* idx, const BF* q,
                                                          float* out) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x;
  const uint32_t base = gather_block(smem, pool, idx, tid);
  build_q_tile<kQTerms>(q, smem + kQLatentAt, smem + kQRopeAt, reinterpret_cast<float*>(smem + kRowScaleAt), tid);
  __syncthreads();
  cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read by wgmma
  __syncthreads();

  typename QkTypes::TiledMmaLatent mma;
  Tensor tSrS = partition_fragment_C(mma, Shape<Int<kRows>, Int<kBlockTokens>>{});
  Tensor tmp0 = partition_fragment_C(mma, Shape<Int<kRows>, Int<kBlockTokens>>{});
  Tensor tmp1 = partition_fragment_C(mma, Shape<Int<kRows>, Int<kBlockTokens>>{});
  sparse_qk_block<kQTerms>(tid, smem + kQLatentAt, smem + kQRopeAt, smem, tSrS, tmp0, tmp1);

  const float* rs = reinterpret_cast<const float*>(smem + kRowScaleAt);
  for (int i = 0; i < size(tSrS); ++i) {
    out[acc_row(tid, i) * kBlockTokens + acc_col(tid, i)] = tSrS(i) * rs[acc_row(tid, i)];
  }
}

// P V: shared memory = the gathered stage, then the two V^T halves.
constexpr int kVtAt = kStageBytes;
constexpr int kPvSmemBytes = kVtAt + 2 * flashmla_backend::sm90::decode_fp8::kVtHalfBytes;
static_assert(kVtAt % 1024 == 0, "V^T starts on 1024 bytes");

template <int kPTerms>
__global__ void __launch_bounds__(128, 1) pv_probe_kernel(const uint8_t* pool, const int* idx, const float* p_in,
                                                          float* out) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const uint32_t base = gather_block(smem, pool, idx, tid);
  __syncthreads();
  transpose_latent(base, base + kVtAt, warp, lane);
  cutlass::arch::fence_view_async_shared();  // stmatrix writes, read by wgmma
  __syncthreads();

  typename QkTypes::TiledMmaLatent mma_s;
  Tensor p = partition_fragment_C(mma_s, Shape<Int<kRows>, Int<kBlockTokens>>{});
  for (int i = 0; i < size(p); ++i) p(i) = p_in[acc_row(tid, i) * kBlockTokens + acc_col(tid, i)];
  const float* scales = reinterpret_cast<const float*>(smem + kScalesAt);
  typename PvTypes::TiledMma mma_o;
  Tensor o = partition_fragment_C(mma_o, Shape<Int<kRows>, Int<128>>{});
  for (int g = 0; g < kGroups; ++g) {
    float max_s = 0.f;  // the block's largest scale of group g: a quad's lanes hold all 64 tokens
    for (int c = 0; c < 8; ++c)
      for (int e = 0; e < 2; ++e) max_s = fmaxf(max_s, scales[(8 * c + 2 * (lane & 3) + e) * kGroups + g]);
    max_s = fmaxf(max_s, __shfl_xor_sync(0xffffffffu, max_s, 1));
    max_s = fmaxf(max_s, __shfl_xor_sync(0xffffffffu, max_s, 2));
    const float f = group_factor(max_s, 256.f);
    uint32_t words[kPTerms][8];
    p_group_words<kPTerms>(p, scales, g, f, lane, words);
    clear(o);
    uint8_t* vt_group = smem + kVtAt + (g >> 1) * flashmla_backend::sm90::decode_fp8::kVtHalfBytes +
                        (g & 1) * (flashmla_backend::sm90::decode_fp8::kVtHalfBytes / 2);
    sparse_pv_group<kPTerms>(tid, words, vt_group, o);
    warpgroup_wait<0>();
    warpgroup_fence_operand(o);
    for (int i = 0; i < size(o); ++i) {
      const int column = 128 * g + flashmla_backend::sm90::decode_fp8::vt_row_column(acc_col(tid, i));
      out[acc_row(tid, i) * 512 + column] = o(i) / f;
    }
  }
}

// P V over the chain's blocks, one group at a time (O of one group is 64 registers a thread; all four would be 256):
// every block gathered and transposed again for each group. factors[g]: the chain's group factor. kFlush: a fresh
// accumulator a block, added into O in fp32; else one accumulator for the chain.
static void compare(const std::vector<float>& got, const std::vector<double>& ref, double (&res)[3]);

template <bool kFlush>
__global__ void __launch_bounds__(128, 1) pv_chain_kernel(const uint8_t* pool, const int* idx, const float* p_in,
                                                          const float* factors, float* out, int chain_blocks) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  typename QkTypes::TiledMmaLatent mma_s;
  Tensor p = partition_fragment_C(mma_s, Shape<Int<kRows>, Int<kBlockTokens>>{});
  typename PvTypes::TiledMma mma_o;
  Tensor o = partition_fragment_C(mma_o, Shape<Int<kRows>, Int<128>>{});
  Tensor part = partition_fragment_C(mma_o, Shape<Int<kRows>, Int<128>>{});
  const float* scales = reinterpret_cast<const float*>(smem + kScalesAt);
  for (int g = 0; g < kGroups; ++g) {
    const float f = factors[g];
    clear(o);
    for (int b = 0; b < chain_blocks; ++b) {
      __syncthreads();  // the last block's stage and V^T are read (its transposition and its wgmma waited)
      const uint32_t base = gather_block(smem, pool, idx + b * kBlockTokens, tid);
      __syncthreads();
      transpose_latent(base, base + kVtAt, warp, lane);
      cutlass::arch::fence_view_async_shared();  // stmatrix writes, read by wgmma
      __syncthreads();
      const float* pb = p_in + size_t(b) * kRows * kBlockTokens;
      for (int i = 0; i < size(p); ++i) p(i) = pb[acc_row(tid, i) * kBlockTokens + acc_col(tid, i)];
      uint32_t words[2][8];
      p_group_words<2>(p, scales, g, f, lane, words);
      uint8_t* vt_group = smem + kVtAt + (g >> 1) * flashmla_backend::sm90::decode_fp8::kVtHalfBytes +
                          (g & 1) * (flashmla_backend::sm90::decode_fp8::kVtHalfBytes / 2);
      if constexpr (kFlush) {
        clear(part);
        sparse_pv_group<2>(tid, words, vt_group, part);
        warpgroup_wait<0>();
        warpgroup_fence_operand(part);
        for (int i = 0; i < size(o); ++i) o(i) += part(i);
      } else {
        sparse_pv_group<2>(tid, words, vt_group, o);
        warpgroup_wait<0>();
        warpgroup_fence_operand(o);
      }
    }
    for (int i = 0; i < size(o); ++i) {
      const int column = 128 * g + flashmla_backend::sm90::decode_fp8::vt_row_column(acc_col(tid, i));
      out[acc_row(tid, i) * 512 + column] = o(i) / f;
    }
  }
}

template <bool kFlush>
static void run_chain(const uint8_t* pool, const int* idx, const float* p, const float* factors, float* out,
                      int chain_blocks, const std::vector<double>& ref, double (&res)[3]) {
  CUDA_OK(cudaFuncSetAttribute(pv_chain_kernel<kFlush>, cudaFuncAttributeMaxDynamicSharedMemorySize, kPvSmemBytes));
  CUDA_OK(cudaMemset(out, 0xFF, kRows * 512 * sizeof(float)));
  pv_chain_kernel<kFlush><<<1, 128, kPvSmemBytes>>>(pool, idx, p, factors, out, chain_blocks);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> h(ref.size());
  CUDA_OK(cudaMemcpy(h.data(), out, h.size() * sizeof(float), cudaMemcpyDeviceToHost));
  compare(h, ref, res);
}

struct Case {
  const char* name;
  double spread_log2;  // each group's values times 2^U(-spread, spread) before quantization
};

// Device copies of a case's inputs.
struct DeviceInputs {
  uint8_t* pool = nullptr;
  int* idx = nullptr;
  BF* q = nullptr;
  float* p = nullptr;
  float* out = nullptr;
  DeviceInputs(const std::vector<uint8_t>& pool_h, const std::vector<int>& idx_h, const std::vector<BF>& q_h,
               const std::vector<float>& p_h) {
    CUDA_OK(cudaMalloc(&pool, pool_h.size()));
    CUDA_OK(cudaMalloc(&idx, idx_h.size() * sizeof(int)));
    CUDA_OK(cudaMalloc(&q, q_h.size() * sizeof(BF)));
    CUDA_OK(cudaMalloc(&p, p_h.size() * sizeof(float)));
    CUDA_OK(cudaMalloc(&out, kRows * 512 * sizeof(float)));
    CUDA_OK(cudaMemcpy(pool, pool_h.data(), pool_h.size(), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(idx, idx_h.data(), idx_h.size() * sizeof(int), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(q, q_h.data(), q_h.size() * sizeof(BF), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(p, p_h.data(), p_h.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  ~DeviceInputs() {
    cudaFree(pool);
    cudaFree(idx);
    cudaFree(q);
    cudaFree(p);
    cudaFree(out);
  }
  void poison() const { CUDA_OK(cudaMemset(out, 0xFF, kRows * 512 * sizeof(float))); }  // NaN: unwritten shows
  std::vector<float> output(size_t n) const {
    std::vector<float> h(n);
    CUDA_OK(cudaMemcpy(h.data(), out, n * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
  }
};

// {rel-norm error, max abs error, max |ref|} of got against ref.
static void compare(const std::vector<float>& got, const std::vector<double>& ref, double (&res)[3]) {
  double err2 = 0, ref2 = 0;
  res[1] = res[2] = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = double(got[i]) - ref[i];
    err2 += d * d;
    ref2 += ref[i] * ref[i];
    res[1] = std::fmax(res[1], std::fabs(d));
    res[2] = std::fmax(res[2], std::fabs(ref[i]));
  }
  res[0] = std::sqrt(err2 / ref2);
}

template <int kQTerms>
static void run_qk(const DeviceInputs& d, const std::vector<double>& ref, double (&res)[3]) {
  CUDA_OK(cudaFuncSetAttribute(qk_probe_kernel<kQTerms>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  d.poison();
  qk_probe_kernel<kQTerms><<<1, 128, kSmemBytes>>>(d.pool, d.idx, d.q, d.out);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  compare(d.output(ref.size()), ref, res);
}

template <int kPTerms>
static void run_pv(const DeviceInputs& d, const std::vector<double>& ref, double (&res)[3]) {
  CUDA_OK(cudaFuncSetAttribute(pv_probe_kernel<kPTerms>, cudaFuncAttributeMaxDynamicSharedMemorySize, kPvSmemBytes));
  d.poison();
  pv_probe_kernel<kPTerms><<<1, 128, kPvSmemBytes>>>(d.pool, d.idx, d.p, d.out);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  compare(d.output(ref.size()), ref, res);
}

int main() {
  if (!have_sm90("block probe")) return 2;
  const Case cases[] = {{"one-scale", 0.0}, {"spread-scales", 2.0}};
  bool ok = true;
  for (const Case& cs : cases) {
    std::mt19937 rng(20261127);
    std::normal_distribution<float> gauss(0.f, 1.f);
    std::uniform_real_distribution<double> uni(-1.0, 1.0);
    std::vector<uint8_t> pool(size_t(kPool) * kTokenBytes);
    for (int t = 0; t < kPool; ++t) {
      uint8_t* tok = &pool[size_t(t) * kTokenBytes];
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
    const std::vector<int> idx(all.begin(), all.begin() + kBlockTokens);
    std::vector<BF> q(size_t(kRows) * 576);
    for (auto& v : q) v = BF(0.1f * gauss(rng));
    std::vector<float> p(size_t(kRows) * kBlockTokens);  // (0, 256], as the kernel's P = 2^8 exp2(s - m)
    for (auto& v : p) v = float(256.0 * std::exp2(-std::fabs(3.0 * gauss(rng))));

    // fp64 references on the dequantized tokens
    std::vector<double> deq(size_t(kBlockTokens) * 576);
    for (int t = 0; t < kBlockTokens; ++t) {
      const uint8_t* tok = &pool[size_t(idx[t]) * kTokenBytes];
      float sc[kGroups];
      std::memcpy(sc, tok + 512, sizeof(sc));
      for (int c = 0; c < 512; ++c) deq[t * 576 + c] = double(e4m3_value(tok[c])) * sc[c / 128];
      for (int j = 0; j < 64; ++j) {
        BF k;
        std::memcpy(&k, tok + 528 + 2 * j, 2);
        deq[t * 576 + 512 + j] = double(float(k));
      }
    }
    std::vector<double> s_ref(size_t(kRows) * kBlockTokens, 0.0), o_ref(size_t(kRows) * 512, 0.0);
    for (int r = 0; r < kRows; ++r)
      for (int t = 0; t < kBlockTokens; ++t) {
        for (int c = 0; c < 576; ++c) s_ref[r * kBlockTokens + t] += double(float(q[r * 576 + c])) * deq[t * 576 + c];
        for (int c = 0; c < 512; ++c) o_ref[r * 512 + c] += double(p[r * kBlockTokens + t]) * deq[t * 576 + c];
      }

    const DeviceInputs d(pool, idx, q, p);
    double res[2][2][3];  // [product][terms - 1]
    run_qk<1>(d, s_ref, res[0][0]);
    run_qk<2>(d, s_ref, res[0][1]);
    run_pv<1>(d, o_ref, res[1][0]);
    run_pv<2>(d, o_ref, res[1][1]);
    for (int k = 0; k < 2; ++k) {
      for (int t = 0; t < 2; ++t)
        printf("%s case %s terms %d: rel-norm error %.3e (max abs %.3e, max |ref| %.3e)\n", k ? "pv" : "qk", cs.name,
               t + 1, res[k][t][0], res[k][t][1], res[k][t][2]);
      if (!(res[k][1][0] <= kTwoTermBound && res[k][1][0] <= 0.5 * res[k][0][0])) ok = false;
    }

    // The chains: kChainLengths[k] blocks (distinct tokens up to the pool's 64 blocks; a longer chain takes the pool's
    // tokens again in turn), a P per block, one factor per group for the chain.
    for (const int chain_blocks : kChainLengths) {
      std::vector<int> chain_idx(size_t(chain_blocks) * kBlockTokens);
      for (size_t i = 0; i < chain_idx.size(); ++i) chain_idx[i] = all[i % all.size()];
      std::vector<float> chain_p(size_t(chain_blocks) * kRows * kBlockTokens);
      for (auto& v : chain_p) v = float(256.0 * std::exp2(-std::fabs(3.0 * gauss(rng))));
      float factors[kGroups];
      std::vector<double> chain_ref(size_t(kRows) * 512, 0.0);
      {
        double max_s[kGroups] = {0, 0, 0, 0};
        std::vector<double> deq_t(512);
        for (int b = 0; b < chain_blocks; ++b)
          for (int t = 0; t < kBlockTokens; ++t) {
            const uint8_t* tok = &pool[size_t(chain_idx[b * kBlockTokens + t]) * kTokenBytes];
            float sc[kGroups];
            std::memcpy(sc, tok + 512, sizeof(sc));
            for (int g = 0; g < kGroups; ++g) max_s[g] = std::fmax(max_s[g], sc[g]);
            for (int c = 0; c < 512; ++c) deq_t[c] = double(e4m3_value(tok[c])) * sc[c / 128];
            for (int r = 0; r < kRows; ++r) {
              const double pv = chain_p[(size_t(b) * kRows + r) * kBlockTokens + t];
              for (int c = 0; c < 512; ++c) chain_ref[r * 512 + c] += pv * deq_t[c];
            }
          }
        for (int g = 0; g < kGroups; ++g)  // group_factor(max_s, 256) on the host
          factors[g] = max_s[g] > 0 ? float(std::exp2(std::floor(std::log2(448.0 / (max_s[g] * 256.0))))) : 1.f;
      }
      int* chain_idx_d = nullptr;
      float *chain_p_d = nullptr, *factors_d = nullptr;
      CUDA_OK(cudaMalloc(&chain_idx_d, chain_idx.size() * sizeof(int)));
      CUDA_OK(cudaMalloc(&chain_p_d, chain_p.size() * sizeof(float)));
      CUDA_OK(cudaMalloc(&factors_d, sizeof(factors)));
      CUDA_OK(cudaMemcpy(chain_idx_d, chain_idx.data(), chain_idx.size() * sizeof(int), cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(chain_p_d, chain_p.data(), chain_p.size() * sizeof(float), cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(factors_d, factors, sizeof(factors), cudaMemcpyHostToDevice));
      double chain[2][3];  // [0]: one accumulator for the chain, [1]: a fresh one every block
      run_chain<false>(d.pool, chain_idx_d, chain_p_d, factors_d, d.out, chain_blocks, chain_ref, chain[0]);
      run_chain<true>(d.pool, chain_idx_d, chain_p_d, factors_d, d.out, chain_blocks, chain_ref, chain[1]);
      CUDA_OK(cudaFree(chain_idx_d));
      CUDA_OK(cudaFree(chain_p_d));
      CUDA_OK(cudaFree(factors_d));
      for (int a = 0; a < 2; ++a) {
        if (chain_blocks == kChainBlocks) {
          printf("pv-chain case %s terms 2 accumulator %s: rel-norm error %.3e (max abs %.3e, max |ref| %.3e)\n",
                 cs.name, a ? "block" : "piece", chain[a][0], chain[a][1], chain[a][2]);
        } else {
          printf("pv-chain-length case %s blocks %d accumulator %s: rel-norm error %.3e (max abs %.3e, max |ref| "
                 "%.3e)\n",
                 cs.name, chain_blocks, a ? "block" : "piece", chain[a][0], chain[a][1], chain[a][2]);
        }
      }
      if (!(chain[1][0] <= kTwoTermBound && chain[0][0] <= kChainBound)) ok = false;
    }
  }
  printf("block probe: %s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
