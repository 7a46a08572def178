// What the sparse kernel's GPU probes share (checks/block_probe.cu, gather_probe.cu, attention_probe.cu): the error
// macro, the check for an sm_90 GPU, the rows and columns of a wgmma accumulator fragment, and the Q tile built from a
// bf16 q. The error macro and the GPU check also serve decode_fp8/checks/vregs_probe.cu. Not part of the extension.
#pragma once

// The gather's token address in its PTX form (gather.cuh: token_address says why the probes need it).
#define FMLA_SPARSE_TOKEN_ADDRESS_PTX 1

#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <cutlass/bfloat16.h>
#include <cutlass/float8.h>

#include "sm90/sparse_fp8/layout.h"

#define CUDA_OK(x)                                                                          \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__);       \
      std::exit(2);                                                                         \
    }                                                                                       \
  } while (0)

namespace flashmla_backend::sm90::sparse_fp8::probe {

using F8 = cutlass::float_e4m3_t;
using BF = cutlass::bfloat16_t;

// Row and column of element i of a 64 x N fp32 wgmma accumulator fragment of warpgroup thread tid
// (sm90/decode/softmax.cuh).
__device__ __forceinline__ int acc_row(int tid, int i) {
  return 16 * (tid >> 5) + ((tid & 31) >> 2) + 8 * ((i >> 1) & 1);
}
__device__ __forceinline__ int acc_col(int tid, int i) { return 8 * (i >> 2) + 2 * (tid & 3) + (i & 1); }

// The Q tile of 64 rows of a bf16 q [64, 576] (qk.cuh's header): kQTerms e4m3 terms of the latent part under the
// row's power-of-two scale s_r at q_latent (term t at + t * kLatentBytes), the rope divided by s_r in bf16 at q_rope,
// s_r at row_scale[r]. By the 128 threads of a warpgroup: row r = tid / 2, channel half h = tid % 2 (256 latent and
// 32 rope channels a thread).
template <int kQTerms>
__device__ void build_q_tile(const BF* q, uint8_t* q_latent, uint8_t* q_rope, float* row_scale, int tid) {
  const int r = tid >> 1, h = tid & 1;
  const BF* qr = q + size_t(r) * 576;
  float amax = 0.f;
  for (int c = 256 * h; c < 256 * h + 256; ++c) amax = fmaxf(amax, fabsf(float(qr[c])));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  // s_r = 2^ceil(log2(amax / 448)): q / s_r fits e4m3 and s_r is exact in every format.
  const float s = amax > 0.f ? exp2f(ceilf(log2f(amax / 448.f))) : 1.f;
  const float inv = 1.f / s;
  if (h == 0) row_scale[r] = s;
  for (int chunk = 16 * h; chunk < 16 * h + 16; ++chunk) {  // 16 latent channels a chunk
    uint8_t hi[16], lo[16];
    for (int j = 0; j < 16; ++j) {
      const float x = float(qr[16 * chunk + j]) * inv;
      const F8 a(x);
      hi[j] = reinterpret_cast<const uint8_t&>(a);
      const F8 b(x - float(a));
      lo[j] = reinterpret_cast<const uint8_t&>(b);
    }
    std::memcpy(q_latent + gather_chunk_offset(r, chunk), hi, 16);
    if (kQTerms == 2) std::memcpy(q_latent + kLatentBytes + gather_chunk_offset(r, chunk), lo, 16);
  }
  for (int chunk = 4 * h; chunk < 4 * h + 4; ++chunk) {  // 8 rope channels a chunk
    BF v[8];
    for (int j = 0; j < 8; ++j) v[j] = BF(float(qr[512 + 8 * chunk + j]) * inv);
    std::memcpy(q_rope + sw128_offset(r, chunk), v, 16);
  }
}

// Whether device 0 is an sm_90 GPU (host); if not, prints "<probe>: no CUDA device" or "<probe>: needs an sm_90 GPU
// (this is sm_XY)", the lines tests/test_device_checks.py reads, and the probe exits with code 2.
inline bool have_sm90(const char* probe) {
  int dev_count = 0;
  if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
    printf("%s: no CUDA device\n", probe);
    return false;
  }
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9) {
    printf("%s: needs an sm_90 GPU (this is sm_%d%d)\n", probe, prop.major, prop.minor);
    return false;
  }
  return true;
}

// The value of an e4m3 byte (host).
inline float e4m3_value(uint8_t b) {
  F8 f;
  std::memcpy(&f, &b, 1);
  return float(f);
}

}  // namespace flashmla_backend::sm90::sparse_fp8::probe
