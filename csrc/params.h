// The one host/device contract of flashmla_backend.
//
// Plain C++ (no torch, no pybind11): the binding fills these structs from integers that the Python
// layer extracted from torch tensors after validating them, and the launchers read them.
// All strides count ELEMENTS, not bytes. The innermost dimension of every tensor is contiguous.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flashmla_backend {

// ---- Fixed problem geometry (DeepSeek-V3 MLA in absorbed / MQA form) --------------------------
constexpr int kHeadDimK = 576;        // 512 latent (kv_c) + 64 rope (k_pe); K row of the cache
constexpr int kHeadDimV = 512;        // V = first 512 columns of the same cache row
constexpr int kPageSize = 64;         // tokens per KV-cache page; also the N (key) tile of the kernels
constexpr int kBlockM = 64;           // query rows per CTA (rows = s_q * heads-per-kv-head, folded)

// ---- Tile scheduler ----------------------------------------------------------------------------
// Each request costs ceil(len / kPageSize) KV blocks plus kFixedOverheadBlocks (its epilogue).
constexpr int kFixedOverheadBlocks = 5;
// A part's share P (and piece mode's grain) is at least kMinPartBlocks blocks. The FP8 kernels take a piece's blocks
// in pairs (an odd count gets one masked virtual block), so a one-block piece costs them two blocks; with two-block
// pieces a b = 1 batch of 128 blocks runs 64 parts instead of 128 at the same time per part, with half the splits
// to combine (docs/perf/journal.md, 2026-11-27 evening, has the 16-bit and FP8 timings).
constexpr int kMinPartBlocks = 2;
// The sparse kernel takes a piece's blocks one at a time, so its schedule's parts may hold a single block: at b = 1
// twice the CTAs on half the blocks each (SchedParams::min_part_blocks; docs/perf/journal.md has the timings).
constexpr int kSparseMinPartBlocks = 1;
constexpr int kSchedMetaInts = 8;     // int32 per metadata row

// One row of tile_scheduler_metadata [num_sm_parts, 8] int32; one row per sm part.
// The part processes requests begin_req .. end_req, BOTH INCLUSIVE. Inside that range,
// request begin_req starts at token begin_token (a multiple of kPageSize) and request end_req
// stops at token end_token (EXCLUSIVE); every request strictly between is processed whole.
// begin_req > end_req means the part has no work. begin_split is the index, among the splits of
// begin_req, of the piece this part computes (0 when the part starts at the request's beginning).
struct SchedMetaRow {
  int32_t begin_req;
  int32_t begin_token;
  int32_t end_req;
  int32_t end_token;
  int32_t begin_split;
  int32_t pad[3];
};
static_assert(sizeof(SchedMetaRow) == kSchedMetaInts * sizeof(int32_t), "metadata row is 8 int32");

struct SchedParams {
  const int32_t* seqlens;   // [batch] cache_seqlens; negative values are treated as 0
  int32_t* metadata;        // [num_sm_parts, 8] out
  int32_t* num_splits;      // [batch + 1] out: prefix sum of splits per request, num_splits[0] = 0
  int batch;                // >= 1
  int num_sm_parts;         // >= 1
  int min_part_blocks;      // >= 1: kMinPartBlocks for the dense kernels, kSparseMinPartBlocks for the sparse one
  void* stream;             // cudaStream_t
};

// ---- Decode (split-KV) + combine ------------------------------------------------------------------
enum class DType : int { kBF16 = 0, kFP16 = 1 };

