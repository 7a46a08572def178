// Host-only check of the sm90 FP8 tensor-core decode kernel's index formulas (layout.h) against the CuTe layouts
// and MMA fragments they must agree with, and a host replay of the V transposition. Needs no GPU:
//   nvcc -std=c++17 --expt-relaxed-constexpr -I csrc -I <cutlass include> \
//        csrc/sm90/decode_fp8/checks/layout_check.cu -o /tmp/fp8_layout_check && /tmp/fp8_layout_check
// Not part of the extension build; tests/test_device_checks.py compiles and runs it. Exits non-zero after reporting
// the mismatches. What it shows: the swizzled byte offsets the Q copy, the TMA boxes and the transposer use are
// those of the wgmma layouts; the accumulator and A-fragment coordinates are CuTe's; and replaying ldmatrix.trans,
// the byte permutes and stmatrix lane by lane puts V[key][c] at V^T[c][k'] with key = the key whose probability the
// P fragment places at k', for every key, column and lane, so that P V sums P[row][key] V[key][c].
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "sm90/decode/epilogue.cuh"
#include "sm90/decode_fp8/keys_on_m.h"
#include "sm90/decode_fp8/layout.h"
#include "sm90/decode_fp8/traits.h"

#include "common/host_check.h"

using namespace cute;
using namespace flashmla_backend::sm90::decode_fp8;

using T = Traits<cutlass::float_e4m3_t, 1, 2, 2, 4>;
using F8 = cutlass::float_e4m3_t;

// The 32-bit result of PTX prmt / __byte_perm(x, y, s): byte k = byte s_k of the 8-byte value (y:x).
static uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t v = (uint64_t(y) << 32) | x;
  uint32_t r = 0;
  for (int k = 0; k < 4; ++k) r |= uint32_t((v >> (8 * ((s >> (4 * k)) & 7))) & 0xff) << (8 * k);
  return r;
}

static void check_tiles() {
  F8* buf = static_cast<F8*>(std::aligned_alloc(kSmemAlign, kTileBytes));
  Tensor tile = make_tensor(make_smem_ptr(buf), typename T::SmemLayoutTile{});
  for (int r = 0; r < kBlockM; ++r)
    for (int c = 0; c < kHeadDimK; ++c)
      EXPECT_EQ(&tile(r, c) - buf, tile_chunk_offset(r, c / 16) + c % 16, "Q / KV tile byte", "row %d col %d", r, c);
  Tensor vt = make_tensor(make_smem_ptr(buf), typename T::SmemLayoutVtHalf{});
  for (int n = 0; n < kHalfDimV; ++n)
    for (int k = 0; k < kBlockN; ++k)
      EXPECT_EQ(&vt(n, k) - buf, sw64_offset(n, k / 16) + k % 16, "V^T byte", "column %d k' %d", n, k);
  std::free(buf);
}

// Accumulator value i of thread t of a 64 x N wgmma: (row, column) by CuTe against the formula of softmax.cuh.
static void check_fragments() {
  typename T::TiledMmaQK mma_s;
  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  typename T::TiledMmaPV mma_pv;
  Tensor cP = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  for (int t = 0; t < 128; ++t) {
    const int l = t % 32, g = 16 * (t / 32) + l / 4;
    Tensor s = mma_s.get_slice(t).partition_C(cS);
    for (int i = 0; i < size(s); ++i) {
      EXPECT_EQ(get<0>(s(i)), g + 8 * ((i >> 1) & 1), "S row", "thread %d value %d", t, i);
      EXPECT_EQ(get<1>(s(i)), 8 * (i >> 2) + 2 * (l % 4) + (i & 1), "S key", "thread %d value %d", t, i);
    }
    // The A fragment of P V: byte i of word w (w = 4 kk + q) of the thread's fragment.
    Tensor a = mma_pv.get_slice(t).partition_A(cP);  // ((4,2,2), 1, 2): byte = value + 16 k-block
    for (int kk = 0; kk < 2; ++kk)
      for (int q = 0; q < 4; ++q)
        for (int i = 0; i < 4; ++i) {
          const int value = 4 * q + i;  // within the k-block: v0 = i, v1 = q & 1, v2 = q >> 1
          const auto coord = a(value, 0, kk);
          EXPECT_EQ(get<0>(coord), g + 8 * (q & 1), "P fragment row", "thread %d kk %d q %d i %d", t, kk, q, i);
          EXPECT_EQ(get<1>(coord), 32 * kk + 16 * (q >> 1) + 4 * (l % 4) + i, "P fragment k'",
                    "thread %d kk %d q %d i %d", t, kk, q, i);
          // The S value placed there: same row, and its key is the key V^T holds at that k' (checked below).
          const int src = p_source_index(kk, q, i);
          EXPECT_EQ(get<0>(s(src)), get<0>(coord), "P source row", "thread %d kk %d q %d i %d", t, kk, q, i);
        }
  }
}

