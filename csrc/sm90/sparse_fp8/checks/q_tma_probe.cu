// GPU probe of the sparse kernel's Q tile by the tensor-memory accelerator (sparse_fp8/q_tma.h), checked byte for
// byte against the layout q_slot_copy writes (common.cuh; layout.h: gather_chunk_offset, sw128_offset):
//   nvcc -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -I csrc -I <cutlass include>
//        csrc/sm90/sparse_fp8/checks/q_tma_probe.cu -o /tmp/sparse_q_tma_probe && /tmp/sparse_q_tma_probe
// (one command) Not part of the extension build; tests/test_device_checks.py compiles it (no GPU needed) and runs it
// on a GPU.
//
// One CTA of 128 threads copies the tile of rows row0 .. row0 + 63 of a bf16 q with the latent map(s) and the rope
// map into 72 KB of shared memory (one thread arms a transaction barrier with the tile's bytes and issues the copies; all wait),
// then writes the shared memory out; the host compares every byte with the expected tile (zeros for rows past the
// last). Two q layouts: q and q_pe as separate contiguous tensors ([rows, 512], [rows, 64]), and both as views of one
// [rows, 576] tensor (q_pe at q + 512, row stride 576, as the engines pass them); 130 rows, so the tile at row 128
// holds 2 rows and 62 of zeros. Two latent forms: the five-dimensional map (one copy) and one four-dimensional map a
// half (two copies). Prints per case and form:
//   q tma case <layout> form <5d|4d-halves> tile <row0>: <n> wrong bytes   (or: encode failed, CUresult <c>)
// then "q tma probe: ok (right: <forms>)" when some form is right in every case, else "q tma probe: FAILED" (exit 1).
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cutlass/arch/barrier.h>

#include "sm90/sparse_fp8/checks/probe_common.cuh"
#include "sm90/sparse_fp8/layout.h"
#include "sm90/sparse_fp8/q_tma.h"

using namespace flashmla_backend::sm90::sparse_fp8;
using flashmla_backend::sm90::sparse_fp8::probe::have_sm90;

constexpr int kTileBytes = int(kQTmaLatentBytes + kQTmaRopeBytes);

struct Maps {
  CUtensorMap latent;     // the five-dimensional form
  CUtensorMap half[2];    // the two-map form
  CUtensorMap rope;
};

__global__ void __launch_bounds__(128) q_tma_kernel(const __grid_constant__ Maps maps, int form, int row0,
                                                    uint8_t* out) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  __shared__ __align__(8) uint64_t bar_word;
  auto& bar = *reinterpret_cast<cutlass::arch::ClusterTransactionBarrier*>(&bar_word);
  const uint32_t bar_addr = static_cast<uint32_t>(__cvta_generic_to_shared(&bar_word));
  const uint32_t lat = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t rope = lat + kQTmaLatentBytes;
  if (threadIdx.x == 0) {
    bar.init(1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    bar.arrive_and_expect_tx(uint32_t(kTileBytes));  // the kernel's q_full (lead.cuh) the same way
    if (form == 0) {
      q_tma_latent(&maps.latent, lat, bar_addr, row0);
    } else {
      q_tma_latent_half(&maps.half[0], lat, bar_addr, row0);
      q_tma_latent_half(&maps.half[1], lat + kLatentBytes, bar_addr, row0);
    }
    q_tma_rope(&maps.rope, rope, bar_addr, row0);
  }
  bar.wait(0);
  for (int i = threadIdx.x; i < kTileBytes / 16; i += blockDim.x)
    reinterpret_cast<uint4*>(out)[i] = reinterpret_cast<const uint4*>(smem)[i];
}

// The tile q_slot_copy writes for rows row0 .. row0 + 63 (zeros past `rows`).
static std::vector<uint8_t> expected_tile(const std::vector<uint16_t>& q, int64_t q_stride, const uint16_t* q_pe,
                                          int64_t pe_stride, int rows, int row0) {
  std::vector<uint8_t> t(kTileBytes, 0);
  for (int r = 0; r < 64; ++r) {
    const int row = row0 + r;
    if (row >= rows) continue;
    for (int c = 0; c < 32; ++c) {  // latent chunk c: channels 16 c .. + 7 to the hi region, + 8 .. + 15 to lo
      for (int h = 0; h < 2; ++h) {
        const uint32_t off = uint32_t(h) * kLatentBytes + gather_chunk_offset(r, c);
        std::memcpy(&t[off], &q[size_t(row) * q_stride + 16 * c + 8 * h], 16);
      }
    }
    for (int c = 0; c < 8; ++c)
      std::memcpy(&t[kQTmaLatentBytes + sw128_offset(r, c)], q_pe + size_t(row) * pe_stride + 8 * c, 16);
  }
  return t;
}