// The KV-cache formats, one identity from Python to the kernels: flashmla_backend/kv_format.py's formats with the same
// names and codes (KvFormat.code), DecodeParams::kv_format, and the formats each kernel reads (launch.h, which the
// binding reports as _C.kernel_kv_formats() and tests/test_build.py compares with kv_format.py; each launcher refuses
// the others through DecodeRequirements::formats). How a token of each is stored: kv_format.py.
enum class KvFormat : uint8_t {
  kBF16 = 0,       // 576 bf16 a token (q's dtype)
  kFP16 = 1,       // 576 fp16 a token (q's dtype)
  kFP8E4M3 = 2,    // 576 e4m3 a token, scaled by descale_k
  kFP8DsMla = 3,   // DeepSeek's 656-byte token: 512 e4m3 in four groups with a float32 scale each, 64 bf16 rope
};
constexpr int kNumKvFormats = 4;
inline const char* kv_format_name(KvFormat f) {
  switch (f) {
    case KvFormat::kBF16: return "bf16";
    case KvFormat::kFP16: return "fp16";
    case KvFormat::kFP8E4M3: return "fp8_e4m3";
    case KvFormat::kFP8DsMla: return "fp8_ds_mla";
  }
  return "unknown";
}
static_assert(static_cast<int>(KvFormat::kBF16) == static_cast<int>(DType::kBF16) &&
                  static_cast<int>(KvFormat::kFP16) == static_cast<int>(DType::kFP16),
              "a 16-bit format's code is its dtype's (check_decode_params compares them)");
// A set of formats as bits (bit int(f)).
constexpr uint32_t kv_format_bit(KvFormat f) { return 1u << static_cast<int>(f); }

