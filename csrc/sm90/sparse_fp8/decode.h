// Launcher declaration of the sm90 sparse (DeepSeek-V3.2) decode kernel on fp8_ds_mla caches (kernel.cuh);
// definition in sparse.cu, called by the binding when DecodeParams::indices is set (params.h: the sparse mapping).
#pragma once

#include "params.h"

namespace flashmla_backend {

// Same contract as run_sm90_decode (asynchronous on params.stream, no allocation, capturable), for params.h's sparse
// mapping: bf16 q and out, kv the fp8_ds_mla tokens, num_heads_kv 1, seqlen_q 1, not causal.
void run_sm90_sparse_decode(const DecodeParams& params);

}  // namespace flashmla_backend