// The key whose probability the P fragment places at k' (any thread of a quad: the same for all).
static int key_of_kprime(int kp) {
  typename T::TiledMmaQK mma_s;
  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  const int kk = kp / 32, half = (kp % 32) / 16, t = (kp % 16) / 4, i = kp % 4;
  Tensor s = mma_s.get_slice(t).partition_C(cS);  // thread t of warp 0: lane % 4 == t
  return get<1>(s(p_source_index(kk, 2 * half, i)));
}

// The 32 banks of 4 bytes a 16-byte access at this shared-memory offset covers start at bank (offset / 4) % 32.
static int bank_group(uint32_t offset) { return int((offset / 16) % 8); }

// One 8 x 16-byte matrix of ldmatrix / stmatrix is one shared-memory wavefront when its eight rows fall into eight
// distinct 16-byte bank groups.
static void expect_conflict_free(const uint32_t (&rows)[8], const char* what, int j, int cc, int th, int m) {
  int seen = 0;
  for (int r = 0; r < 8; ++r) seen |= 1 << bank_group(rows[r]);
  EXPECT_EQ(seen, 0xff, what, "piece %d cc %d th %d matrix %d", j, cc, th, m);
}

// Replays the transposition of one block: V (64 keys x 512 columns, in its KV stage) -> V^T (two halves).
static void check_transposition() {
  std::vector<uint8_t> stage(kTileBytes), vt(kVtBytes, 0xEE);  // left half, then right half
  auto v_at = [](int key, int col) { return uint8_t((key * 131 + col * 7 + (col >> 6)) & 0xff); };
  for (int key = 0; key < kBlockN; ++key)
    for (int col = 0; col < kHeadDimV; ++col)
      stage[tile_chunk_offset(key, col / 16) + col % 16] = v_at(key, col);
  for (int j = 0; j < kNumVPieces; ++j)
    for (int cc = 0; cc < 4; ++cc)
      for (int th = 0; th < 2; ++th) {
        for (int m = 0; m < 4; ++m) {
          uint32_t src[8], dst[8];
          for (int r = 0; r < 8; ++r) {
            src[r] = TransposeLane::of(8 * m + r).src(j, cc, th);
            dst[r] = TransposeLane::of(8 * m + r).dst(j, cc, th);
          }
          expect_conflict_free(src, "ldmatrix bank groups", j, cc, th, m);
          expect_conflict_free(dst, "stmatrix bank groups", j, cc, th, m);
        }
        uint32_t d[32][4];
        for (int lane = 0; lane < 32; ++lane) {
          // ldmatrix.x4.trans: lane L receives, of matrix m, the 16-bit pair (row 2 (L % 4) + e, column L / 4) of the
          // 8 x 8 pairs whose row r starts at the address lane 8 m + r supplied.
          for (int m = 0; m < 4; ++m) {
            uint32_t reg = 0;
            for (int e = 0; e < 2; ++e) {
              const uint32_t row_addr = TransposeLane::of(8 * m + 2 * (lane % 4) + e).src(j, cc, th);
              uint16_t pair;
              std::memcpy(&pair, &stage[row_addr + 2 * (lane / 4)], 2);
              reg |= uint32_t(pair) << (16 * e);
            }
            d[lane][m] = reg;
            // The keys the kernel's masking assumes for the two halves.
            const int key0 = transposed_key(th, m, lane);
            EXPECT_EQ(reg & 0xff, v_at(key0, 64 * j + 16 * cc + 2 * (lane / 4)), "ldmatrix key", "lane %d m %d",
                      lane, m);
          }
        }
        // Byte permutes, then stmatrix.x4: lane L's register m goes to bytes 4 (L % 4) .. of row L / 4 of matrix m,
        // whose row r address lane 8 m + r supplied.
        for (int lane = 0; lane < 32; ++lane) {
          const uint32_t o[4] = {byte_perm(d[lane][0], d[lane][1], 0x6420), byte_perm(d[lane][0], d[lane][1], 0x7531),
                                 byte_perm(d[lane][2], d[lane][3], 0x6420), byte_perm(d[lane][2], d[lane][3], 0x7531)};
          for (int m = 0; m < 4; ++m) {
            const uint32_t row_addr = (j / kVPiecesPerHalf) * kVtHalfBytes + TransposeLane::of(8 * m + lane / 4).dst(j, cc, th);
            std::memcpy(&vt[row_addr + 4 * (lane % 4)], &o[m], 4);
          }
        }
      }
  // Row n of half h (the P V accumulator's column n of consumer warpgroup h) holds value column
  // 256 h + vt_row_column(n), the column the epilogue writes it to.
  F8* buf = static_cast<F8*>(std::aligned_alloc(kSmemAlign, kVtHalfBytes));
  Tensor layout = make_tensor(make_smem_ptr(buf), typename T::SmemLayoutVtHalf{});
  for (int h = 0; h < 2; ++h)
    for (int n = 0; n < kHalfDimV; ++n)
      for (int kp = 0; kp < kBlockN; ++kp) {
        const int col = kHalfDimV * h + vt_row_column(n);
        EXPECT_EQ(vt[h * kVtHalfBytes + (&layout(n, kp) - buf)], v_at(key_of_kprime(kp), col), "V^T", "half %d row %d k' %d",
                  h, n, kp);
      }
  std::free(buf);
}

