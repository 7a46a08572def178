// The one host/device contract of flashmla_backend.
//
// Plain C++ (no torch, no pybind11): the binding fills these structs from integers that the Python
// layer extracted from torch tensors after validating them, and the launchers read them.
// All strides count ELEMENTS, not bytes. The innermost dimension of every tensor is contiguous.
#pragma once

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
  void* stream;             // cudaStream_t
};

// ---- Decode (split-KV) + combine ------------------------------------------------------------------
enum class DType : int { kBF16 = 0, kFP16 = 1 };

struct DecodeParams {
  DType dtype;
  int device;               // CUDA device ordinal the pointers live on

  int batch;                // b
  int seqlen_q;             // s_q (query tokens per request)
  int num_heads_q;          // h_q
  int num_heads_kv;         // h_kv (divides h_q)
  int ngroups;              // h_q / h_kv
  int q_rows;               // s_q * ngroups: query rows per (request, kv head); row r <-> (s = r / ngroups,
                            // head = kv_head * ngroups + r % ngroups)
  int num_m_blocks;         // ceil(q_rows / kBlockM)
  int num_sm_parts;         // rows of the scheduler metadata (grid.z of the decode kernel)

  int num_pages;            // k_cache.shape[0]
  int max_pages_per_seq;    // block_table.shape[1]

  float scale;              // softmax scale (natural-log domain)
  float scale_log2;         // scale * log2(e)
  bool causal;              // query token s of a request with n keys sees keys [0, n - s_q + s]

  // q [b, s_q, h_q, 576]
  const void* q;
  int64_t q_stride_b, q_stride_s, q_stride_h;
  // k_cache [num_pages, kPageSize, h_kv, 576]
  const void* kv;
  int64_t kv_stride_page, kv_stride_token, kv_stride_h;
  // block_table [b, max_pages_per_seq] int32, page ids
  const int32_t* block_table;
  int64_t block_table_stride_b;
  // cache_seqlens [b] int32. The kernels clamp each length to [0, kPageSize * max_pages_per_seq]
  // so that no read leaves the block table; the opt-in checked mode in Python raises instead.
  const int32_t* seqlens;
  // scheduler output
  const int32_t* sched_meta;  // [num_sm_parts, 8]
  const int32_t* num_splits;  // [b + 1]

  // out [b, s_q, h_q, 512], q's dtype
  void* out;
  int64_t out_stride_b, out_stride_s, out_stride_h;
  // lse [b, h_q, s_q] fp32, natural log; innermost (s_q) stride 1
  float* lse;
  int64_t lse_stride_b, lse_stride_h;

  // Split accumulators, contiguous, indexed by global split id sid = num_splits[req] + split_index:
  //   lse_accum [b + num_sm_parts, h_kv, q_rows]        fp32, natural log, -inf for "no keys in split"
  //   o_accum   [b + num_sm_parts, h_kv, q_rows, 512]   fp32, already divided by the split's row sum
  // (b + num_sm_parts bounds the number of splits: every part boundary adds at most one.)
  float* lse_accum;
  float* o_accum;

  void* stream;             // cudaStream_t
  bool pdl;                 // launch combine with programmatic dependent launch (sm_90+)
};

// Conventions every kernel and the Python reference share:
//  * a query row that sees no key at all (cache_seqlens == 0, or causal with fewer keys than s_q)
//    gets out = 0 and lse = +inf (FlashMLA's convention), never NaN;
//  * a split in which a row sees no key writes lse_accum = -inf and o_accum = 0;
//  * a request with exactly one split writes out/lse directly; the combine kernel skips it.

}  // namespace flashmla_backend
