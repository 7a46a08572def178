// The sm90 sparse (DeepSeek-V3.2) decode kernel's launcher: its argument checks and its launch on the decode grid.
#include <cuda_runtime.h>

#include <cstdlib>

#include "common/check.h"
#include "common/check_params.h"
#include "common/measure.h"
#include "launch.h"
#include "params.h"
#include "sm90/sparse_fp8/decode.h"
#include "sm90/sparse_fp8/kernel.cuh"

namespace flashmla_backend {

// FLASHMLA_BACKEND_SPARSE_DEBUG: measurement switches of the kernel (common.cuh: DebugFlags, bits); unset or 0 for
// normal use. Read at every launch (a captured graph keeps the value of its capture). The kernel reads every bit
// itself, so they exist only in a measurement build (common/measure.h); elsewhere they are refused.
static int sparse_debug_flags() {
  const char* v = std::getenv("FLASHMLA_BACKEND_SPARSE_DEBUG");
  const int debug = v != nullptr ? std::atoi(v) : 0;
  FMLA_HOST_CHECK(kMeasureBuild || debug == 0,
                  "FLASHMLA_BACKEND_SPARSE_DEBUG=" << debug
                                                   << ": the sparse kernel's measurement switches are compiled out of "
                                                      "this build; configure it with FLASHMLA_BACKEND_MEASURE=1 to "
                                                      "measure them (docs/build.md), or unset the variable");
  return debug;
}

void run_sm90_sparse_decode(const DecodeParams& p) {
  using namespace sm90::sparse_fp8;
  DecodeRequirements r;
  r.kernel = "sm90 sparse decode";
  r.formats = kSm90SparseFormats;
  r.q = AccessRule{16, 8, true};   // 16-byte loads of bf16 q rows
  r.out = AccessRule{8, 4, true};  // four bf16 a store
  r.o_accum = AccessRule{16, 1, false};
  check_decode_params(p, r);
  FMLA_HOST_CHECK(p.indices != nullptr, r.kernel << ": indices must be set");
  FMLA_HOST_CHECK(p.dtype == DType::kBF16 && !p.q_fp8,
                  r.kernel << ": reads a bf16 q and writes bf16 (dtype 0, q_fp8 unset)");
  FMLA_HOST_CHECK(p.num_heads_kv == 1 && p.seqlen_q == 1 && !p.causal,
                  r.kernel << ": one query token a row, one KV head, not causal (params.h: the sparse mapping), got "
                              "seqlen_q "
                           << p.seqlen_q << ", num_heads_kv " << p.num_heads_kv << ", causal " << p.causal);
  FMLA_HOST_CHECK(p.num_kv_tokens >= 0 && p.indices_stride >= 0,
                  r.kernel << ": num_kv_tokens and indices_stride must be >= 0 (got " << p.num_kv_tokens << ", "
                           << p.indices_stride << ")");
  FMLA_HOST_CHECK(
      reinterpret_cast<std::uintptr_t>(p.kv) % 16 == 0 && reinterpret_cast<std::uintptr_t>(p.q_pe) % 16 == 0,
      r.kernel << ": kv and q_pe must be 16-byte aligned");
  const int debug = sparse_debug_flags();
  auto* kernel = &sm90_sparse_fp8_decode_kernel;
  const int smem = kSmemBytes;
  FMLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaLaunchAttribute attrs[1];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = p.pdl ? 1 : 0;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(p.num_m_blocks, 1, p.num_sm_parts);
  cfg.blockDim = dim3(kNumThreads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = static_cast<cudaStream_t>(p.stream);
  cfg.attrs = attrs;
  cfg.numAttrs = 1;
  FMLA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, debug));
  FMLA_CHECK_LAUNCH("sm90_sparse_fp8_decode_kernel");
}

bool read_sm90_sparse_timeline(SparseTimeline& t) {
#if defined(FMLA_SPARSE_TIMELINE)
  using namespace sm90::sparse_fp8;
  t.max_ctas = kTlMaxCtas;
  t.roles = kTlRoles;
  t.events = kTlEvents;
  t.words.resize(size_t(kTlMaxCtas) * kTlRoles * kTlEvents);
  t.counts.resize(size_t(kTlMaxCtas) * kTlRoles);
  t.ns.resize(size_t(kTlMaxCtas) * 3);
  FMLA_CUDA_CHECK(cudaDeviceSynchronize());
  FMLA_CUDA_CHECK(cudaMemcpyFromSymbol(t.words.data(), g_tl_events, t.words.size() * sizeof(uint32_t)));
  FMLA_CUDA_CHECK(cudaMemcpyFromSymbol(t.counts.data(), g_tl_count, t.counts.size() * sizeof(uint32_t)));
  FMLA_CUDA_CHECK(cudaMemcpyFromSymbol(t.ns.data(), g_tl_ns, t.ns.size() * sizeof(unsigned long long)));
  const std::vector<uint32_t> zero(t.counts.size(), 0u);
  FMLA_CUDA_CHECK(cudaMemcpyToSymbol(g_tl_count, zero.data(), zero.size() * sizeof(uint32_t)));
  return true;
#else
  (void)t;
  return false;
#endif
}

}  // namespace flashmla_backend