// The epilogue's column map: P V accumulator value i of thread t (CuTe: its column n) is written to value column
// vt_row_column(n), the column V^T row n holds.
static void check_output_columns() {
  typename T::TiledMmaPV mma_pv;
  Tensor cO = make_identity_tensor(Shape<Int<kBlockM>, Int<kHalfDimV>>{});
  bool hit[kHalfDimV] = {};
  for (int t = 0; t < 128; ++t) {
    const int l = t % 32, g = 16 * (t / 32) + l / 4;
    Tensor o = mma_pv.get_slice(t).partition_C(cO);
    for (int a = 0; a < size(o) / 8; ++a)
      for (int v = 0; v < 2; ++v)
        for (int k = 0; k < 4; ++k) {
          const auto c = o(flashmla_backend::sm90::decode::interleaved_value_index(a, v, k));
          EXPECT_EQ(get<0>(c), g + 8 * v, "epilogue row", "thread %d a %d v %d k %d", t, a, v, k);
          const int col = vt_row_column(get<1>(c));
          EXPECT_EQ(col, 16 * a + 4 * (l % 4) + k, "epilogue column", "thread %d a %d v %d k %d", t, a, v, k);
          if (col >= 0 && col < kHalfDimV) hit[col] = true;
        }
  }
  for (int c = 0; c < kHalfDimV; ++c) EXPECT_EQ(hit[c], true, "value column written", "column %d", c);
}

// The accurate mode (Traits::kPvF16): the fp16 V half the producer writes (v16_offset, 128B swizzle) is the CuTe
// layout the fp16 P V product reads as (256 columns, 64 keys); and the fp16 A fragment of P holds, at value i, the S
// accumulator value i (same row and key), which mainloop.cuh (p16_fragment) and mainloop_f16pv.cuh (scale_p16) rely
// on.
using T16 = Traits<cutlass::bfloat16_t, 2, 2, 1, 1, 224, 56, false, true>;
static void check_f16pv() {
  using H = cutlass::half_t;
  H* buf = static_cast<H*>(std::aligned_alloc(kSmemAlign, kV16HalfBytes));
  Tensor v = make_tensor(make_smem_ptr(buf), typename T16::SmemLayoutVHalf{});
  for (int n = 0; n < kHalfDimV; ++n)
    for (int k = 0; k < kBlockN; ++k)
      EXPECT_EQ(2 * (&v(n, k) - buf), v16_offset(k, n), "fp16 V byte", "column %d key %d", n, k);
  std::free(buf);
  typename T16::TiledMmaQK mma_s;
  typename T16::TiledMmaPV mma_pv;
  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  for (int t = 0; t < 128; ++t) {
    Tensor s = mma_s.get_slice(t).partition_C(cS);
    Tensor a = mma_pv.get_slice(t).partition_A(cS);
    EXPECT_EQ(int(size(a)), int(size(s)), "fp16 P fragment size", "thread %d", t);
    for (int i = 0; i < size(s); ++i) {
      // The fragment's registers in order: value i of the (MMA, 1, k16 step) tensor, k16 step outermost.
      const int per = size<0>(a);
      const auto coord = a(i % per, 0, i / per);
      EXPECT_EQ(get<0>(coord), get<0>(s(i)), "fp16 P row", "thread %d value %d", t, i);
      EXPECT_EQ(get<1>(coord), get<1>(s(i)), "fp16 P key", "thread %d value %d", t, i);
    }
  }
}

