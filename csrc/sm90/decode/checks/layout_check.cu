// Host-only consistency check of the sm90 decode kernel's hand-written index formulas against the
// CuTe layouts they must agree with. Needs no GPU:
//   nvcc -std=c++17 --expt-relaxed-constexpr -I csrc -I <cutlass include> \
//        csrc/sm90/decode/checks/layout_check.cu -o /tmp/layout_check && /tmp/layout_check
// Not part of the extension build; tests/test_device_checks.py compiles and runs it. Exits non-zero after
// reporting the mismatches.
#include <cstdio>
#include <cstdlib>

#include "sm90/decode/traits.h"

#include "common/host_check.h"

using namespace cute;
using namespace flashmla_backend::sm90::decode;

// Element offset of (row, col) in a 64-row, 128B-swizzled K-major tile made of 64-column pieces:
// the formula load_q_async (bytes = 2 * this) and the TMA box placement rely on.
static int swizzled_offset(int row, int col) {
  const int piece = col / kPieceCols, cc = col % kPieceCols, chunk = cc / 8;
  return piece * kPieceElems + row * kPieceCols + ((chunk ^ (row % 8)) * 8) + cc % 8;
}

template <class Element>
static void check() {
  using T = Traits<Element>;
  // The swizzle of these layouts acts on the shared-memory address, so compare element addresses of
  // tensors over a 1024-byte aligned host buffer (the kernel realigns its shared memory the same way).
  Element* buf = static_cast<Element*>(std::aligned_alloc(kSmemAlign, kKVBlockBytes));
  Tensor tq = make_tensor(make_smem_ptr(buf), typename T::SmemLayoutQK{});
  Tensor tkv = make_tensor(make_smem_ptr(buf), typename T::SmemLayoutKV{});
  Tensor tvt = make_tensor(make_smem_ptr(buf), typename T::SmemLayoutVt{});
  Tensor tp = make_tensor(make_smem_ptr(buf), typename T::SmemLayoutP{});
  auto off = [&](auto& ref) { return static_cast<long long>(&ref - buf); };
  // Q tile / KV block vs the formula (Q cp.async, TMA piece boxes, zero_v_rows' whole 128-byte rows).
  for (int r = 0; r < kBlockM; ++r)
    for (int c = 0; c < kHeadDimK; ++c) {
      EXPECT_EQ(off(tq(r, c)), swizzled_offset(r, c), "SmemLayoutQK", "(%d,%d)", r, c);
      EXPECT_EQ(off(tkv(r, c)), swizzled_offset(r, c), "SmemLayoutKV", "(%d,%d)", r, c);
    }
  // V^T view is the same bytes as the KV block.
  for (int n = 0; n < kHeadDimV; ++n)
    for (int k = 0; k < kBlockN; ++k) EXPECT_EQ(off(tvt(n, k)), off(tkv(k, n)), "SmemLayoutVt", "(%d,%d)", n, k);
  // P tile = one piece.
  for (int r = 0; r < kBlockM; ++r)
    for (int c = 0; c < kBlockN; ++c) EXPECT_EQ(off(tp(r, c)), swizzled_offset(r, c), "SmemLayoutP", "(%d,%d)", r, c);
  std::free(buf);

  // Accumulator fragments: (thread, i) -> (row, col) as used by mask_scores / scale_rows / store_output.
  auto expect_row = [](int t, int i) { return 16 * (t / 32) + (t % 32) / 4 + 8 * ((i >> 1) & 1); };
  auto expect_col = [](int t, int i) { return 8 * (i >> 2) + 2 * (t % 4) + (i & 1); };
  {
    typename T::TiledMmaQK mma;
    Tensor id = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
    for (int t = 0; t < kThreadsPerWarpGroup; ++t) {
      Tensor c = mma.get_slice(t).partition_C(id);
      if (t == 0 && size(c) != 32) { printf("S fragment size %d\n", int(size(c))); ++g_fail; }
      for (int i = 0; i < size(c); ++i) {
        EXPECT_EQ(get<0>(c(i)), expect_row(t, i), "S row", "t=%d i=%d", t, i);
        EXPECT_EQ(get<1>(c(i)), expect_col(t, i), "S col", "t=%d i=%d", t, i);
      }
    }
  }
  {
    typename T::TiledMmaPVReg mma;
    Tensor id = make_identity_tensor(Shape<Int<kBlockM>, Int<kHalfDimV>>{});
    for (int t = 0; t < kThreadsPerWarpGroup; ++t) {
      Tensor c = mma.get_slice(t).partition_C(id);
      if (t == 0 && size(c) != 128) { printf("O fragment size %d\n", int(size(c))); ++g_fail; }
      for (int i = 0; i < size(c); ++i) {
        EXPECT_EQ(get<0>(c(i)), expect_row(t, i), "O row", "t=%d i=%d", t, i);
        EXPECT_EQ(get<1>(c(i)), expect_col(t, i), "O col", "t=%d i=%d", t, i);
      }
    }
  }
  {
    // The register A operand of P V: element i of the fragment must hold P(row, key) with the same
    // (row, key) as element i of the S accumulator (the kernel converts element by element).
    typename T::TiledMmaPVReg mma;
    Tensor id = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
    for (int t = 0; t < kThreadsPerWarpGroup; ++t) {
      Tensor a = mma.get_slice(t).partition_A(id);
      auto frag_shape = partition_shape_A(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
      if (t == 0 && (size(a) != 32 || size(frag_shape) != 32)) { printf("P fragment size %d\n", int(size(a))); ++g_fail; }
      // partition_A is (MMA, MMA_M, MMA_K); flatten in the same (column-major) order as the register tensor.
      for (int i = 0; i < size(a); ++i) {
        EXPECT_EQ(get<0>(a(i)), expect_row(t, i), "P row", "t=%d i=%d", t, i);
        EXPECT_EQ(get<1>(a(i)), expect_col(t, i), "P key", "t=%d i=%d", t, i);
      }
    }
    // The register tensor the kernel builds for P is compact and ordered like the S accumulator.
    auto frag = make_layout(partition_shape_A(mma, Shape<Int<kBlockM>, Int<kBlockN>>{}));
    for (int i = 0; i < size(frag); ++i) EXPECT_EQ(frag(i), i, "P register order", "i=%d", i);
    typename T::TiledMmaQK mma_qk;
    auto sfrag = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{}).layout();
    for (int i = 0; i < size(sfrag); ++i) EXPECT_EQ(sfrag(i), i, "S register order", "i=%d", i);
  }
}

int main() {
  check<cutlass::bfloat16_t>();
  check<cutlass::half_t>();
  using TB = Traits<cutlass::bfloat16_t>;
  static_assert(sizeof(TB::SharedStorage) % kSmemAlign == 0, "plan alignment");
  static_assert(Traits<cutlass::half_t>::kSmemBytes == TB::kSmemBytes, "one plan for both variants");
  printf("smem plan %zu bytes (+%d realignment) = %d requested, limit %d\n", sizeof(TB::SharedStorage), kSmemAlign,
         TB::kSmemBytes, kMaxSmemPerBlock);
  if (g_fail) {
    printf("layout_check: %d mismatches\n", g_fail);
    return 1;
  }
  printf("layout_check: all layouts agree\n");
  return 0;
}
