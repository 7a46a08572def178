// Launcher declarations: one per kernel family. Each launcher checks its arguments with
// check_decode_params() (common/check_params.h) and its launch, and throws std::runtime_error on
// failure. All launches are asynchronous on params.stream, allocate nothing and never synchronize the
// host, so they can be captured in CUDA graphs.
#pragma once

#include "params.h"

namespace flashmla_backend {

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
