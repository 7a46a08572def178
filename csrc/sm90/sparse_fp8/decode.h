// Launcher declaration of the sm90 sparse (DeepSeek-V3.2) decode kernel on fp8_ds_mla caches (kernel.cuh);
// definition in sparse.cu, called by the binding when DecodeParams::indices is set (params.h: the sparse mapping).
#pragma once

#include <cstdint>
#include <vector>

#include "params.h"

namespace flashmla_backend {

// Same contract as run_sm90_decode (asynchronous on params.stream, no allocation, capturable), for params.h's sparse
// mapping: bf16 q and out, kv the fp8_ds_mla tokens, num_heads_kv 1, seqlen_q 1, not causal.
void run_sm90_sparse_decode(const DecodeParams& params);

// The timeline of the kernel's last launch in a timeline build (-DFMLA_SPARSE_TIMELINE; sm90/sparse_fp8/timeline.cuh
// says what is recorded): synchronizes the device, copies the records and clears the counts; false (nothing read) in
// other builds. words: [max_ctas][roles][events], counts: [max_ctas][roles], ns: [max_ctas][3].
struct SparseTimeline {
  int max_ctas = 0, roles = 0, events = 0;
  std::vector<uint32_t> words, counts;
  std::vector<unsigned long long> ns;
};
bool read_sm90_sparse_timeline(SparseTimeline& t);

}  // namespace flashmla_backend
