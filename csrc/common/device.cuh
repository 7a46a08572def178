// Device code every kernel of flashmla_backend shares: PTX helpers, the scheduler metadata row, the
// length and causal rules, output addressing and the empty-row rule. Include it from .cu / .cuh
// files only. Everything is __forceinline__. Every kernel uses it: the portable decode kernel, the
// combine kernels, the tile scheduler and the sm90 decode kernel (which keeps only its Q tile's
// cp.async with "memory" clobbers, see the NOTE at cp.async).
//
// Conventions (params.h): a query row r of kv head hk is query token s = r / ngroups and query head
// h = hk * ngroups + r % ngroups; lengths, token bounds and key indices are request-local.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "params.h"

namespace flashmla_backend {

// ================================================================================================
// PTX helpers
// ================================================================================================

// ---- Programmatic dependent launch (sm_90+; compiled out below sm_90) ----------------------------
// Both are no-ops when the grid was not launched with programmatic stream serialization.
// Blocks until the preceding grid on the stream has completed and its memory is visible.
__device__ __forceinline__ void pdl_wait_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the next grid on the stream (launched with PDL) get scheduled; its pdl_wait_primary() still
// waits for this whole grid.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---- cp.async (sm_80+) ----------------------------------------------------------------------------
// The asm statements carry no "memory" clobber: the compiler cannot see the shared-memory writes of
// a cp.async anyway, and the readers are ordered by cp_async_wait_* followed by a barrier
// (__syncthreads / a named barrier), which is what makes the data visible. NOTE: the sm90 kernel keeps
// its own cp_async_16 / commit / wait_all with a "memory" clobber (sm90/decode/copies.cuh): with these
// its instruction schedule changes (same registers), and that schedule has not been timed.
enum class L2Prefetch { kNone, k128B };  // .L2::128B: also fetch the rest of the 128-byte line into L2

// 16-byte cp.async.cg (cached in L2 only) to the shared-memory address smem_addr (a .shared window
// address, e.g. from __cvta_generic_to_shared). valid == false reads nothing (src-size 0) and writes 16
// zero bytes; gmem must still be a valid address (callers pass the tensor's base pointer).
template <L2Prefetch kPrefetch = L2Prefetch::kNone>
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  if constexpr (kPrefetch == L2Prefetch::k128B) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], %2, %3;\n" ::"r"(smem_addr), "l"(gmem), "n"(16),
                 "r"(src_bytes));
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_addr), "l"(gmem), "n"(16),
                 "r"(src_bytes));
  }
}
// Same, to a generic pointer into shared memory.
template <L2Prefetch kPrefetch = L2Prefetch::kNone>
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  cp_async_16<kPrefetch>(static_cast<uint32_t>(__cvta_generic_to_shared(smem)), gmem, valid);
}

// Closes the group of this thread's cp.async issued since the previous commit.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most N of this thread's committed groups are pending (N = 0: all committed groups).
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// Waits for every cp.async of this thread, committed or not (PTX: commit_group + wait_group 0).
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::); }

// ---- Math ------------------------------------------------------------------------------------------
constexpr float kLn2 = 0.69314718055994530942f;   // ln(2): lse = max_log2 * ln(2) + ln(sum)

// 2^x by the approximate unit, subnormal results flushed to zero; 2^-inf = +0. (exp2f without fast-math
// handles subnormals exactly and costs a few instructions more.)
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---- mbarrier (sm_90+) --------------------------------------------------------------------------------
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One try: true when phase `parity` of the mbarrier at shared address bar_addr has completed.
__device__ __forceinline__ bool mbarrier_try_wait(uint32_t bar_addr, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(bar_addr), "r"(parity)
      : "memory");
  return done != 0;
}

// One try that may suspend the thread for up to hint_ns nanoseconds while the phase is incomplete (the PTX operand
// suspendTimeHint), instead of the system's default limit, after which a waiting thread returns and retries: a warp
// that waits long then issues a few instructions per hint instead of a retry every ~100 cycles (docs/perf/journal.md,
// 2026-11-29: the sparse kernel's retries were a third of its issued instructions).
__device__ __forceinline__ bool mbarrier_try_wait_suspend(uint32_t bar_addr, uint32_t parity, uint32_t hint_ns) {
  uint32_t done;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(bar_addr), "r"(parity), "r"(hint_ns)
      : "memory");
  return done != 0;
}

