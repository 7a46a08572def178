// GPU probe of P V with V read into registers: O^T = V^T P^T, V^T the A operand of a register-sourced wgmma (m64 =
// 64 value columns, n64 = the 64 query rows, P^T from shared memory), instead of O = P V with V^T or a widened fp16 V
// written to shared memory by the producer. Not part of the extension.
//
// Why: the FP8 kernel's P V reads V as the B operand, which for e4m3 must be K-major (keys contiguous) and for fp16
// must be 16-bit, so the producer transposes the e4m3 cache block into V^T halves (fast mode) or widens it into fp16
// halves (accurate mode); both wait on rings of slots. As the A operand V can come from registers: one
// ldmatrix.x4.trans (eight keys x 16 bytes per matrix, the cache block's own 64B-swizzled rows) gives a lane, per
// matrix, the bytes of keys 2t, 2t + 1 for value columns 2g, 2g + 1 (g = lane / 4, t = lane % 4). With wgmma row g of
// a warp's 16 = value column 2g and row g + 8 = column 2g + 1:
//   e4m3 (m64n64k32): word (row g, k' 4t .. 4t + 3) = prmt of matrices 0 and 1 (keys 2t, 2t + 1, 8 + 2t, 9 + 2t): the
//                     key order within 32 keys that the kernel's V^T already uses (layout.h: P's fragment), so P^T's
//                     bytes are P's own fragment words stored in rows;
//   fp16 (m64n64k16): word (row g, keys 2t, 2t + 1) = cvt.rn.f16x2.e4m3x2 of bytes 0 and 2, natural key order.
// Per warpgroup and 64-key block: 8 ldmatrix.x4 and 32 prmt (e4m3) or 32 prmt and 64 cvt (fp16) a thread.
//
// The probe checks both mappings against fp64 (one block, 512 value columns over two warpgroups) and times, per
// warpgroup and block, the P V of 256 value columns in six forms (one CTA of two warpgroups per SM, the same block
// again and again, so only the products and the register work are timed):
//   f16-vregs       O^T on fp16 wgmma, V converted in registers (two sets of A registers: tile m + 1 converted
//                   while tile m's wgmma run)
//   f16-vregs-noconv the same wgmma with A converted once (the products alone)
//   f16-vsmem       O = P V on fp16 wgmma m64n256k16, P in registers, the widened fp16 V in shared memory (the
//                   accurate mode's product today)
//   e4m3-vregs      O^T on e4m3 wgmma, V permuted in registers
//   e4m3-vregs-noperm the same wgmma with A built once
//   e4m3-vsmem      O = P V on e4m3 wgmma m64n256k32, V^T in shared memory (the fast mode's product today)
//
// Measured on an H200 (2026-11-29, 4,000 blocks a warpgroup, ns a block of 512 value columns and TFLOP/s): f16-vregs
// 692.5 (800), f16-vregs-noconv 577.3 (959), f16-vsmem 570.9 (970), e4m3-vregs 436.1 (1270), e4m3-vregs-noperm 317.1
// (1746), e4m3-vsmem 315.5 (1755); errors against fp64 4.1e-8 (fp16) and 6.4e-5 (e4m3). So the register-sourced n64
// products run at the n256 ones' rate, and the widening (fp16) or the byte permutes (e4m3) cost 20% and 37% of the
// products' time when nothing else overlaps them. The accurate mode's tile built on it: vregs.h.
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/float8.h>
#include <cutlass/half.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "sm90/decode_fp8/config.h"
#include "sm90/decode_fp8/layout.h"
#include "sm90/decode_fp8/traits.h"
#include "sm90/sparse_fp8/checks/probe_common.cuh"  // CUDA_OK, have_sm90: the GPU probes' shared pieces

