// GPU probe of the sparse kernel's arithmetic end to end, without its pipeline: the attention of 64 query rows (one
// M tile: 64 heads of one query token) over one index row of fp8_ds_mla tokens, against fp64:
//   nvcc -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -I csrc -I <cutlass include>
//        csrc/sm90/sparse_fp8/checks/attention_probe.cu -o /tmp/sparse_attention_probe && /tmp/sparse_attention_probe
// (one command) Not part of the extension build; tests/test_device_checks.py compiles it (no GPU needed) and runs it
// on a GPU.
//
// One CTA, one warpgroup, the blocks of the row one after another: warp 0 gathers a block (gather.cuh), the
// warpgroup computes its scores (qk.cuh: two e4m3 terms of q per group, the group scales folded, the bf16 rope),
// masks the entries that name no token, updates the rows' running max and sums (P = 2^(s - m + 8), as the dense
// kernel scales P), transposes the latent tiles (pv.cuh) and runs P V per group with two e4m3 terms of P s[t, g]
// under a group factor that only goes down (a block whose largest P s[t, g] would not fit lowers it and O_g is
// rescaled by the ratio, a power of two; a block that would fit a larger one keeps it). O of one group is 64
// registers a thread, so the row is walked twice, groups 0 and 1, then 2 and 3. The epilogue writes out = O / (F l)
// in fp32 and lse = ln(sum of exp(scores)), 0 and +inf for a row with no token (FlashMLA's convention).
// The host computes the attention in fp64 on the dequantized tokens (e4m3 value x group scale, bf16 rope) with the
// bf16 q; per case it prints
//   attention case <name>: out rel-norm error <e> (max abs <a>), lse max abs error <l>
// and "attention probe: ok" when every case is within kOutBound and kLseBound (a row with no token: out exactly 0,
// lse +inf), else "attention probe: FAILED" (exit 1).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include <cute/tensor.hpp>
#include <cutlass/bfloat16.h>
#include <cutlass/float8.h>

#include "sm90/sparse_fp8/checks/probe_common.cuh"
#include "sm90/sparse_fp8/gather.cuh"
#include "sm90/sparse_fp8/layout.h"
#include "sm90/sparse_fp8/pv.cuh"
#include "sm90/sparse_fp8/qk.cuh"

using namespace flashmla_backend::sm90::sparse_fp8;
using namespace flashmla_backend::sm90::sparse_fp8::probe;
namespace dfp8 = flashmla_backend::sm90::decode_fp8;

constexpr int kRows = 64;
constexpr int kPool = 4096;
constexpr double kOutBound = 5e-3;  // fp32 output; the precision model: 1.9e-3 (16-bit accumulator) to 4.3e-3 (14)
constexpr double kLseBound = 1e-2;

constexpr int kVtAt = kStageBytes;  // 41 KB, 1024-aligned
constexpr int kQLatentAt = kVtAt + 2 * dfp8::kVtHalfBytes;
constexpr int kQRopeAt = kQLatentAt + 2 * kLatentBytes;
constexpr int kRowScaleAt = kQRopeAt + kRopeBytes;
constexpr int kMaskAt = kRowScaleAt + kRows * 4;
constexpr int kSmemBytes = kMaskAt + 8;
static_assert(kVtAt % 1024 == 0 && kQLatentAt % 1024 == 0 && kQRopeAt % 1024 == 0, "swizzled tiles on 1024 bytes");

