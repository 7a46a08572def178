// Variant switch of the sm90 FP8 tensor-core decode kernel. Includes no kernel code (cheap to compile).
#include <cstdlib>
#include <cstring>

#include "common/check.h"
#include "common/measure.h"
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
// The bits the kernel itself reads exist only in a measurement build (common/measure.h); elsewhere they are refused.
static int sm90_fp8_debug_flags() {
  const char* v = std::getenv("FLASHMLA_BACKEND_FP8_DEBUG");
  const int debug = v == nullptr ? 0 : std::atoi(v);
  const int unknown = debug & ~sm90::decode_fp8::kKnownDebugBits;
  FMLA_HOST_CHECK(unknown == 0, "FLASHMLA_BACKEND_FP8_DEBUG=" << debug << " sets bit(s) " << unknown
                                    << ", which select nothing (the measurement switches are the bits of DebugFlags "
                                       "in csrc/sm90/decode_fp8/decode.h); clear them");
  const int in_kernel = debug & sm90::decode_fp8::kInKernelDebugBits;
  FMLA_HOST_CHECK(kMeasureBuild || in_kernel == 0,
                  "FLASHMLA_BACKEND_FP8_DEBUG=" << debug << " sets bit(s) " << in_kernel
                                                << ", which the kernel reads itself and this build compiled out; "
                                                   "configure the build with FLASHMLA_BACKEND_MEASURE=1 to measure "
                                                   "them (docs/build.md), or clear them");
  return debug;
}