// The stacked Q tile (Traits::kStackedTerms): query row r's hi and lo terms in the tile rows that one thread's S
// accumulator holds together (rows g and g + 8 of its warp, CuTe's fragment), the lo chunk at the hi chunk +
// kStackedLoDelta, every tile row used once, and the kernel's row of the thread (kernel.cuh: 8 w + g).
static void check_stacked_terms() {
  std::vector<int> used(kBlockM, 0);
  for (int r = 0; r < kBlockM / 2; ++r) {
    for (int term = 0; term < 2; ++term) ++used[stacked_term_row(r, term)];
    for (int c = 0; c < kHeadDimK / 16; ++c)
      EXPECT_EQ(tile_chunk_offset(stacked_term_row(r, 1), c),
                tile_chunk_offset(stacked_term_row(r, 0), c) + kStackedLoDelta, "stacked lo term chunk",
                "row %d chunk %d", r, c);
  }
  for (int m = 0; m < kBlockM; ++m) EXPECT_EQ(used[m], 1, "stacked tile row use", "tile row %d", m);
  typename T::TiledMmaQK mma_s;
  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  for (int t = 0; t < 128; ++t) {
    const int r = 8 * (t / 32) + (t % 32) / 4;  // kernel.cuh: the thread's query row
    Tensor s = mma_s.get_slice(t).partition_C(cS);
    for (int i = 0; i < size(s); ++i) {
      if ((i >> 1) & 1) continue;
      EXPECT_EQ(get<0>(s(i)), stacked_term_row(r, 0), "stacked hi row", "thread %d value %d", t, i);
      EXPECT_EQ(get<0>(s(i + 2)), stacked_term_row(r, 1), "stacked lo row", "thread %d value %d", t, i);
      EXPECT_EQ(get<1>(s(i + 2)), get<1>(s(i)), "stacked term key", "thread %d value %d", t, i);
    }
  }
}