__global__ void __launch_bounds__(128, 1) attention_probe_kernel(const uint8_t* pool, int64_t num_tokens,
                                                                 const int* row, int n_used, int num_blocks,
                                                                 const BF* q, float sm_scale_log2, float* out,
                                                                 float* lse) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const uint32_t base = uint32_t(__cvta_generic_to_shared(smem));
  if (base & 1023u) __trap();
  float* row_scale = reinterpret_cast<float*>(smem + kRowScaleAt);
  build_q_tile<2>(q, smem + kQLatentAt, smem + kQRopeAt, row_scale, tid);
  cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read by wgmma
  __syncthreads();
  const int rows[2] = {acc_row(tid, 0), acc_row(tid, 2)};
  const float sl2[2] = {sm_scale_log2 * row_scale[rows[0]], sm_scale_log2 * row_scale[rows[1]]};
  const float* scales = reinterpret_cast<const float*>(smem + kScalesAt);

  typename QkTypes::TiledMmaLatent mma_s;
  Tensor s = partition_fragment_C(mma_s, Shape<Int<kRows>, Int<kBlockTokens>>{});
  Tensor tmp = partition_fragment_C(mma_s, Shape<Int<kRows>, Int<kBlockTokens>>{});
  Tensor tmp1 = partition_fragment_C(mma_s, Shape<Int<kRows>, Int<kBlockTokens>>{});
  typename PvTypes::TiledMma mma_o;
  Tensor o0 = partition_fragment_C(mma_o, Shape<Int<kRows>, Int<128>>{});
  Tensor o1 = partition_fragment_C(mma_o, Shape<Int<kRows>, Int<128>>{});

  for (int pass = 0; pass < 2; ++pass) {
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, F[2] = {0.f, 0.f};  // F = 0: no factor yet
    clear(o0);
    clear(o1);
    for (int b = 0; b < num_blocks; ++b) {
      __syncthreads();  // the last block's stage and V^T are read
      if (warp == 0) {
        const uint64_t mask = gather_block_warp(base, pool, num_tokens, row, kBlockTokens * b, n_used, lane);
        flashmla_backend::sm90::decode::cp_async_commit();
        flashmla_backend::sm90::decode::cp_async_wait_all();
        cutlass::arch::fence_view_async_shared();  // cp.async writes, read by wgmma
        if (lane == 0) *reinterpret_cast<uint64_t*>(smem + kMaskAt) = mask;
      }
      __syncthreads();
      sparse_qk_block<2>(tid, smem + kQLatentAt, smem + kQRopeAt, smem, s, tmp, tmp1);
      const uint64_t mask = *reinterpret_cast<const uint64_t*>(smem + kMaskAt);

      // Scores in the log2 domain, masked; the rows' new max (a quad's four lanes hold a row's 64 keys).
      float mx[2] = {-INFINITY, -INFINITY};
      for (int i = 0; i < size(s); ++i) {
        const int v = (i >> 1) & 1, token = acc_col(tid, i);
        const float x = ((mask >> token) & 1) ? s(i) * sl2[v] : -INFINITY;
        s(i) = x;
        mx[v] = fmaxf(mx[v], x);
      }
      float sc[2];
      for (int v = 0; v < 2; ++v) {
        mx[v] = fmaxf(mx[v], __shfl_xor_sync(0xffffffffu, mx[v], 1));
        mx[v] = fmaxf(mx[v], __shfl_xor_sync(0xffffffffu, mx[v], 2));
        const float m_new = fmaxf(m[v], mx[v]);
        sc[v] = m_new == -INFINITY ? 1.f : exp2f(m[v] - m_new);  // exp2(-inf) = 0 for a first key
        m[v] = m_new;
        l[v] *= sc[v];
      }
      for (int i = 0; i < size(s); ++i) {
        const int v = (i >> 1) & 1;
        const float p = m[v] == -INFINITY ? 0.f : exp2f(s(i) - m[v] + 8.f);  // P in (0, 256]
        s(i) = p;
        l[v] += p;
      }
      for (int i = 0; i < size(o0); ++i) {
        o0(i) *= sc[(i >> 1) & 1];
        o1(i) *= sc[(i >> 1) & 1];
      }

      transpose_latent(base, base + kVtAt, warp, lane);
      cutlass::arch::fence_view_async_shared();  // stmatrix writes, read by wgmma
      __syncthreads();
      for (int gg = 0; gg < 2; ++gg) {
        const int g = 2 * pass + gg;
        float max_s = 0.f;  // the block's largest scale of group g (zero for a skipped entry)
        for (int i = 0; i < size(s); ++i) max_s = fmaxf(max_s, scales[acc_col(tid, i) * kGroups + g]);
        max_s = fmaxf(max_s, __shfl_xor_sync(0xffffffffu, max_s, 1));
        max_s = fmaxf(max_s, __shfl_xor_sync(0xffffffffu, max_s, 2));
        auto& o = gg == 0 ? o0 : o1;
        if (max_s > 0.f) {  // a block of skipped entries only (P 0) sets no factor
          const float f = group_factor(max_s, 256.f);
          if (F[gg] == 0.f) {
            F[gg] = f;
          } else if (f < F[gg]) {  // lower the factor: O_g times the ratio (a power of two, exact)
            const float ratio = f / F[gg];
            for (int i = 0; i < size(o); ++i) o(i) *= ratio;
            F[gg] = f;
          }
        }
        uint32_t words[2][8];
        p_group_words<2>(s, scales, g, factor_in_use(F[gg]), lane, words);
        uint8_t* vt_group = smem + kVtAt + (g >> 1) * dfp8::kVtHalfBytes + (g & 1) * (dfp8::kVtHalfBytes / 2);
        if (gg == 0) {
          sparse_pv_group<2>(tid, words, vt_group, o0);
        } else {
          sparse_pv_group<2>(tid, words, vt_group, o1);
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(o0);
        warpgroup_fence_operand(o1);
      }
    }
    for (int v = 0; v < 2; ++v) {
      l[v] += __shfl_xor_sync(0xffffffffu, l[v], 1);
      l[v] += __shfl_xor_sync(0xffffffffu, l[v], 2);
    }
    for (int gg = 0; gg < 2; ++gg) {
      const int g = 2 * pass + gg;
      auto& o = gg == 0 ? o0 : o1;
      for (int i = 0; i < size(o); ++i) {
        const int v = (i >> 1) & 1;
        const int column = 128 * g + dfp8::vt_row_column(acc_col(tid, i));
        out[rows[v] * 512 + column] = l[v] > 0.f ? o(i) / (F[gg] * l[v]) : 0.f;
      }
    }
    if (pass == 0 && (lane & 3) == 0) {
      for (int v = 0; v < 2; ++v)
        lse[rows[v]] = l[v] > 0.f ? (m[v] - 8.f + log2f(l[v])) * 0.69314718055994531f : INFINITY;
    }
  }
}