namespace sm90::decode_fp8 {
bool paired_tiles_apply(const DecodeParams& p) {
  if (p.num_m_blocks % 2 != 0) return false;
  // Tile m covers rows [64 m, 64 m + 64), row r is query token r / ngroups, so pair k holds rows [128 k, 128 k + 128):
  // both tiles of a pair see the same keys when no causal limit differs between their rows, i.e. within one query
  // token when ngroups is a multiple of 128.
  return !p.causal || p.seqlen_q == 1 || p.ngroups % (2 * kBlockM) == 0;
}
bool cluster_plan_applies(const DecodeParams& p) { return p.num_m_blocks == 2 && paired_tiles_apply(p); }
// The accurate mode's tiles by query rows a KV head (s_q h_q / h_kv), measured on an H100 (docs/perf/journal.md,
// 2026-11-27): up to 16 rows the keys-on-M tile (keys_on_m.h) is faster than the 64-row tile at every batch (b = 1 h_q
// 16: 22.5 against 31 us, b128: 237 against 330) and than the stacked Q tile from 4 (request, KV head) pairs (b4 28.1
// against 33.9, b128 229.7 against 256.4; at b1 / b2 the stacked tile was 3% faster: 18.9 / 19.5, 21.1 / 22.2). With
// 17..32 rows the stacked Q tile (traits.h: kStackedTerms) is faster than both others at every batch measured (h_q
// 32, b1 21.5 against the 64-row tile's 24.4, b4 36.1 / 41.7, b16 60.9 against keys-on-M's 70.9, b64 147-150 /
// 160, b128 s_q 2 h_q 16 262 / 284). Past 32 rows the two-term 64-row tile, but for one (request, KV head) pair with
// at most 64 rows, where two stacked tiles take a split's blocks with one Q K^T product each (b = 1 h_q 64: 23.7
// against 29.3 us; from b2 on, and at b = 1 h_q 128, the stacked tiles were slower: b2 h_q 64 39.6 / 35.9, b128 490 /
// 337, b = 1 h_q 128 38.6 / 35.2).
bool keys_on_m_applies(const DecodeParams& p) { return p.q_rows <= 16; }
bool stacked_terms_by_default(const DecodeParams& p) {
  return (p.q_rows > 16 && p.q_rows <= 32) || (p.q_rows <= 64 && p.batch * p.num_heads_kv == 1 && p.q_rows > 32);
}
// The stacked tile's P V: on e4m3 tensor cores with P in two e4m3 terms (traits.h: kPTerms2; one plan) at up to 32
// rows, where the fp16 P V form was slower on an H200 (docs/perf/journal.md, 2026-11-30; us, e4m3 P V / fp16 P V):
// h_q 32 b64 118-121 / 135-137, b32 s_k 16384 125 / 140-142, the varlen-4096 b128 batch 140-142 / 153-155, b128 s_q 2
// h_q 16 209-218 / 243-260, b1 21.1-21.8 / 21.2-21.9; on fp16 tensor cores past 32 rows (one pair: b1 h_q 64, two
// stacked tiles, 22.4 against 24.5).
bool stacked_e4m3_pv_by_default(const DecodeParams& p) { return p.q_rows <= 32; }
// The fp16 P V stacked tile's plans: 3 KV stages from kStackedThreeStagesMinPairs (request, KV head) pairs (h_q 32:
// b8 45.1 against 46.7 us, b64 147-150 / 157-160), 2 stages with two slots of the left fp16 V half below (b2 25.4 /
// 26.4, b4 36.1 / 39.0).
constexpr int kStackedThreeStagesMinPairs = 8;
bool stacked_three_stages(const DecodeParams& p) {
  return p.batch * p.num_heads_kv >= kStackedThreeStagesMinPairs;
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

// The accurate mode's tile for one q dtype: keys on M (R = 16), the stacked Q tile in its two plans, or the two-term
// 64-row tile. FLASHMLA_BACKEND_FP8_DEBUG: bit 16 runs the other tile at <= 32 rows (keys on M <-> stacked up to 16
// rows, stacked <-> the 64-row tile at 17..32), bit 512 past 32 rows (stacked <-> the 64-row tile), bit 16384 the
// stacked tile's other P V form than the shape's (stacked_e4m3_pv_by_default), bit 256 the fp16 P V form's other
// plan, bit 1024 the V-in-registers tile for the two-term 64-row one.
template <sm90::decode_fp8::Variant kKeysOnM, sm90::decode_fp8::Variant kStacked,
          sm90::decode_fp8::Variant kStackedLeft2, sm90::decode_fp8::Variant kStackedP2,
          sm90::decode_fp8::Variant kTwoTerms, sm90::decode_fp8::Variant kVRegs>
static void run_accurate(const DecodeParams& params, int debug) {
  namespace d = sm90::decode_fp8;
  const bool other = debug & (params.q_rows <= 32 ? d::kDebugOtherAccurateTile : d::kDebugStackedManyRows);
  const bool stacked = d::stacked_terms_by_default(params) != other;
  if (stacked) {
    if (d::stacked_e4m3_pv_by_default(params) != bool(debug & d::kDebugStackedOtherPv)) {
      d::run_decode_kernel<kStackedP2>(params, debug);
    } else if (d::stacked_three_stages(params) != bool(debug & d::kDebugStackedOtherPlan)) {
      d::run_decode_kernel<kStacked>(params, debug);
    } else {
      d::run_decode_kernel<kStackedLeft2>(params, debug);
    }
  } else if (d::keys_on_m_applies(params)) {
    d::run_decode_kernel<kKeysOnM>(params, debug);
  } else if (debug & d::kDebugVRegs) {
    d::run_decode_kernel<kVRegs>(params, debug);
  } else {
    d::run_decode_kernel<kTwoTerms>(params, debug);
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
    // Bit 1024: the V-in-registers tile (vregs.h), no transposition (slower at every shape measured: vregs.h).
    if (debug & sm90::decode_fp8::kDebugVRegs) {
      run_decode_kernel<Variant::kFastVRegs>(params, debug);
      return;
    }
    // The plan with the deeper KV pipeline (launch.cuh: VariantTraits) at every M-tile count: on an H200, without
    // in-kernel switches, it was also 2% faster at four M tiles (b128-sk8192-h128-s_q 2, alternating processes: median
    // 646 against 658 us; b64 and sk4096 the same way), where an H100 A/B had once put the other plan 1% ahead.
    if ((debug & sm90::decode_fp8::kDebugMulticastKv) && sm90::decode_fp8::paired_tiles_apply(params)) {
      run_decode_kernel<Variant::kFastE4m3QMulticast>(params, debug);
      return;
    }
    bool stream = true;
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
  switch (params.dtype) {
    case DType::kBF16:
      run_accurate<Variant::kAccurateKmBF16R16, Variant::kAccurateStackedBF16, Variant::kAccurateStackedBF16Left2,
                   Variant::kAccurateStackedP2BF16, Variant::kAccurateBF16, Variant::kAccurateVRegsBF16>(params,
                                                                                                          debug);
      return;
    case DType::kFP16:
      run_accurate<Variant::kAccurateKmFP16R16, Variant::kAccurateStackedFP16, Variant::kAccurateStackedFP16Left2,
                   Variant::kAccurateStackedP2FP16, Variant::kAccurateFP16, Variant::kAccurateVRegsFP16>(params,
                                                                                                          debug);
      return;
  }
  FMLA_HOST_CHECK(false, "sm90 FP8 decode: unsupported dtype " << int(params.dtype));
}

}  // namespace flashmla_backend