// Struct for "no timeout action" in mbarrier_wait.
struct NoTimeoutAction {
  __device__ __forceinline__ void operator()() const {}
};

// Waits until phase `parity` of the mbarrier at bar_addr completed. kTimeoutNs > 0: a wait longer
// than that runs on_timeout() (e.g. a debug printf) and traps, so that a lost arrival is a launch
// error instead of a hung GPU; the clock is read only after the first try failed.
// hint_ns > 0: the retries after the first try suspend for up to that long (mbarrier_try_wait_suspend).
template <uint64_t kTimeoutNs, class OnTimeout = NoTimeoutAction>
__device__ __forceinline__ void mbarrier_wait(uint32_t bar_addr, uint32_t parity, OnTimeout on_timeout = {},
                                              uint32_t hint_ns = 0) {
  if (mbarrier_try_wait(bar_addr, parity)) return;
  const auto retry = [&]() {
    return hint_ns > 0 ? mbarrier_try_wait_suspend(bar_addr, parity, hint_ns) : mbarrier_try_wait(bar_addr, parity);
  };
  if constexpr (kTimeoutNs > 0) {
    const uint64_t t0 = global_timer_ns();
    while (!retry()) {
      if (global_timer_ns() - t0 > kTimeoutNs) {
        on_timeout();
        __trap();
      }
    }
  } else {
    while (!retry()) {
    }
  }
}

// ================================================================================================
// Scheduler metadata, lengths, causal limit
// ================================================================================================

// Row `part` of the tile-scheduler metadata (SchedMetaRow: begin_req .. end_req both inclusive,
// end_token exclusive; begin_req > end_req: the part has no work), with defensive clamps: a corrupt
// row cannot make a kernel index requests outside [0, batch) or split ids below the request's first.
// Only the five fields are read; pad is 0.
__device__ __forceinline__ SchedMetaRow load_sched_meta_row(const DecodeParams& p, int part) {
  const int32_t* row = p.sched_meta + static_cast<int64_t>(part) * kSchedMetaInts;
  SchedMetaRow m;
  m.begin_req = max(row[0], 0);
  m.begin_token = max(row[1], 0);
  m.end_req = min(row[2], p.batch - 1);
  m.end_token = row[3];
  m.begin_split = max(row[4], 0);
  m.pad[0] = m.pad[1] = m.pad[2] = 0;
  return m;
}

// Length of request i as the tile scheduler sees it: negative values count as 0. (The scheduler has no
// block table, so no upper clamp: the decode kernels cut every range to clamp_seqlen().)
__device__ __forceinline__ int scheduled_seqlen(const int32_t* seqlens, int i) {
  int v = seqlens[i];
  return v > 0 ? v : 0;
}

// A cache length as the decode kernels see it: clamped to [0, kPageSize * max_pages_per_seq], so that no
// key index leaves the block table.
__device__ __forceinline__ int clamp_seqlen(int raw, int max_pages_per_seq) {
  return min(max(raw, 0), kPageSize * max_pages_per_seq);
}

// One past the last key that query token s (0-based, of s_q) of a request with len keys sees when
// causal: keys [0, len - s_q + s]. May be <= 0 (the token sees no key).
__device__ __forceinline__ int causal_key_end(int len, int seqlen_q, int s) { return len - seqlen_q + s + 1; }


// ================================================================================================
// FP8 descales (params.h)
// ================================================================================================
// The descale of (request req, kv head hk): descale[req * stride_b + hk * stride_h] (element strides; a
// per-tensor scale has strides 0, 0). Only for a pointer the FP8 flags make non-null.
__device__ __forceinline__ float descale_q_at(const DecodeParams& p, int req, int hk) {
  return __ldg(p.descale_q + static_cast<int64_t>(req) * p.descale_q_stride_b +
               static_cast<int64_t>(hk) * p.descale_q_stride_h);
}
__device__ __forceinline__ float descale_k_at(const DecodeParams& p, int req, int hk) {
  return __ldg(p.descale_k + static_cast<int64_t>(req) * p.descale_k_stride_b +
               static_cast<int64_t>(hk) * p.descale_k_stride_h);
}