// The keys-on-M tile (keys_on_m.h, keys_on_m.cuh): its Q tile and P^T offsets (layout.h) against CuTe's layouts, the
// lo term of a row at its hi chunk + km_q_lo_delta, and the S^T and O^T accumulator coordinates keys_on_m.cuh assumes.
template <int R, int kParts>
static void check_keys_on_m() {
  using K = TraitsKM<cutlass::bfloat16_t, R, 2, kParts, kParts == 2 ? 2 : 1, 1>;
  F8* qbuf = static_cast<F8*>(std::aligned_alloc(kSmemAlign, K::kQBytes));
  Tensor q = make_tensor(make_smem_ptr(qbuf), typename K::SmemLayoutQ{});
  for (int r = 0; r < 2 * R; ++r)
    for (int c = 0; c < kHeadDimK; ++c)
      EXPECT_EQ(&q(r, c) - qbuf, km_q_chunk_offset(2 * R, r, c / 16) + c % 16, "keys-on-M Q byte", "R %d row %d col %d",
                R, r, c);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kHeadDimK / 16; ++c)
      EXPECT_EQ(km_q_chunk_offset(2 * R, r + R, c), km_q_chunk_offset(2 * R, r, c) + km_q_lo_delta(R),
                "keys-on-M lo term chunk", "R %d row %d chunk %d", R, r, c);
  std::free(qbuf);
  using H = cutlass::half_t;
  H* pbuf = static_cast<H*>(std::aligned_alloc(kSmemAlign, K::kPtBytes));
  Tensor pt = make_tensor(make_smem_ptr(pbuf), typename K::SmemLayoutPt{});
  for (int n = 0; n < R; ++n)
    for (int k = 0; k < kBlockN; ++k)
      EXPECT_EQ(2 * (&pt(n, k) - pbuf), km_pt_offset(R, n, k), "keys-on-M P^T byte", "R %d row %d key %d", R, n, k);
  std::free(pbuf);
  H* vbuf = static_cast<H*>(std::aligned_alloc(kSmemAlign, K::kVSlotBytes));
  Tensor vp = make_tensor(make_smem_ptr(vbuf), typename K::SmemLayoutVPart{});
  for (int n = 0; n < K::kPartCols; ++n)
    for (int k = 0; k < kBlockN; ++k)
      EXPECT_EQ(2 * (&vp(n, k) - vbuf), v16_offset(k, n), "keys-on-M fp16 V part byte", "parts %d column %d key %d",
                kParts, n, k);
  std::free(vbuf);
  typename K::TiledMmaS mma_s;
  typename K::TiledMmaO mma_o;
  Tensor cS = make_identity_tensor(Shape<Int<kBlockN>, Int<2 * R>>{});
  Tensor cO = make_identity_tensor(Shape<Int<K::kPartCols>, Int<R>>{});
  for (int t = 0; t < 128; ++t) {
    const int l = t % 32, w = t / 32, g = l / 4, c = l % 4;
    Tensor s = mma_s.get_slice(t).partition_C(cS);
    EXPECT_EQ(int(size(s)), R, "keys-on-M S^T values", "thread %d", t);
    for (int i = 0; i < size(s); ++i) {
      EXPECT_EQ(get<0>(s(i)), 16 * w + g + 8 * ((i >> 1) & 1), "keys-on-M S^T key", "R %d thread %d value %d", R, t, i);
      EXPECT_EQ(get<1>(s(i)), 8 * (i >> 2) + 2 * c + (i & 1), "keys-on-M S^T column", "R %d thread %d value %d", R, t,
                i);
      if (i < R / 2) {
        EXPECT_EQ(get<1>(s(i + R / 2)), get<1>(s(i)) + R, "keys-on-M lo column", "R %d thread %d value %d", R, t, i);
        EXPECT_EQ(get<0>(s(i + R / 2)), get<0>(s(i)), "keys-on-M lo key", "R %d thread %d value %d", R, t, i);
      }
    }
    Tensor o = mma_o.get_slice(t).partition_C(cO);
    EXPECT_EQ(int(size<1>(o)), K::kPartCols / 64, "keys-on-M O^T tiles", "thread %d", t);
    EXPECT_EQ(int(size<0>(o)), R / 2, "keys-on-M O^T values a tile", "thread %d", t);
    for (int mt = 0; mt < size<1>(o); ++mt)
      for (int v = 0; v < size<0>(o); ++v) {
        EXPECT_EQ(get<0>(o(v, mt, 0)), 64 * mt + 16 * w + g + 8 * ((v >> 1) & 1), "keys-on-M O^T value column",
                  "R %d thread %d tile %d value %d", R, t, mt, v);
        EXPECT_EQ(get<1>(o(v, mt, 0)), 8 * (v >> 2) + 2 * c + (v & 1), "keys-on-M O^T row", "R %d thread %d tile %d "
                  "value %d", R, t, mt, v);
      }
  }
}

