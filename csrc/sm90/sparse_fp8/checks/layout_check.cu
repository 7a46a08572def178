// Host-only check of the sparse kernel's gather layout (sparse_fp8/layout.h) against the CuTe layouts of the wgmma
// operands it feeds, and a host replay of a gather. Needs no GPU:
//   nvcc -std=c++17 --expt-relaxed-constexpr -I csrc -I <cutlass include> \
//        csrc/sm90/sparse_fp8/checks/layout_check.cu -o /tmp/sparse_layout_check && /tmp/sparse_layout_check
// Not part of the extension build; tests/test_device_checks.py compiles and runs it. Exits non-zero after reporting
// the mismatches. What it shows: the latent chunks land where the e4m3 K-major 64B-swizzled tile (the dense FP8
// kernel's) has them, the rope chunks where the bf16 K-major 128B-swizzled tile has them, every chunk of every row
// has its own 16 bytes and together they fill the stage, and a gathered block read back through the CuTe tensors
// (and the scales as float4) gives every token's bytes.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <cute/tensor.hpp>
#include <cutlass/bfloat16.h>
#include <cutlass/float8.h>

#include "common/host_check.h"
#include "sm90/sparse_fp8/layout.h"

using namespace cute;
using namespace flashmla_backend::sm90::sparse_fp8;

using F8 = cutlass::float_e4m3_t;
using BF = cutlass::bfloat16_t;
using LatentLayout = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<F8>{}, Shape<Int<kBlockTokens>, Int<512>>{}));
using RopeLayout = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<BF>{}, Shape<Int<kBlockTokens>, Int<64>>{}));

static void check_regions(uint8_t* stage) {
  static_assert(cosize_v<LatentLayout> == kLatentBytes, "latent region size");
  static_assert(cosize_v<RopeLayout> * 2 == kRopeBytes, "rope region size");
  Tensor lat = make_tensor(make_smem_ptr(reinterpret_cast<F8*>(stage)), LatentLayout{});
  for (int r = 0; r < kBlockTokens; ++r)
    for (int c = 0; c < 512; ++c)
      EXPECT_EQ(reinterpret_cast<uint8_t*>(&lat(r, c)) - stage, gather_chunk_offset(r, c / 16) + c % 16,
                "latent byte", "row %d channel %d", r, c);
  Tensor rope = make_tensor(make_smem_ptr(reinterpret_cast<BF*>(stage + kRopeAt)), RopeLayout{});
  for (int r = 0; r < kBlockTokens; ++r)
    for (int j = 0; j < 64; ++j)
      EXPECT_EQ(reinterpret_cast<uint8_t*>(&rope(r, j)) - stage, gather_chunk_offset(r, kRopeChunk0 + j / 8) + 2 * (j % 8),
                "rope byte", "row %d rope channel %d", r, j);
}

static void check_bijection() {
  std::vector<int> owner(kStageBytes / kChunkBytes, -1);
  for (int r = 0; r < kBlockTokens; ++r)
    for (int c = 0; c < kTokenChunks; ++c) {
      const uint32_t off = gather_chunk_offset(r, c);
      EXPECT_EQ(off % kChunkBytes, 0, "chunk alignment", "row %d chunk %d", r, c);
      EXPECT_EQ(off < uint32_t(kStageBytes), 1, "chunk inside the stage", "row %d chunk %d", r, c);
      if (off < uint32_t(kStageBytes)) {
        EXPECT_EQ(owner[off / kChunkBytes], -1, "chunk written twice", "row %d chunk %d", r, c);
        owner[off / kChunkBytes] = r * kTokenChunks + c;
      }
    }
  for (size_t i = 0; i < owner.size(); ++i) EXPECT_EQ(owner[i] >= 0, 1, "stage chunk left unwritten", "chunk %zu", i);
}

static void check_replay(uint8_t* stage) {
  std::vector<uint8_t> tokens(size_t(kBlockTokens) * kTokenBytes);
  uint32_t x = 12345u;
  for (auto& b : tokens) b = uint8_t((x = x * 1664525u + 1013904223u) >> 24);
  std::memset(stage, 0, kStageBytes);
  for (int r = 0; r < kBlockTokens; ++r)   // what the gather's cp.async copies do: chunk c of token r
    for (int c = 0; c < kTokenChunks; ++c)
      std::memcpy(stage + gather_chunk_offset(r, c), &tokens[size_t(r) * kTokenBytes + c * kChunkBytes], kChunkBytes);
  Tensor lat = make_tensor(make_smem_ptr(reinterpret_cast<F8*>(stage)), LatentLayout{});
  Tensor rope = make_tensor(make_smem_ptr(reinterpret_cast<BF*>(stage + kRopeAt)), RopeLayout{});
  for (int r = 0; r < kBlockTokens; ++r) {
    const uint8_t* t = &tokens[size_t(r) * kTokenBytes];
    for (int c = 0; c < 512; ++c)
      EXPECT_EQ(reinterpret_cast<const uint8_t&>(lat(r, c)), t[c], "gathered latent", "row %d channel %d", r, c);
    for (int g = 0; g < kGroups; ++g) {
      float got, want;
      std::memcpy(&got, stage + kScalesAt + r * kChunkBytes + 4 * g, 4);
      std::memcpy(&want, t + 512 + 4 * g, 4);
      EXPECT_EQ(std::memcmp(&got, &want, 4), 0, "gathered scale", "row %d group %d", r, g);
    }
    for (int j = 0; j < 64; ++j) {
      uint16_t got, want;
      std::memcpy(&got, &rope(r, j), 2);
      std::memcpy(&want, t + 528 + 2 * j, 2);
      EXPECT_EQ(got, want, "gathered rope", "row %d rope channel %d", r, j);
    }
  }
}

int main() {
  uint8_t* stage = static_cast<uint8_t*>(std::aligned_alloc(1024, kStageBytes));
  check_regions(stage);
  check_bijection();
  check_replay(stage);
  std::free(stage);
  if (g_fail) {
    printf("%d mismatches\n", g_fail);
    return 1;
  }
  printf("all layouts agree (sparse gather)\n");
  return 0;
}