// The decode arguments, listed once. Each entry is ARG(type, name) -- set by the caller (Python sets it
// on _C.DecodeArgs under the same name; pointers as integers, dtype as its int code) -- or
// DERIVED(type, name) -- computed from the ARG fields by derive_decode_params() below, nowhere else.
// The list generates DecodeParams (in this order: it is the kernels' parameter layout, which the
// static_asserts below pin) and the Python binding (csrc/binding/module.cpp), which exports the ARG
// names as _C.decode_fields. A new kernel argument is one line here, the line of
// flashmla_backend/ops.py that sets it and the kernel code that reads it.
//
// Tensors (strides in elements; the innermost dimension of each is contiguous):
//   q           [b, s_q, h_q, 576]                   q's dtype; columns 512..575 are read through q_pe
//   q_pe        [b, s_q, h_q, 64]                    q's dtype (q + 512 for a single q tensor)
//   kv          [num_pages, kPageSize, h_kv, 576]    q's dtype, or float8_e4m3fn with kv_format kFP8E4M3 (V = columns
//                                                    0..511 of the same row)
//   block_table [b, max_pages_per_seq] int32         page ids
//   seqlens     [b] int32                            cache_seqlens. The kernels clamp each length to
//                                                    [0, kPageSize * max_pages_per_seq] so that no read
//                                                    leaves the block table; the opt-in checked mode in
//                                                    Python raises instead.
//   sched_meta  [num_sm_parts, 8] int32, num_splits [b + 1] int32: the tile scheduler's output
//   out         [b, s_q, h_q, 512]                   q's dtype
//   lse         [b, h_q, s_q] fp32, natural log; innermost (s_q) stride 1
//   Split accumulators, contiguous, indexed by global split id sid = num_splits[req] + split_index:
//   lse_accum   [b + num_sm_parts, h_kv, q_rows]      fp32, natural log, -inf for "no keys in split"
//   o_accum     [b + num_sm_parts, h_kv, q_rows, 512] fp32, already divided by the split's row sum
//   (b + num_sm_parts bounds the number of splits: every part boundary adds at most one.)
#define FMLA_DECODE_PARAMS(ARG, DERIVED)                                                                      \
  ARG(DType, dtype)                     /* element type of q, kv and out */                                    \
  ARG(int, device)                      /* CUDA device ordinal the pointers live on */                         \
                                                                                                              \
  ARG(int, batch)                       /* b */                                                                \
  ARG(int, seqlen_q)                    /* s_q: query tokens per request */                                    \
  ARG(int, num_heads_q)                 /* h_q */                                                              \
  ARG(int, num_heads_kv)                /* h_kv, divides h_q */                                                \
  DERIVED(int, ngroups)                 /* h_q / h_kv */                                                       \
  DERIVED(int, q_rows)                  /* s_q * ngroups: query rows per (request, kv head); row r <->       \
                                           (s = r / ngroups, head = kv_head * ngroups + r % ngroups) */        \
  DERIVED(int, num_m_blocks)            /* ceil(q_rows / kBlockM) */                                           \
  ARG(int, num_sm_parts)                /* rows of the scheduler metadata (grid.z of the decode kernel) */     \
                                                                                                              \
  ARG(int, num_pages)                   /* k_cache.shape[0] */                                                 \
  ARG(int, max_pages_per_seq)           /* block_table.shape[1] */                                             \
                                                                                                              \
  ARG(float, scale)                     /* softmax scale (natural-log domain) */                               \
  DERIVED(float, scale_log2)            /* scale * log2(e) */                                                  \
  ARG(bool, causal)                     /* query token s of a request with n keys sees keys [0, n - s_q + s] */ \
                                                                                                              \
  ARG(const void*, q)                                                                                         \
  ARG(int64_t, q_stride_b)                                                                                    \
  ARG(int64_t, q_stride_s)                                                                                    \
  ARG(int64_t, q_stride_h)                                                                                    \
  ARG(const void*, kv)                                                                                        \
  ARG(int64_t, kv_stride_page)                                                                                \
  ARG(int64_t, kv_stride_token)                                                                               \
  ARG(int64_t, kv_stride_h)                                                                                   \
  ARG(const int32_t*, block_table)                                                                            \
  ARG(int64_t, block_table_stride_b)                                                                          \
  ARG(const int32_t*, seqlens)                                                                                \
  ARG(const int32_t*, sched_meta)                                                                             \
  ARG(const int32_t*, num_splits)                                                                             \
                                                                                                              \
  ARG(void*, out)                                                                                             \
  ARG(int64_t, out_stride_b)                                                                                  \
  ARG(int64_t, out_stride_s)                                                                                  \
  ARG(int64_t, out_stride_h)                                                                                  \
  ARG(float*, lse)                                                                                            \
  ARG(int64_t, lse_stride_b)                                                                                  \
  ARG(int64_t, lse_stride_h)                                                                                  \
  ARG(float*, lse_accum)                                                                                      \
  ARG(float*, o_accum)                                                                                        \
                                                                                                              \
  ARG(void*, stream)                    /* cudaStream_t */                                                     \
  ARG(bool, pdl)                        /* launch combine with programmatic dependent launch (sm_90+) */       \
                                                                                                              \
  /* The KV cache's format (KvFormat above). The 16-bit ones are q's dtype. kFP8E4M3 (sm90 kernel only): kv is  \
     float8_e4m3fn; the cache row of request req and kv head hk has true value = stored *                      \
     descale_k[req * descale_k_stride_b + hk * descale_k_stride_h]. q_fp8 (needs kFP8E4M3): q is              \
     float8_e4m3fn, true value = stored * descale_q[req * descale_q_stride_b + hk *                            \
     descale_q_stride_h] (hk: the kv head of the query head); out is then bf16. The descales are fp32 device   \
     tensors read by the kernel once per request (they may change between graph replays), [b, h_kv] with any \
     strides (element strides >= 0; a single per-tensor scale has strides 0, 0); null when unused. With FP8   \
     pieces, `dtype` is out's element type (q's when q is not FP8). */                                        \
  ARG(KvFormat, kv_format)                                                                                    \
  ARG(bool, q_fp8)                                                                                            \
  ARG(const float*, descale_q)                                                                                \
  ARG(const float*, descale_k)                                                                                \
  ARG(int64_t, descale_q_stride_b)                                                                            \
  ARG(int64_t, descale_q_stride_h)                                                                            \
  ARG(int64_t, descale_k_stride_b)                                                                            \
  ARG(int64_t, descale_k_stride_h)                                                                            \
                                                                                                              \
  /* The rope part of q (columns kHeadDimV .. kHeadDimK - 1) through a pointer of its own: q_pe [b, s_q, h_q,  \
     64] in q's dtype, with its own strides. Engines hand q as two tensors (vLLM: the absorbed latent part and \
     the rope part in separate buffers); reading them in place saves a concatenation per layer. The kernels   \
     read columns 0..511 from q and 512..575 from q_pe; for one [.., 576] q the caller sets q_pe = q + 512    \
     with q's strides. */                                                                                     \
  ARG(const void*, q_pe)                                                                                      \
  ARG(int64_t, q_pe_stride_b)                                                                                 \
  ARG(int64_t, q_pe_stride_s)                                                                                 \
  ARG(int64_t, q_pe_stride_h)                                                                                 \
                                                                                                              \
  /* Sparse decode (DeepSeek-V3.2's attention; the sm90 sparse kernel, csrc/sm90/sparse_fp8/): indices non-null \
     selects it. The caller maps FlashMLA's sparse call onto these fields: a "request" is one query token of   \
     one request (batch = b * s_q, seqlen_q 1, num_heads_kv 1, q_rows = h_q), its keys the entries of its       \
     index row: indices [batch, >= max_pages_per_seq * kPageSize entries] int32 with row stride             \
     indices_stride, entry v naming cache token v of num_kv_tokens (kv: fp8_ds_mla tokens of 656 bytes, one     \
     after another); seqlens[r] is the row's length for the schedule (topk), topk_length (null: none) the      \
     entries that count, read by the kernel for row r at request r / sparse_seqlen_q (clamped to [0, seqlens[r]]: \
     the schedule does not depend on it, so a captured graph follows new values); the entries that name no     \
     token (negative, or >= num_kv_tokens) are skipped and never read. block_table and the kv strides are       \
     unused. */                                                                                                \
  ARG(const int32_t*, indices)                                                                                \
  ARG(int64_t, indices_stride)                                                                                \
  ARG(int64_t, num_kv_tokens)                                                                                 \
  ARG(const int32_t*, topk_length)                                                                            \
  ARG(int, sparse_seqlen_q)                                                                                   \
  ARG(bool, skip_combine) /* sparse decode only: no row has more than one split (the caller computed the schedule \
                             on the host too), so the combine is not launched */