// The fast mode's keys-on-M tile: P^T in e4m3 (64B swizzle) and the V^T half as its A operand against the formulas
// keys_on_m.cuh writes and reads them with, the key order of P^T (vt_kprime_of_key) the inverse of V^T's, the S^T
// and O^T coordinates, and the epilogue's value columns of O^T's rows.
template <int R>
static void check_keys_on_m_fast() {
  using K = TraitsKM<F8, R, 2, 2, 2, 1>;
  F8* qbuf = static_cast<F8*>(std::aligned_alloc(kSmemAlign, K::kQBytes));
  Tensor q = make_tensor(make_smem_ptr(qbuf), typename K::SmemLayoutQ{});  // one term: R rows
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kHeadDimK; ++c)
      EXPECT_EQ(&q(r, c) - qbuf, km_q_chunk_offset(R, r, c / 16) + c % 16, "fast keys-on-M Q byte",
                "R %d row %d col %d", R, r, c);
  std::free(qbuf);
  F8* buf = static_cast<F8*>(std::aligned_alloc(kSmemAlign, K::kVSlotBytes));
  Tensor pt = make_tensor(make_smem_ptr(buf), typename K::SmemLayoutPt{});
  for (int n = 0; n < R; ++n)
    for (int k = 0; k < kBlockN; ++k)
      EXPECT_EQ(&pt(n, k) - buf, sw64_offset(n, k / 16) + k % 16, "fast keys-on-M P^T byte", "R %d row %d k' %d", R, n,
                k);
  Tensor vp = make_tensor(make_smem_ptr(buf), typename K::SmemLayoutVPart{});
  for (int n = 0; n < kHalfDimV; ++n)
    for (int k = 0; k < kBlockN; ++k)
      EXPECT_EQ(&vp(n, k) - buf, sw64_offset(n, k / 16) + k % 16, "fast keys-on-M V^T byte", "row %d k' %d", n, k);
  std::free(buf);
  for (int kp = 0; kp < kBlockN; ++kp)
    EXPECT_EQ(vt_kprime_of_key(key_of_kprime(kp)), kp, "P^T key order", "k' %d", kp);
  // km_pt8_words and its store: lane (w, g, c) writes word k at row slot 2 k + (g odd), k' 16 w + 4 (g / 2); its bytes
  // are (the even lane's h 0, the odd lane's h 0, the even lane's h 1, the odd lane's h 1) of that slot, where lane
  // g's value h is key 16 w + g + 8 h. Every byte of P^T is written once, with the key V^T holds at its k'.
  int written[R][kBlockN] = {};
  for (int t = 0; t < 128; ++t) {
    const int l = t % 32, w = t / 32, g = l / 4, c = l % 4, even_g = g & ~1;
    for (int k = 0; k < R / 8; ++k) {
      const int slot = 2 * k + (g & 1), row = 8 * (slot >> 1) + 2 * c + (slot & 1), kp = 16 * w + 4 * (g >> 1);
      const int keys[4] = {16 * w + even_g, 16 * w + even_g + 1, 16 * w + even_g + 8, 16 * w + even_g + 9};
      for (int j = 0; j < 4; ++j) {
        EXPECT_EQ(keys[j], key_of_kprime(kp + j), "P^T word byte key", "thread %d word %d byte %d", t, k, j);
        ++written[row][kp + j];
      }
    }
  }
  for (int n = 0; n < R; ++n)
    for (int kp = 0; kp < kBlockN; ++kp) EXPECT_EQ(written[n][kp], 1, "P^T byte written once", "row %d k' %d", n, kp);
  typename K::TiledMmaS mma_s;
  typename K::TiledMmaO mma_o;
  Tensor cS = make_identity_tensor(Shape<Int<kBlockN>, Int<R>>{});
  Tensor cO = make_identity_tensor(Shape<Int<kHalfDimV>, Int<R>>{});
  for (int t = 0; t < 128; ++t) {
    const int l = t % 32, w = t / 32, g = l / 4, c = l % 4;
    Tensor sv = mma_s.get_slice(t).partition_C(cS);
    EXPECT_EQ(int(size(sv)), R / 2, "fast keys-on-M S^T values", "thread %d", t);
    for (int i = 0; i < size(sv); ++i) {
      EXPECT_EQ(get<0>(sv(i)), 16 * w + g + 8 * ((i >> 1) & 1), "fast S^T key", "R %d thread %d value %d", R, t, i);
      EXPECT_EQ(get<1>(sv(i)), 8 * (i >> 2) + 2 * c + (i & 1), "fast S^T row", "R %d thread %d value %d", R, t, i);
    }
    Tensor o = mma_o.get_slice(t).partition_C(cO);
    for (int mt = 0; mt < size<1>(o); ++mt)
      for (int v = 0; v < size<0>(o); ++v) {
        const int m = get<0>(o(v, mt, 0));
        EXPECT_EQ(m, 64 * mt + 16 * w + g + 8 * ((v >> 1) & 1), "fast O^T V^T row", "R %d thread %d tile %d value %d",
                  R, t, mt, v);
        EXPECT_EQ(get<1>(o(v, mt, 0)), 8 * (v >> 2) + 2 * c + (v & 1), "fast O^T row",
                  "R %d thread %d tile %d value %d", R, t, mt, v);
        EXPECT_EQ(vt_row_column(m), 64 * mt + 16 * w + 2 * g + ((v >> 1) & 1), "fast O^T value column",
                  "R %d thread %d tile %d value %d", R, t, mt, v);
      }
  }
}

int main() {
  check_tiles();
  check_fragments();
  check_f16pv();
  check_transposition();
  check_output_columns();
  check_stacked_terms();
  check_keys_on_m<16, 2>();
  check_keys_on_m<32, 2>();
  check_keys_on_m<16, 4>();
  check_keys_on_m<32, 4>();
  check_keys_on_m_fast<16>();
  check_keys_on_m_fast<32>();
  if (g_fail) {
    printf("%d mismatches\n", g_fail);
    return 1;
  }
  printf("all layouts agree\n");
  return 0;
}