namespace probe {

using namespace cute;
namespace fp8 = flashmla_backend::sm90::decode_fp8;
using F8 = cutlass::float_e4m3_t;
using F16 = cutlass::half_t;

constexpr int kKeys = 64, kRows = 64, kCols = 512, kWgCols = 256;
// Shared memory: the cache block's V (eight 4 KB pieces), P^T (fp16 8 KB, e4m3 4 KB), the baselines' V buffers.
constexpr int kVAt = 0;
constexpr int kP16At = 32768;
constexpr int kP8At = kP16At + 8192;
constexpr int kV16At = kP8At + 4096 + 4096;  // fp16 V halves, 32 KB each (1024-aligned)
constexpr int kVtAt = kV16At + 2 * fp8::kV16HalfBytes;
constexpr int kSmemBytes = kVtAt + 2 * fp8::kVtHalfBytes;
static_assert(kV16At % 1024 == 0 && kVtAt % 1024 == 0, "aligned buffers");
constexpr int kLaunchSmem = 200 * 1024;  // one CTA per SM

// O^T tiles: (64 value columns, 64 rows, 64 keys).
using MmaT16 = decltype(make_tiled_mma(GMMA::rs_op_selector<F16, F16, float, Shape<_64, _64, _64>, GMMA::Major::K,
                                                            GMMA::Major::K>()));
using MmaT8 = decltype(make_tiled_mma(GMMA::rs_op_selector<F8, F8, float, Shape<_64, _64, _64>, GMMA::Major::K,
                                                           GMMA::Major::K>()));
// P^T as the B operand: (64 rows, 64 keys), K-major.
using LayoutP16 = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<F16>{}, Shape<_64, _64>{}));
using LayoutP8 = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<F8>{}, Shape<_64, _64>{}));
// The baselines: the kernel's own P V types.
using TAcc = fp8::Traits<cutlass::bfloat16_t, 2, 2, 1, 1, 224, 56, false, true>;
using TFast = fp8::Traits<F8, 1, 3, 2, 2, 208, 88>;

// The kernel's key order of P's e4m3 fragment within 32 keys: k' = 4t + i (+ 16 h) holds key 2t + (i & 1) + 8 (i >> 1)
// (+ 16 h).
inline int kvt_key(int kp) {
  const int base = kp & ~15, i = kp & 3, t = (kp & 15) >> 2;
  return base + 2 * t + (i & 1) + 8 * (i >> 1);
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
__device__ __forceinline__ uint32_t cvt_e4m3x2(uint32_t x16) {
  uint32_t d;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(uint16_t(x16)));
  return d;
}

// The ldmatrix address of this lane for value-column tile m (64 columns) of warpgroup wg, 32 keys from kb: matrix
// lane / 8 = keys kb + 8 (lane / 8) .., row lane % 8; the warp's 16 columns are chunk `warp` of piece 4 wg + m.
__device__ __forceinline__ uint32_t v_lane_addr(uint32_t v_base, int wg, int m, int warp, int lane, int kb) {
  const int key = kb + lane;  // lane / 8 * 8 + lane % 8
  return v_base + uint32_t((4 * wg + m) * fp8::kPieceBytes) + fp8::sw64_offset(key, warp);
}

// A registers of one O^T tile. fp16: 16 words (4 k16 steps x 4), e4m3: 8 words (2 k32 steps x 4).
__device__ __forceinline__ void tile_a16(uint32_t v_base, int wg, int m, int warp, int lane, uint32_t (&a)[16]) {
  CUTLASS_PRAGMA_UNROLL
  for (int h = 0; h < 2; ++h) {
    uint32_t r[4];
    ldsm_x4_trans(v_lane_addr(v_base, wg, m, warp, lane, 32 * h), r);
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < 4; ++j) {  // matrix j = keys 32 h + 8 j ..: k16 step 2 h + j / 2, its keys + 8 (j & 1)
      const uint32_t x = prmt(r[j], 0u, 0x3120u);  // (key 2t: col 2g, key 2t + 1: col 2g | the same for col 2g + 1)
      const int s = 2 * h + (j >> 1);
      a[4 * s + 2 * (j & 1) + 0] = cvt_e4m3x2(x & 0xffffu);  // row g (column 2g)
      a[4 * s + 2 * (j & 1) + 1] = cvt_e4m3x2(x >> 16);      // row g + 8 (column 2g + 1)
    }
  }
}
__device__ __forceinline__ void tile_a8(uint32_t v_base, int wg, int m, int warp, int lane, uint32_t (&a)[8]) {
  CUTLASS_PRAGMA_UNROLL
  for (int s = 0; s < 2; ++s) {
    uint32_t r[4];
    ldsm_x4_trans(v_lane_addr(v_base, wg, m, warp, lane, 32 * s), r);
    a[4 * s + 0] = prmt(r[0], r[1], 0x6420u);  // row g: column 2g, k' 4t .. 4t + 3
    a[4 * s + 1] = prmt(r[0], r[1], 0x7531u);  // row g + 8: column 2g + 1
    a[4 * s + 2] = prmt(r[2], r[3], 0x6420u);  // k' 16 + 4t ..
    a[4 * s + 3] = prmt(r[2], r[3], 0x7531u);
  }
}