#define FMLA_DECODE_PARAMS_MEMBER(type, name) type name;
struct DecodeParams {
  FMLA_DECODE_PARAMS(FMLA_DECODE_PARAMS_MEMBER, FMLA_DECODE_PARAMS_MEMBER)
};
#undef FMLA_DECODE_PARAMS_MEMBER

// DecodeParams is passed by value as a kernel parameter: its layout is part of every kernel's binary.
// These asserts pin it (x86-64 / aarch64 LP64 layout): reordering, retyping or inserting a field fails here.
static_assert(sizeof(DecodeParams) == 376 && alignof(DecodeParams) == 8, "DecodeParams layout changed");
static_assert(offsetof(DecodeParams, num_sm_parts) == 36 && offsetof(DecodeParams, causal) == 56 &&
                  offsetof(DecodeParams, q) == 64 && offsetof(DecodeParams, seqlens) == 144 &&
                  offsetof(DecodeParams, o_accum) == 232 && offsetof(DecodeParams, pdl) == 248 &&
                  offsetof(DecodeParams, kv_format) == 249 && offsetof(DecodeParams, descale_k) == 264 &&
                  offsetof(DecodeParams, descale_q_stride_b) == 272 &&
                  offsetof(DecodeParams, descale_k_stride_h) == 296 && offsetof(DecodeParams, q_pe) == 304 &&
                  offsetof(DecodeParams, q_pe_stride_h) == 328 && offsetof(DecodeParams, indices) == 336 &&
                  offsetof(DecodeParams, num_kv_tokens) == 352 && offsetof(DecodeParams, sparse_seqlen_q) == 368 &&
                  offsetof(DecodeParams, skip_combine) == 372,
              "DecodeParams layout changed");

// Fills the DERIVED fields from the ARG fields. The one place they are computed; safe on any input
// (num_heads_kv <= 0 gives ngroups 0), check_decode_params() refuses what makes no sense.
inline void derive_decode_params(DecodeParams& p) {
  p.ngroups = p.num_heads_kv > 0 ? p.num_heads_q / p.num_heads_kv : 0;
  p.q_rows = p.seqlen_q * p.ngroups;
  p.num_m_blocks = (p.q_rows + kBlockM - 1) / kBlockM;
  p.scale_log2 = p.scale * 1.4426950408889634f;
}

// Conventions every kernel and the Python reference share:
//  * a query row that sees no key at all (cache_seqlens == 0, or causal with fewer keys than s_q)
//    gets out = 0 and lse = +inf (the Python API's convention), never NaN;
//  * a split in which a row sees no key writes lse_accum = -inf and o_accum = 0;
//  * a request with exactly one split writes out/lse directly; the combine kernel skips it.
// csrc/common/device.cuh holds the device side of these rules (lengths, causal limit, output addressing,
// the no-key lse values) for every kernel.

}  // namespace flashmla_backend