// ================================================================================================
// Output addressing
// ================================================================================================

// Query token and head of row r of kv head hk.
struct QueryRow {
  int s;  // query token, 0 .. s_q - 1
  int h;  // query head, 0 .. h_q - 1
};
__device__ __forceinline__ QueryRow query_row(const DecodeParams& p, int hk, int r) {
  QueryRow q;
  q.s = r / p.ngroups;
  q.h = hk * p.ngroups + r % p.ngroups;
  return q;
}

// Column 0 of out[req, s, h, :] (T: the element type).
template <typename T>
__device__ __forceinline__ T* out_row(const DecodeParams& p, int req, int s, int h) {
  return static_cast<T*>(p.out) + static_cast<int64_t>(req) * p.out_stride_b + static_cast<int64_t>(s) * p.out_stride_s +
         static_cast<int64_t>(h) * p.out_stride_h;
}

// &lse[req, h, s].
__device__ __forceinline__ float* lse_at(const DecodeParams& p, int req, int s, int h) {
  return p.lse + static_cast<int64_t>(req) * p.lse_stride_b + static_cast<int64_t>(h) * p.lse_stride_h + s;
}

// Row of (split sid, kv head hk, query row r) in the split accumulators: lse_accum[row], o_accum[row, :].
// Accumulator rows between one split and the next (same kv head and query row).
__device__ __forceinline__ int64_t accum_split_stride(const DecodeParams& p) {
  return static_cast<int64_t>(p.num_heads_kv) * p.q_rows;
}
__device__ __forceinline__ int64_t accum_row(const DecodeParams& p, int64_t sid, int hk, int r) {
  return sid * accum_split_stride(p) + static_cast<int64_t>(hk) * p.q_rows + r;
}
__device__ __forceinline__ float* o_accum_row(const DecodeParams& p, int64_t row) { return p.o_accum + row * kHeadDimV; }
__device__ __forceinline__ float* lse_accum_at(const DecodeParams& p, int64_t row) { return p.lse_accum + row; }

// ================================================================================================
// The empty-row rule (params.h)
// ================================================================================================
// A row that sees no key (cache_seqlens == 0, or causal with fewer keys than s_q) gets out = 0 and
// lse = +inf, never NaN; a split in which a row sees no key gets o_accum = 0 and lse_accum = -inf, so
// that the combine gives it weight exp(-inf - lse) = 0. The combine writes out = 0, lse = +inf for a
// row whose splits all have lse_accum = -inf.
// A row whose scores are NaN (NaN in q) is not such a row: the running max skips NaN (fmaxf) and stays
// -inf, but the row sum is NaN, so the decision is taken on the sum (row_has_key) and the row gets NaN
// out and lse, as in the reference; the combine propagates a NaN lse_accum (nan_max).
constexpr float kNoKeyLse = INFINITY;
constexpr float kNoKeySplitLse = -INFINITY;

// Whether a row saw a key, from its final row sum: 0 exactly when every score was masked (the sum of
// 2^-inf terms), >= 1 otherwise (the max term is 2^0), NaN when its scores were NaN (counted as seen).
__device__ __forceinline__ bool row_has_key(float row_sum) { return !(row_sum <= 0.f); }

// max(a, b) that returns NaN when either is NaN (fmaxf returns the other operand): the combine's max
// over the splits' lse, so that a NaN split makes the row NaN instead of vanishing.
__device__ __forceinline__ float nan_max(float a, float b) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

// lse (natural log) of a row that saw at least one key, from its running max in log2 units and its
// row sum (>= 1: the max term is 2^0). Rows without a key take kNoKeyLse / kNoKeySplitLse instead.
__device__ __forceinline__ float row_lse(float max_log2, float sum) { return max_log2 * kLn2 + logf(sum); }

}  // namespace flashmla_backend
