// Launcher declarations of the sm90 FP8 tensor-core MLA decode kernel (e4m3 KV cache, both modes).
// Definitions: launch.cuh, instantiated per Variant in instantiations/; chosen by sm90/decode/dispatch.cu.
#pragma once

#include "params.h"

namespace flashmla_backend {

// Same contract as run_sm90_decode for a kv_format fp8_e4m3 cache: an e4m3 q runs the fast mode (bf16 out), a bf16 / fp16 q
// the accurate mode (out in q's dtype).
void run_sm90_fp8_decode(const DecodeParams& params);

namespace sm90::decode_fp8 {
enum class Variant {
  kFastE4m3Q,        // e4m3 q (one term), P one term, bf16 out; 2 KV stages, V^T rings 2 + 4 (FP8_DEBUG bit 4 only)
  kFastE4m3QStream,  // the same with 3 KV stages and V^T rings 2 + 2: the fast mode's default
  kFastE4m3QCluster, // kFastE4m3QStream as 2-CTA clusters over the two M tiles, sharing the V transposition
  kFastE4m3QMulticast,  // kFastE4m3QStream as 2-CTA clusters over pairs of M tiles, the KV blocks multicast
  kAccurateBF16, // bf16 q split in two e4m3 terms for Q K^T, P V in fp16 (traits.h: kPvF16), bf16 out
  kAccurateFP16, // fp16 q split in two e4m3 terms for Q K^T, P V in fp16, fp16 out
  // The accurate mode for at most 16 query rows a KV head (s_q h_q / h_kv): the keys-on-M tile (keys_on_m.h)
  kAccurateKmBF16R16,
  kAccurateKmFP16R16,
  // The fast mode's keys-on-M tile for at most 16 query rows a KV head (dispatch.cu: where it is the default)
  kFastKmR16,
  // 16-bit q with both e4m3 terms stacked in one Q tile of 32 query rows (traits.h: kStackedTerms), P V on fp16
  // tensor cores (the stacked tile's form past 32 rows: dispatch.cu); 3 KV stages, or 2 with two slots of the left
  // fp16 V half (launch.cuh)
  kAccurateStackedBF16,
  kAccurateStackedBF16Left2,
  kAccurateStackedFP16,
  kAccurateStackedFP16Left2,
  // The stacked Q tile with P V on e4m3 tensor cores, P in two e4m3 terms (traits.h: kPTerms2), V^T transposed as in
  // the fast mode; 3 KV stages, V^T rings 2 + 2: the stacked tile's form at up to 32 rows a KV head (dispatch.cu)
  kAccurateStackedP2BF16,
  kAccurateStackedP2FP16,
  // 16-bit q, the two-term 64-row tile with P V as O^T = V^T P^T, V widened in the consumers' registers (vregs.h)
  kAccurateVRegsBF16,
  kAccurateVRegsFP16,
  // e4m3 q, the 64-row tile with P V as O^T = V^T P^T on e4m3 wgmma, V's bytes permuted in the consumers' registers:
  // no V transposition (vregs.h)
  kFastVRegs,
};
// debug: FLASHMLA_BACKEND_FP8_DEBUG as dispatch.cu read it for this call (DebugFlags below; 0 in normal use).
template <Variant V>
void run_decode_kernel(const DecodeParams& params, int debug);

// Measurement switches (FLASHMLA_BACKEND_FP8_DEBUG): benchmarks/fp8_kernel_sweep.py times them side by side.
enum DebugFlags : int {
  kDebugNoTranspose = 1,       // the transposer waits and arrives but moves no data: wrong results, its time without it
  kDebugOtherFastPlan = 4,     // the fast mode runs its other pipeline plan (2 KV stages; dispatch.cu) (same results)
  kDebugClusterPlan = 8,       // two M tiles: the 2-CTA cluster plan that shares the V transposition (same results)
  kDebugOtherAccurateTile = 16,  // the accurate mode at <= 32 query rows a KV head: the other tile than the default
                                 // (at <= 16 rows the stacked Q tile for keys on M, at 17..32 the two-term 64-row tile
                                 // for the stacked one); the same results within the mode's error
  kDebugFastKeysOnM = 32,      // the fast mode at <= 16 query rows a KV head: the other tile than the default (keys on
                               // M, or the 64-row tile); the same results within the mode's error
  kDebugOtherL2Promotion = 64,  // the KV tensor map's other L2 promotion (launch.cuh: 128 bytes with one M tile or
                                // the multicast plan, none otherwise); the same results
  kDebugKmOtherOrder = 128,    // the keys-on-M tile's other step order (keys_on_m.h: kStepAhead); the same results
  kDebugStackedOtherPlan = 256,  // the fp16 P V stacked tile's other plan than the shape's (3 KV stages, or 2 with
                                 // two left fp16 V slots; dispatch.cu); the same results
  kDebugStackedManyRows = 512,   // the accurate mode past 32 query rows a KV head: the other tile than the default
                                 // (stacked Q tiles of 32 rows, or the two-term 64-row tile); the same results within
                                 // the mode's error
  kDebugVRegs = 1024,            // the 64-row tiles: the V-in-registers tile (vregs.h) instead of the one whose
                                 // producer widens V (accurate mode) or transposes it (fast mode, also in place of the
                                 // plans of bits 4 and 8); the same results within the mode's error (bit 1 does not
                                 // apply to it)
  kDebugMulticastKv = 8192,      // the fast mode with pairs of M tiles that see the same keys: 2-CTA clusters whose
                                 // KV blocks are TMA-multicast into both CTAs (same results; before bits 4 and 8)
  kDebugStackedOtherPv = 16384,  // the accurate mode where it runs the stacked Q tile: its other P V form than the
                                 // shape's (stacked_e4m3_pv_by_default: e4m3 P V with P in two e4m3 terms, or fp16
                                 // P V in the plan of bit 256); the same results within the mode's error
};
// Every bit above. Others mean nothing and are refused (dispatch.cu), so that a value naming a removed measurement
// (2048 and 4096 were two of them) is an error rather than a silent run of the default.
constexpr int kKnownDebugBits = kDebugNoTranspose | kDebugOtherFastPlan | kDebugClusterPlan | kDebugOtherAccurateTile |
                                kDebugFastKeysOnM | kDebugOtherL2Promotion | kDebugKmOtherOrder |
                                kDebugStackedOtherPlan | kDebugStackedManyRows | kDebugVRegs | kDebugMulticastKv |
                                kDebugStackedOtherPv;
// The bits the kernel reads itself (the rest choose a kernel or a plan on the host): compiled only into a measurement
// build (common/measure.h).
constexpr int kInKernelDebugBits = kDebugNoTranspose;
// The accurate mode's tiles (dispatch.cu): the keys-on-M tile serves at most 16 query rows a KV head (s_q h_q / h_kv),
// the stacked Q tile is the default at 17..32 rows (and at 33..64 with one (request, KV head) pair), with P V on e4m3
// tensor cores at up to 32 rows and on fp16 ones past that, and its fp16 P V form runs 3 KV stages from a batch's worth
// of pairs.
bool keys_on_m_applies(const DecodeParams& params);
bool stacked_terms_by_default(const DecodeParams& params);
bool stacked_e4m3_pv_by_default(const DecodeParams& params);
bool stacked_three_stages(const DecodeParams& params);
// The same for the fast mode, whose keys-on-M tile serves at most 16 rows.
bool fast_keys_on_m_applies(const DecodeParams& params);
bool fast_keys_on_m_by_default(const DecodeParams& params);
// Whether a shape can run the 2-CTA cluster plan: two M tiles whose rows see the same keys (one query token, or no
// causal limit, or each tile's rows within one query token), so that both CTAs of a cluster walk the same blocks.
bool cluster_plan_applies(const DecodeParams& params);
// Whether a shape can run the multicast plan: an even number of M tiles, tiles 2 k and 2 k + 1 seeing the same keys
// (one query token, or no causal limit, or each pair's rows within one query token).
bool paired_tiles_apply(const DecodeParams& params);
}  // namespace sm90::decode_fp8

}  // namespace flashmla_backend