struct Case {
  const char* name;
  double spread_log2;  // each group's values times 2^U(-spread, spread) before quantization
  int topk, n_used;
  bool none_valid;     // every entry skipped
};

int main() {
  if (!have_sm90("attention probe")) return 2;
  CUDA_OK(cudaFuncSetAttribute(attention_probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const Case cases[] = {{"one-scale", 0.0, 2048, 2048, false},
                        {"spread-scales", 2.0, 2048, 2048, false},
                        {"spread-scales-cut", 2.0, 2048, 1000, false},
                        {"short-row", 2.0, 512, 512, false},
                        {"no-token", 2.0, 256, 256, true}};
  const double sm_scale = 1.0 / std::sqrt(576.0);
  bool ok = true;
  for (const Case& cs : cases) {
    std::mt19937 rng(20261128);
    std::normal_distribution<float> gauss(0.f, 1.f);
    std::uniform_real_distribution<double> uni(-1.0, 1.0);
    std::vector<uint8_t> pool(size_t(kPool) * kTokenBytes);
    std::vector<double> deq(size_t(kPool) * 576);
    for (int t = 0; t < kPool; ++t) {
      uint8_t* tok = &pool[size_t(t) * kTokenBytes];
      float x[512], sc[kGroups];
      for (int g = 0; g < kGroups; ++g) {
        const float gain = float(std::exp2(cs.spread_log2 * uni(rng)));
        float amax = 0.f;
        for (int c = 128 * g; c < 128 * g + 128; ++c) amax = std::fmax(amax, std::fabs(x[c] = gain * gauss(rng)));
        sc[g] = amax / 448.f;
      }
      for (int c = 0; c < 512; ++c) {
        const F8 v(x[c] / sc[c / 128]);
        std::memcpy(tok + c, &v, 1);
        deq[size_t(t) * 576 + c] = double(e4m3_value(tok[c])) * sc[c / 128];
      }
      std::memcpy(tok + 512, sc, sizeof(sc));
      for (int j = 0; j < 64; ++j) {
        const BF v(gauss(rng));
        std::memcpy(tok + 528 + 2 * j, &v, 2);
        deq[size_t(t) * 576 + 512 + j] = double(float(v));
      }
    }
    std::vector<int> row(cs.topk);
    for (int e = 0; e < cs.topk; ++e) {
      const unsigned kind = rng() % 32;
      row[e] = cs.none_valid || kind == 0 ? -1 : kind == 1 ? kPool + int(rng() % 100) : int(rng() % kPool);
    }
    std::vector<BF> q(size_t(kRows) * 576);
    for (auto& v : q) v = BF(gauss(rng));

    // fp64 reference: the valid entries before n_used (a repeated token counts each time, as in the kernel)
    std::vector<double> out_ref(size_t(kRows) * 512, 0.0), lse_ref(kRows, INFINITY);
    std::vector<int> used;
    for (int e = 0; e < cs.n_used; ++e)
      if (index_valid(row[e], kPool)) used.push_back(row[e]);
    for (int r = 0; r < kRows; ++r) {
      if (used.empty()) continue;
      std::vector<double> sc(used.size());
      double mx = -INFINITY;
      for (size_t k = 0; k < used.size(); ++k) {
        double acc = 0;
        for (int c = 0; c < 576; ++c) acc += double(float(q[size_t(r) * 576 + c])) * deq[size_t(used[k]) * 576 + c];
        sc[k] = acc * sm_scale;
        mx = std::max(mx, sc[k]);
      }
      double sum = 0;
      for (auto& x : sc) sum += (x = std::exp(x - mx));
      for (size_t k = 0; k < used.size(); ++k)
        for (int c = 0; c < 512; ++c) out_ref[size_t(r) * 512 + c] += sc[k] / sum * deq[size_t(used[k]) * 576 + c];
      lse_ref[r] = mx + std::log(sum);
    }

    uint8_t* pool_d = nullptr;
    int* row_d = nullptr;
    BF* q_d = nullptr;
    float *out_d = nullptr, *lse_d = nullptr;
    CUDA_OK(cudaMalloc(&pool_d, pool.size()));
    CUDA_OK(cudaMalloc(&row_d, row.size() * sizeof(int)));
    CUDA_OK(cudaMalloc(&q_d, q.size() * sizeof(BF)));
    CUDA_OK(cudaMalloc(&out_d, size_t(kRows) * 512 * sizeof(float)));
    CUDA_OK(cudaMalloc(&lse_d, kRows * sizeof(float)));
    CUDA_OK(cudaMemcpy(pool_d, pool.data(), pool.size(), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(row_d, row.data(), row.size() * sizeof(int), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(q_d, q.data(), q.size() * sizeof(BF), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(out_d, 0xFF, size_t(kRows) * 512 * sizeof(float)));  // NaN: an unwritten value shows
    CUDA_OK(cudaMemset(lse_d, 0xFF, kRows * sizeof(float)));
    attention_probe_kernel<<<1, 128, kSmemBytes>>>(pool_d, kPool, row_d, cs.n_used, cs.topk / kBlockTokens, q_d,
                                                   float(sm_scale * 1.4426950408889634), out_d, lse_d);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> out(size_t(kRows) * 512), lse(kRows);
    CUDA_OK(cudaMemcpy(out.data(), out_d, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(lse.data(), lse_d, lse.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaFree(pool_d));
    CUDA_OK(cudaFree(row_d));
    CUDA_OK(cudaFree(q_d));
    CUDA_OK(cudaFree(out_d));
    CUDA_OK(cudaFree(lse_d));

    if (used.empty()) {  // FlashMLA's convention for a row with no token: out 0, lse +inf
      const bool zeros = std::all_of(out.begin(), out.end(), [](float x) { return x == 0.f; });
      const bool infs = std::all_of(lse.begin(), lse.end(), [](float x) { return std::isinf(x) && x > 0; });
      printf("attention case %s: out %s, lse %s\n", cs.name, zeros ? "all 0" : "NOT all 0", infs ? "all +inf" :
             "NOT all +inf");
      ok = ok && zeros && infs;
      continue;
    }
    double err2 = 0, ref2 = 0, max_abs = 0, lse_err = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      const double d = double(out[i]) - out_ref[i];
      err2 += d * d;
      ref2 += out_ref[i] * out_ref[i];
      max_abs = std::max(max_abs, std::fabs(d));
    }
    for (int r = 0; r < kRows; ++r) lse_err = std::max(lse_err, std::fabs(double(lse[r]) - lse_ref[r]));
    const double rel = std::sqrt(err2 / ref2);
    printf("attention case %s: out rel-norm error %.3e (max abs %.3e), lse max abs error %.3e\n", cs.name, rel,
           max_abs, lse_err);
    ok = ok && rel <= kOutBound && lse_err <= kLseBound;  // NaN fails both
  }
  printf("attention probe: %s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
