// Launcher declarations: one per kernel family. Each launcher checks its arguments with
// check_decode_params() (common/check_params.h) and its launch, and throws std::runtime_error on
// failure. All launches are asynchronous on params.stream, allocate nothing and never synchronize the
// host, so they can be captured in CUDA graphs.
#pragma once

#include "params.h"

namespace flashmla_backend {

// The KV formats each compiled kernel reads (params.h: KvFormat), in dense decode (block_table) and in sparse decode
// (indices). flashmla_backend/kv_format.py states the same in Python (dense_kernels / sparse_kernels of each
// format); the binding reports these (_C.kernel_kv_formats()) and tests/test_build.py compares the two.
constexpr uint32_t kSixteenBitFormats = kv_format_bit(KvFormat::kBF16) | kv_format_bit(KvFormat::kFP16);
constexpr uint32_t kPortableDenseFormats = kSixteenBitFormats;
constexpr uint32_t kSm90DenseFormats = kSixteenBitFormats | kv_format_bit(KvFormat::kFP8E4M3);
constexpr uint32_t kSm90SparseFormats = kv_format_bit(KvFormat::kFP8DsMla);

// csrc/smxx/tile_scheduler.cu: fills metadata [num_sm_parts, 8] and num_splits [batch + 1].
void run_tile_scheduler(const SchedParams& params);

// csrc/portable/: split-KV decode with mma.sync + cp.async (sm_80 and newer). Dispatches on dtype.
void run_portable_decode(const DecodeParams& params);
// Dynamic shared memory one CTA of the portable decode kernel needs (bytes).
int portable_decode_smem_bytes();

// csrc/sm90/decode/ (sm_90a builds only; FLASHMLA_BACKEND_WITH_SM90): run_sm90_decode and
// sm90_decode_smem_bytes are declared in sm90/decode/decode.h, same contract as run_portable_decode.

// csrc/smxx/combine.cu: merges splits of requests with num_splits[i+1] - num_splits[i] > 1.
// Must be launched right after the decode kernel on the same stream (PDL when params.pdl).
void run_combine(const DecodeParams& params);

}  // namespace flashmla_backend