template <class Mma, class E, int kWords, int kN = 64>
struct AFrag {
  using ALayout = decltype(make_layout(partition_shape_A(Mma{}, Shape<_64, _64>{})));
  static_assert(cosize_v<ALayout> * int(sizeof(E)) == 4 * kWords, "the words are the whole A fragment");
  uint32_t w[kWords];
  __device__ __forceinline__ auto tensor() { return make_tensor(make_rmem_ptr<E>(reinterpret_cast<E*>(&w[0])), ALayout{}); }
  __device__ __forceinline__ void fence() {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kWords; ++i) asm volatile("" : "+r"(w[i]));
  }
};

// One O^T tile's product: acc += A (registers) x P^T (shared memory); one commit group.
template <class Mma, class E, class PLayout, int kWords, class Acc>
__device__ __forceinline__ void tile_product(AFrag<Mma, E, kWords>& a, uint8_t* p_smem, int tid, Acc& acc) {
  Mma mma;
  auto thr = mma.get_slice(tid);
  Tensor sP = make_tensor(make_smem_ptr(reinterpret_cast<E*>(p_smem)), PLayout{});
  Tensor tB = thr.partition_fragment_B(sP);
  Tensor tA = a.tensor();
  mma.accumulate_ = GMMA::ScaleOut::One;
  a.fence();
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  CUTLASS_PRAGMA_UNROLL
  for (int kb = 0; kb < size<2>(tB); ++kb) cute::gemm(mma, tA(_, _, kb), tB(_, _, kb), acc);
  warpgroup_commit_batch();
  warpgroup_fence_operand(acc);
  a.fence();
}

enum Mode { kF16Vregs = 0, kF16VregsNoConv, kF16Vsmem, kE4m3Vregs, kE4m3VregsNoPerm, kE4m3Vsmem, kNumModes };
const char* const kModeNames[kNumModes] = {"f16-vregs", "f16-vregs-noconv", "f16-vsmem",
                                           "e4m3-vregs", "e4m3-vregs-noperm", "e4m3-vsmem"};

// Fills shared memory from global: V [64 keys][512] e4m3 into the cache block's pieces; P [64 rows][64 keys] as fp16
// P^T (natural key order) and as e4m3 P^T (the kernel's key order); the baselines' buffers with the same V.
__device__ void fill_smem(uint8_t* smem, const uint8_t* v, const uint16_t* p16, const uint8_t* p8, int tid, int nthr) {
  for (int i = tid; i < kKeys * kCols; i += nthr) {
    const int key = i / kCols, c = i % kCols;
    smem[kVAt + (c / 64) * fp8::kPieceBytes + fp8::sw64_offset(key, (c % 64) / 16) + c % 16] = v[i];
  }
  for (int i = tid; i < kRows * kKeys; i += nthr) {
    const int r = i / kKeys, k = i % kKeys;
    *reinterpret_cast<uint16_t*>(smem + kP16At + fp8::sw128_offset(r, k / 8) + (k % 8) * 2) = p16[i];
    smem[kP8At + fp8::sw64_offset(r, (k % 64) / 16) + k % 16] = p8[i];  // p8 is already in the kernel's key order
  }
  // Baseline buffers: the fp16 V halves (values irrelevant to the timing: the e4m3 bytes as fp16 bits) and V^T.
  for (int i = tid; i < 2 * fp8::kV16HalfBytes / 4 + 2 * fp8::kVtHalfBytes / 4; i += nthr) {
    reinterpret_cast<uint32_t*>(smem + kV16At)[i] = 0x3c003c00u ^ uint32_t(i & 0xff);
  }
}

