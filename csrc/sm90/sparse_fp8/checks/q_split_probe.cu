// GPU probe of the two forms of the two-term e4m3 split of a 16-bit q (decode_fp8/q_tile.cuh): split_e4m3x2 (the
// difference in fp16, four conversions a pair) against split_e4m3x2_f32 (the difference in fp32, hi widened back by
// e4m3_bits_to_f32: two conversions a pair), for every bf16 bit pattern x at every power-of-two scale 2^k,
// k = -140..140 (the scales under which some bf16 value lands in e4m3's range), on y = x 2^k as the kernels form it.
//   nvcc -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -I csrc -I <cutlass include>
//        csrc/sm90/sparse_fp8/checks/q_split_probe.cu -o /tmp/q_split_probe && /tmp/q_split_probe
// (one command) Not part of the extension build; tests/test_device_checks.py compiles it (no GPU needed) and runs it
// on a GPU. Per scale group it counts the pairs compared and the terms that differ: hi bytes that differ, and lo bytes
// that differ other than in the sign of a zero (the one difference the CPU model allows: tests/test_q_split_terms.py).
// |y| > 448 is included too (the kernels never form it: s is chosen so that |y| <= 448; both forms saturate), and NaN
// and infinite x (both give the NaN byte, or 448). Prints
//   q split probe: <pairs> pairs, <hi> hi and <lo> lo terms differ (<zero> zero lo terms differ in sign only)
// and "q split probe: ok" when hi and lo agree, else "q split probe: FAILED" (exit 1).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "sm90/decode_fp8/q_tile.cuh"
#include "sm90/sparse_fp8/checks/probe_common.cuh"

using namespace flashmla_backend::sm90;
using namespace flashmla_backend::sm90::sparse_fp8::probe;

constexpr int kMinK = -140, kMaxK = 140;

struct Counts {
  unsigned long long pairs, hi, lo, zero_sign;
};

// Thread i of the grid takes the bf16 patterns 2 (i % 32768) and 2 (i % 32768) + 1 as one pair (y0, y1), at scale
// k = kMinK + i / 32768.
__global__ void q_split_probe_kernel(Counts* counts) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int k = kMinK + i / 32768;
  if (k > kMaxK) return;
  const uint32_t b0 = 2u * uint32_t(i % 32768), b1 = b0 + 1u;
  const float scale = ldexpf(1.f, k);
  const float y0 = __uint_as_float(b0 << 16) * scale, y1 = __uint_as_float(b1 << 16) * scale;
  uint32_t h16, l16, h32, l32;
  decode_fp8::split_e4m3x2(y0, y1, h16, l16);
  decode_fp8::split_e4m3x2_f32(y0, y1, h32, l32);
  unsigned long long hi = 0, lo = 0, zero_sign = 0;
  for (int j = 0; j < 2; ++j) {
    const uint32_t a = (h16 >> (8 * j)) & 0xffu, b = (h32 >> (8 * j)) & 0xffu;
    hi += a != b;
    const uint32_t c = (l16 >> (8 * j)) & 0xffu, d = (l32 >> (8 * j)) & 0xffu;
    if (c != d) {
      if ((c & 0x7fu) == 0 && (d & 0x7fu) == 0) {
        ++zero_sign;
      } else {
        ++lo;
      }
    }
  }
  atomicAdd(&counts->pairs, 1ull);
  if (hi) atomicAdd(&counts->hi, hi);
  if (lo) atomicAdd(&counts->lo, lo);
  if (zero_sign) atomicAdd(&counts->zero_sign, zero_sign);
}

int main() {
  if (!have_sm90("q split probe")) return 2;
  Counts* d_counts;
  CUDA_OK(cudaMalloc(&d_counts, sizeof(Counts)));
  CUDA_OK(cudaMemset(d_counts, 0, sizeof(Counts)));
  const long long threads = 32768LL * (kMaxK - kMinK + 1);
  q_split_probe_kernel<<<unsigned((threads + 255) / 256), 256>>>(d_counts);
  CUDA_OK(cudaGetLastError());
  Counts c;
  CUDA_OK(cudaMemcpy(&c, d_counts, sizeof(Counts), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaFree(d_counts));
  printf("q split probe: %llu pairs, %llu hi and %llu lo terms differ (%llu zero lo terms differ in sign only)\n",
         c.pairs, c.hi, c.lo, c.zero_sign);
  const bool ok = c.pairs == static_cast<unsigned long long>(threads) && c.hi == 0 && c.lo == 0;
  printf("q split probe: %s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
