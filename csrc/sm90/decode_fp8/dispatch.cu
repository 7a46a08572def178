// Variant switch of the sm90 FP8 tensor-core decode kernel. Includes no kernel code (cheap to compile).
#include <cstdlib>
#include <cstring>

#include "common/check.h"
#include "params.h"
#include "sm90/decode_fp8/decode.h"

namespace flashmla_backend {

// FLASHMLA_BACKEND_FP8_KERNEL chose between this kernel and one that widened e4m3 to fp16, which was removed. Values
// that ask for this kernel (unset, empty, 'auto', 'tensorcore') change nothing; any other ('widen') fails rather than
// run a kernel other than the one a script forced.
static void refuse_fp8_kernel_env() {
  const char* v = std::getenv("FLASHMLA_BACKEND_FP8_KERNEL");
  if (v == nullptr || v[0] == '\0' || std::strcmp(v, "auto") == 0 || std::strcmp(v, "tensorcore") == 0) return;
  FMLA_HOST_CHECK(false, "FLASHMLA_BACKEND_FP8_KERNEL is '"
                             << v << "', but the widening FP8 kernel was removed: the FP8 tensor-core kernel runs "
                                     "both modes (fast: e4m3 q; accurate: bf16/fp16 q). Unset "
                                     "FLASHMLA_BACKEND_FP8_KERNEL ('auto' and 'tensorcore' are accepted and change "
                                     "nothing)");
}

// FLASHMLA_BACKEND_FP8_DEBUG: measurement switches of the tensor-core kernel (DebugFlags in decode.h, bits); unset or
// 0 in normal use. Read once per call, here.
static int sm90_fp8_debug_flags() {
  const char* v = std::getenv("FLASHMLA_BACKEND_FP8_DEBUG");
  return v == nullptr ? 0 : std::atoi(v);
}

namespace sm90::decode_fp8 {
bool cluster_plan_applies(const DecodeParams& p) {
  if (p.num_m_blocks != 2) return false;
  // Tile m covers rows [64 m, 64 m + 64), row r is query token r / ngroups: both tiles see the same keys when no
  // causal limit differs between their rows.
  return !p.causal || p.seqlen_q == 1 || p.ngroups % (2 * kBlockM) == 0;
}
bool keys_on_m_applies(const DecodeParams& p) { return p.q_rows <= 32; }
// Measured on an H100 (docs/perf/journal.md, 2026-11-27): up to 16 rows the keys-on-M tile is faster at every batch
// (b = 1 to 128: 22.5 against 31 us at b = 1, 237 against 330 at b = 128); with 17..32 rows at b64 h_q 32 and b128
// s_q 2 h_q 16 (168 against 186 us, 294 against 336), but not at b = 1 (h_q 32: 42.5 against 34): one consumer
// warpgroup walks a split's few blocks one after the other, where the 64-row tile's two take two at a time. With
// 17..32 rows it is the default from kKeysOnM32MinRequests (request, KV head) pairs.
constexpr int kKeysOnM32MinRequests = 16;
bool keys_on_m_by_default(const DecodeParams& p) {
  return keys_on_m_applies(p) && (p.q_rows <= 16 || p.batch * p.num_heads_kv >= kKeysOnM32MinRequests);
}
// The fast mode's keys-on-M tile (one q term, P V on e4m3 tensor cores), measured on an H100 (docs/perf/journal.md,
// 2026-11-27) against the fast 64-row tile, h_q 16: faster with one (request, KV head) pair (b = 1: 16.4 / 18.0 / 25.8
// against 16.9 / 19.8 / 26.5 us at 4096 / 8192 / 32768 keys), slower from two on (b2 19.8 / 19.5, b4 26.8 / 25.4,
// b16 52.0 / 50.4, b128 239.9 / 230.5); at 17..32 rows it was slower at every batch (b = 1 h_q 32 23.6 against 21.6,
// b64 140.5 / 130.5), so it serves at most 16 rows.
bool fast_keys_on_m_applies(const DecodeParams& p) { return p.q_rows <= 16; }
bool fast_keys_on_m_by_default(const DecodeParams& p) {
  return fast_keys_on_m_applies(p) && p.batch * p.num_heads_kv == 1;
}
}  // namespace sm90::decode_fp8

// The accurate mode's keys-on-M tile for the shape's rows: R = 16 up to 16 rows a KV head, else R = 32.
template <sm90::decode_fp8::Variant kR16, sm90::decode_fp8::Variant kR32>
static void run_keys_on_m(const DecodeParams& params, int debug) {
  if (params.q_rows <= 16) {
    sm90::decode_fp8::run_decode_kernel<kR16>(params, debug);
  } else {
    sm90::decode_fp8::run_decode_kernel<kR32>(params, debug);
  }
}

void run_sm90_fp8_decode(const DecodeParams& params) {
  using sm90::decode_fp8::Variant;
  using sm90::decode_fp8::run_decode_kernel;
  refuse_fp8_kernel_env();
  const int debug = sm90_fp8_debug_flags();
  if (params.q_fp8) {
    // At most 16 rows a KV head may take the keys-on-M tile (fast_keys_on_m_by_default; the debug bit runs the other
    // tile).
    bool km = sm90::decode_fp8::fast_keys_on_m_by_default(params);
    if (sm90::decode_fp8::fast_keys_on_m_applies(params) && (debug & sm90::decode_fp8::kDebugFastKeysOnM)) km = !km;
    if (km) {
      run_decode_kernel<Variant::kFastKmR16>(params, debug);
      return;
    }
    // Up to two M tiles per (request, KV head): the plan with the deeper KV pipeline (launch.cuh: VariantTraits).
    bool stream = params.num_m_blocks <= 2;
    if (debug & sm90::decode_fp8::kDebugOtherFastPlan) stream = !stream;
    if (stream && (debug & sm90::decode_fp8::kDebugClusterPlan) && sm90::decode_fp8::cluster_plan_applies(params)) {
      run_decode_kernel<Variant::kFastE4m3QCluster>(params, debug);
    } else if (stream) {
      run_decode_kernel<Variant::kFastE4m3QStream>(params, debug);
    } else {
      run_decode_kernel<Variant::kFastE4m3Q>(params, debug);
    }
    return;
  }
  // The accurate mode: at most 32 query rows a KV head may take the keys-on-M tile (keys_on_m_by_default; the debug
  // bit runs the other tile).
  bool km = sm90::decode_fp8::keys_on_m_by_default(params);
  if (sm90::decode_fp8::keys_on_m_applies(params) && (debug & sm90::decode_fp8::kDebugOtherAccurateTile)) km = !km;
  switch (params.dtype) {
    case DType::kBF16:
      if (km) {
        run_keys_on_m<Variant::kAccurateKmBF16R16, Variant::kAccurateKmBF16R32>(params, debug);
      } else {
        run_decode_kernel<Variant::kAccurateBF16>(params, debug);
      }
      return;
    case DType::kFP16:
      if (km) {
        run_keys_on_m<Variant::kAccurateKmFP16R16, Variant::kAccurateKmFP16R32>(params, debug);
      } else {
        run_decode_kernel<Variant::kAccurateFP16>(params, debug);
      }
      return;
  }
  FMLA_HOST_CHECK(false, "sm90 FP8 decode: unsupported dtype " << int(params.dtype));
}

}  // namespace flashmla_backend