template <int kMode>
__global__ void __launch_bounds__(256, 1) probe_kernel(const uint8_t* v, const uint16_t* p16, const uint8_t* p8,
                                                       float* out, int iters) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x, wg = tid / 128, t = tid % 128, warp = t / 32, lane = tid % 32;
  fill_smem(smem, v, p16, p8, tid, 256);
  cutlass::arch::fence_view_async_shared();
  __syncthreads();
  const uint32_t v_base = cute::cast_smem_ptr_to_uint(smem + kVAt);

  if constexpr (kMode == kF16Vregs || kMode == kF16VregsNoConv || kMode == kE4m3Vregs || kMode == kE4m3VregsNoPerm) {
    constexpr bool k16 = kMode == kF16Vregs || kMode == kF16VregsNoConv;
    constexpr bool kConvertEach = kMode == kF16Vregs || kMode == kE4m3Vregs;
    using Mma = std::conditional_t<k16, MmaT16, MmaT8>;
    using E = std::conditional_t<k16, F16, F8>;
    using PLayout = std::conditional_t<k16, LayoutP16, LayoutP8>;
    constexpr int kW = k16 ? 16 : 8;
    uint8_t* p_smem = smem + (k16 ? kP16At : kP8At);
    Mma mma;
    Tensor acc0 = partition_fragment_C(mma, Shape<_64, _64>{});
    Tensor acc1 = partition_fragment_C(mma, Shape<_64, _64>{});
    Tensor acc2 = partition_fragment_C(mma, Shape<_64, _64>{});
    Tensor acc3 = partition_fragment_C(mma, Shape<_64, _64>{});
    clear(acc0);
    clear(acc1);
    clear(acc2);
    clear(acc3);
    AFrag<Mma, E, kW> a[2];
    const auto build = [&](int m, AFrag<Mma, E, kW>& f) {
      if constexpr (k16) {
        tile_a16(v_base, wg, m, warp, lane, f.w);
      } else {
        tile_a8(v_base, wg, m, warp, lane, f.w);
      }
    };
    if constexpr (!kConvertEach) {
      // One set of A registers for all four tiles (the products alone): tile 0's.
      build(0, a[0]);
    }
    for (int it = 0; it < iters; ++it) {
      if constexpr (kConvertEach) {
        warpgroup_wait<1>();
        build(0, a[0]);
        tile_product<Mma, E, PLayout>(a[0], p_smem, t, acc0);
        warpgroup_wait<1>();
        build(1, a[1]);
        tile_product<Mma, E, PLayout>(a[1], p_smem, t, acc1);
        warpgroup_wait<1>();
        build(2, a[0]);
        tile_product<Mma, E, PLayout>(a[0], p_smem, t, acc2);
        warpgroup_wait<1>();
        build(3, a[1]);
        tile_product<Mma, E, PLayout>(a[1], p_smem, t, acc3);
      } else {
        tile_product<Mma, E, PLayout>(a[0], p_smem, t, acc0);
        tile_product<Mma, E, PLayout>(a[0], p_smem, t, acc1);
        tile_product<Mma, E, PLayout>(a[0], p_smem, t, acc2);
        tile_product<Mma, E, PLayout>(a[0], p_smem, t, acc3);
        warpgroup_wait<0>();
      }
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc0);
    warpgroup_fence_operand(acc1);
    warpgroup_fence_operand(acc2);
    warpgroup_fence_operand(acc3);
    // Element i of tile m: wgmma row 16 warp + g + 8 ((i >> 1) & 1) = value column 256 wg + 64 m + 16 warp + 2 g +
    // ((i >> 1) & 1); column 8 (i >> 2) + 2 t + (i & 1) = query row.
    const auto store = [&](int m, auto& acc) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc); ++i) {
        const int col = 256 * wg + 64 * m + 16 * warp + 2 * (lane >> 2) + ((i >> 1) & 1);
        const int row = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
        out[size_t(blockIdx.x) * kRows * kCols + row * kCols + col] = acc(i);
      }
    };
    store(0, acc0);
    store(1, acc1);
    store(2, acc2);
    store(3, acc3);
  } else {
    // The kernel's products today: O (64 rows, 256 value columns) += P (registers) V (shared memory).
    using T = std::conditional_t<kMode == kF16Vsmem, TAcc, TFast>;
    using E = typename T::PvElement;
    typename T::TiledMmaPV mma;
    auto thr = mma.get_slice(t);
    Tensor acc = partition_fragment_C(mma, Shape<_64, Int<kWgCols>>{});
    clear(acc);
    uint8_t* vb = smem + (kMode == kF16Vsmem ? kV16At + wg * fp8::kV16HalfBytes : kVtAt + wg * fp8::kVtHalfBytes);
    Tensor sV = make_tensor(make_smem_ptr(reinterpret_cast<E*>(vb)), typename T::SmemLayoutVHalf{});
    Tensor tB = thr.partition_fragment_B(sV);
    AFrag<typename T::TiledMmaPV, E, T::kPWords> P;  // P's A fragment (values irrelevant to the timing)
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < T::kPWords; ++i) P.w[i] = 0x3c003c00u ^ uint32_t(i * 0x01010101u + tid);
    for (int it = 0; it < iters; ++it) {
      mma.accumulate_ = GMMA::ScaleOut::One;
      P.fence();
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      Tensor tA = P.tensor();
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < size<2>(tB); ++kb) cute::gemm(mma, tA(_, _, kb), tB(_, _, kb), acc);
      warpgroup_commit_batch();
      warpgroup_fence_operand(acc);
      P.fence();
      warpgroup_wait<0>();
    }
    warpgroup_fence_operand(acc);
    float s = 0.f;
    for (int i = 0; i < size(acc); ++i) s += acc(i);
    out[size_t(blockIdx.x) * kRows * kCols + tid] = s;
  }
}