int main() {
  if (!have_sm90("q tma probe")) return 2;
  constexpr int kRows = 130;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> bits(0, 0xffff);
  // Layout 0: separate [rows, 512] and [rows, 64]; layout 1: one [rows, 576], q_pe at + 512.
  const char* layouts[2] = {"separate", "one-576-row"};
  const char* forms[2] = {"5d", "4d-halves"};
  bool right[2] = {true, true};
  uint8_t* d_out = nullptr;
  CUDA_OK(cudaMalloc(&d_out, kTileBytes));
  const int smem = kTileBytes + 1024;
  CUDA_OK(cudaFuncSetAttribute(q_tma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  for (int layout = 0; layout < 2; ++layout) {
    const int64_t q_stride = layout == 0 ? 512 : 576, pe_stride = layout == 0 ? 64 : 576;
    std::vector<uint16_t> q(size_t(kRows) * q_stride), pe_sep(layout == 0 ? size_t(kRows) * 64 : 0);
    for (auto& v : q) v = uint16_t(bits(rng));
    for (auto& v : pe_sep) v = uint16_t(bits(rng));
    const uint16_t* pe_host = layout == 0 ? pe_sep.data() : q.data() + 512;
    uint16_t *d_q = nullptr, *d_pe = nullptr;
    CUDA_OK(cudaMalloc(&d_q, q.size() * 2));
    CUDA_OK(cudaMemcpy(d_q, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
    if (layout == 0) {
      CUDA_OK(cudaMalloc(&d_pe, pe_sep.size() * 2));
      CUDA_OK(cudaMemcpy(d_pe, pe_sep.data(), pe_sep.size() * 2, cudaMemcpyHostToDevice));
    }
    const uint16_t* d_pe_view = layout == 0 ? d_pe : d_q + 512;
    Maps maps;
    std::memset(&maps, 0, sizeof(maps));
    const CUresult e5 = encode_q_latent_map(&maps.latent, d_q, kRows, q_stride);
    const CUresult e4a = encode_q_latent_half_map(&maps.half[0], d_q, kRows, q_stride, 0);
    const CUresult e4b = encode_q_latent_half_map(&maps.half[1], d_q, kRows, q_stride, 1);
    const CUresult er = encode_q_rope_map(&maps.rope, d_pe_view, kRows, pe_stride);
    if (er != CUDA_SUCCESS) {
      printf("q tma case %s: rope map encode failed, CUresult %d\n", layouts[layout], int(er));
      right[0] = right[1] = false;
      CUDA_OK(cudaFree(d_q));
      if (d_pe) CUDA_OK(cudaFree(d_pe));
      continue;
    }
    for (int form = 0; form < 2; ++form) {
      const CUresult e = form == 0 ? e5 : (e4a != CUDA_SUCCESS ? e4a : e4b);
      if (e != CUDA_SUCCESS) {
        printf("q tma case %s form %s: encode failed, CUresult %d\n", layouts[layout], forms[form], int(e));
        right[form] = false;
        continue;
      }
      for (int row0 = 0; row0 < kRows; row0 += 64) {
        CUDA_OK(cudaMemset(d_out, 0xAB, kTileBytes));
        q_tma_kernel<<<1, 128, smem>>>(maps, form, row0, d_out);
        CUDA_OK(cudaGetLastError());
        CUDA_OK(cudaDeviceSynchronize());
        std::vector<uint8_t> got(kTileBytes);
        CUDA_OK(cudaMemcpy(got.data(), d_out, kTileBytes, cudaMemcpyDeviceToHost));
        const std::vector<uint8_t> want = expected_tile(q, q_stride, pe_host, pe_stride, kRows, row0);
        long wrong = 0;
        for (int i = 0; i < kTileBytes; ++i) wrong += got[i] != want[i];
        printf("q tma case %s form %s tile %d: %ld wrong bytes\n", layouts[layout], forms[form], row0, wrong);
        if (wrong) right[form] = false;
      }
    }
    CUDA_OK(cudaFree(d_q));
    if (d_pe) CUDA_OK(cudaFree(d_pe));
  }
  CUDA_OK(cudaFree(d_out));
  std::string ok;
  for (int form = 0; form < 2; ++form)
    if (right[form]) ok += std::string(ok.empty() ? "" : ", ") + forms[form];
  if (ok.empty()) {
    printf("q tma probe: FAILED\n");
    return 1;
  }
  printf("q tma probe: ok (right: %s)\n", ok.c_str());
  return 0;
}