template <int kMode>
float run(const uint8_t* v, const uint16_t* p16, const uint8_t* p8, float* out, int ctas, int iters) {
  CUDA_OK(cudaFuncSetAttribute(probe_kernel<kMode>, cudaFuncAttributeMaxDynamicSharedMemorySize, kLaunchSmem));
  probe_kernel<kMode><<<ctas, 256, kLaunchSmem>>>(v, p16, p8, out, iters);  // warm-up
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CUDA_OK(cudaEventCreate(&a));
  CUDA_OK(cudaEventCreate(&b));
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    CUDA_OK(cudaEventRecord(a));
    probe_kernel<kMode><<<ctas, 256, kLaunchSmem>>>(v, p16, p8, out, iters);
    CUDA_OK(cudaEventRecord(b));
    CUDA_OK(cudaEventSynchronize(b));
    float ms = 0.f;
    CUDA_OK(cudaEventElapsedTime(&ms, a, b));
    best = std::min(best, ms);
  }
  CUDA_OK(cudaEventDestroy(a));
  CUDA_OK(cudaEventDestroy(b));
  return best;
}

}  // namespace probe

int main(int argc, char** argv) {
  using namespace probe;
  if (!flashmla_backend::sm90::sparse_fp8::probe::have_sm90("vregs probe")) return 2;
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  const int iters = argc > 1 ? std::atoi(argv[1]) : 4000;

  // Inputs: V e4m3 in [-4, 4], P in [0, 1] (fp16, and e4m3 in the kernel's key order).
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> uv(-4.f, 4.f), up(0.f, 1.f);
  std::vector<uint8_t> hv(kKeys * kCols), hp8(kRows * kKeys);
  std::vector<uint16_t> hp16(kRows * kKeys);
  std::vector<double> vval(kKeys * kCols), p16val(kRows * kKeys), p8val(kRows * kKeys);
  for (int i = 0; i < kKeys * kCols; ++i) {
    const F8 x(uv(rng));
    std::memcpy(&hv[i], &x, 1);
    vval[i] = double(float(x));
  }
  for (int i = 0; i < kRows * kKeys; ++i) {
    const float x = up(rng);
    const F16 h(x);
    std::memcpy(&hp16[i], &h, 2);
    p16val[i] = double(float(h));
    const F8 e(x);
    p8val[i] = double(float(e));
  }
  // e4m3 P^T in the kernel's key order: position k' of a row holds key kvt_key(k').
  for (int r = 0; r < kRows; ++r)
    for (int kp = 0; kp < kKeys; ++kp) {
      const F8 e = F8(float(p8val[r * kKeys + kvt_key(kp)]));
      std::memcpy(&hp8[r * kKeys + kp], &e, 1);
    }

  const int ctas = prop.multiProcessorCount;
  uint8_t *dv, *dp8;
  uint16_t* dp16;
  float* dout;
  CUDA_OK(cudaMalloc(&dv, hv.size()));
  CUDA_OK(cudaMalloc(&dp8, hp8.size()));
  CUDA_OK(cudaMalloc(&dp16, hp16.size() * 2));
  CUDA_OK(cudaMalloc(&dout, size_t(ctas) * kRows * kCols * sizeof(float)));
  CUDA_OK(cudaMemcpy(dv, hv.data(), hv.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dp8, hp8.data(), hp8.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dp16, hp16.data(), hp16.size() * 2, cudaMemcpyHostToDevice));

  // Correctness: one block, every mode that computes O^T from the data.
  bool ok = true;
  const auto check = [&](const char* name, const std::vector<double>& pv, auto launch) {
    CUDA_OK(cudaMemset(dout, 0, size_t(kRows) * kCols * sizeof(float)));
    launch();
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> got(kRows * kCols);
    CUDA_OK(cudaMemcpy(got.data(), dout, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
    double num = 0, den = 0, maxabs = 0;
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kCols; ++c) {
        double ref = 0;
        for (int k = 0; k < kKeys; ++k) ref += pv[r * kKeys + k] * vval[k * kCols + c];
        const double d = double(got[r * kCols + c]) - ref;
        num += d * d;
        den += ref * ref;
        maxabs = std::max(maxabs, std::fabs(d));
      }
    const double rel = std::sqrt(num / den);
    const bool good = rel < 2e-3;
    ok = ok && good;
    printf("check %s: rel-norm error %.3e, max abs %.3e %s\n", name, rel, maxabs, good ? "ok" : "WRONG");
  };
  check("f16-vregs", p16val, [&] {
    CUDA_OK(cudaFuncSetAttribute(probe_kernel<kF16Vregs>, cudaFuncAttributeMaxDynamicSharedMemorySize, kLaunchSmem));
    probe_kernel<kF16Vregs><<<1, 256, kLaunchSmem>>>(dv, dp16, dp8, dout, 1);
  });
  check("e4m3-vregs", p8val, [&] {
    CUDA_OK(cudaFuncSetAttribute(probe_kernel<kE4m3Vregs>, cudaFuncAttributeMaxDynamicSharedMemorySize, kLaunchSmem));
    probe_kernel<kE4m3Vregs><<<1, 256, kLaunchSmem>>>(dv, dp16, dp8, dout, 1);
  });

  // Timing: per warpgroup and block, 2 x 64 x 256 x 64 flops.
  const double flops = 2.0 * 64 * kWgCols * 64 * 2 * ctas * double(iters);
  float ms[kNumModes];
  ms[kF16Vregs] = run<kF16Vregs>(dv, dp16, dp8, dout, ctas, iters);
  ms[kF16VregsNoConv] = run<kF16VregsNoConv>(dv, dp16, dp8, dout, ctas, iters);
  ms[kF16Vsmem] = run<kF16Vsmem>(dv, dp16, dp8, dout, ctas, iters);
  ms[kE4m3Vregs] = run<kE4m3Vregs>(dv, dp16, dp8, dout, ctas, iters);
  ms[kE4m3VregsNoPerm] = run<kE4m3VregsNoPerm>(dv, dp16, dp8, dout, ctas, iters);
  ms[kE4m3Vsmem] = run<kE4m3Vsmem>(dv, dp16, dp8, dout, ctas, iters);
  for (int m = 0; m < kNumModes; ++m) {
    printf("time %-18s %8.3f ms  %7.1f ns a block and warpgroup pair  %7.1f TFLOP/s\n", kModeNames[m], ms[m],
           1e6 * ms[m] / iters, flops / (ms[m] * 1e-3) / 1e12);
  }
  printf("vregs probe: %s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
