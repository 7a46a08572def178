// The sparse decode kernel's timeline build (-DFMLA_SPARSE_TIMELINE, given through FLASHMLA_BACKEND_NVCC_FLAGS:
// docs/build.md): one thread of each role records the SM clock at the events of its loop (the codes below) in device
// globals, which flashmla_backend._ext.ext().sparse_timeline() returns after a launch (benchmarks/sparse_timeline.py
// prints them). A measurement tool only: the clock reads and stores change the timing a little, and the default build
// has none of it (FMLA_TL expands to nothing; the shared-memory plan and the SASS are the default's). Device printf was
// the first form: its call made ptxas serialize every wgmma of the kernel (C7510, a call crossing the wgmma pipeline).
#pragma once

#include <cstdint>

#include "common/device.cuh"

namespace flashmla_backend::sm90::sparse_fp8 {

// Roles, and the events each records.
enum TlRole : int { kTlLead = 0, kTlFollow = 1, kTlGather = 2, kTlTranspose = 3, kTlRoles = 4 };
enum TlCode : int {
  kTlStart = 0,        // (every role) after the barrier initialization
  kTlFirstQ = 1,       // lead / follower: the first Q tile loaded and split
  kTlFull = 2,         // lead: a block's stage landed (its wait done)
  kTlQk = 3,           // lead: a block's Q K^T done (all groups folded)
  kTlPHanded = 4,      // lead: P of a block handed to the follower
  kTlVt0 = 5,          // lead / follower: V^T half 0 and the factors of a block ready
  kTlPv0Done = 6,      // lead: a row piece's last P V of group 0 waited for
  kTlEpilogue = 7,     // lead / follower: a row piece's stores issued
  kTlNextQ = 8,        // lead: the next row piece's Q tile split
  kTlQCopied = 9,      // lead: the next row piece's Q tile copied (this thread's copies, before its split)
  kTlQSplit = 13,      // lead: this thread's slots of the next Q tile split (before the warpgroup's barrier)
  kTlFirstQLoaded = 14,  // lead: this thread's slot of the first Q tile loaded (before its split)
  kTlPairIssued = 15,  // lead: the next block's first two group products issued (early or late)
  kTlSoftmax = 16,     // lead: a block's softmax done (before its P hand-off)
  kTlWords = 17,       // lead: a block's words of group 0 built
  kTlFold01 = 18,      // lead: the next block's groups 0 and 1 folded
  kTlPFull = 10,       // follower: a block's P arrived
  kTlQkIssued = 11,    // follower: the lead's next tensor work issued (its wait done)
  kTlBlockDone = 12,   // follower: group 3's P V of a block done
  kTlStageFree = 20,   // gather: a stage free (its wait done)
  kTlCopies = 21,      // gather: a block's copies issued
  kTlTFull = 30,       // transposer: a block's stage landed
  kTlFactors = 31,     // transposer: the block's group factors written
  kTlHalf = 32,        // transposer: a V^T half written
  kTlEnd = 99,         // (every role) its loop done
};

#if defined(FMLA_SPARSE_TIMELINE)
constexpr int kTlEvents = 256;   // a role's events a CTA (the later ones dropped)
constexpr int kTlMaxCtas = 512;  // CTAs recorded (blockIdx.z * gridDim.x + blockIdx.x below this)

// Device globals, read by sparse_timeline() (sparse.cu) after a launch: event i of role r of CTA c is
// g_tl_events[c][r][i] = code << 24 | SM cycles since the CTA's start; g_tl_count[c][r] its events (0 for a CTA that
// had no work); g_tl_ns[c] = {global timer at the CTA's start, at the lead's end, at the follower's end}.
__device__ uint32_t g_tl_events[kTlMaxCtas][kTlRoles][kTlEvents];
__device__ uint32_t g_tl_count[kTlMaxCtas][kTlRoles];
__device__ unsigned long long g_tl_ns[kTlMaxCtas][3];

struct Timeline {  // in the kernel's shared memory
  long long start;  // clock64 at the CTA's start
  uint32_t n[kTlRoles];
};

__device__ __forceinline__ int tl_cta() { return int(blockIdx.z * gridDim.x + blockIdx.x); }

__device__ __forceinline__ void tl_init(Timeline& tl, long long start, unsigned long long start_ns) {
  tl.start = start;
  for (int r = 0; r < kTlRoles; ++r) tl.n[r] = 0;
  if (tl_cta() < kTlMaxCtas) g_tl_ns[tl_cta()][0] = start_ns;
}

__device__ __forceinline__ void tl_mark(Timeline& tl, int role, int code) {
  const uint32_t i = tl.n[role];
  const int c = tl_cta();
  if (i < uint32_t(kTlEvents) && c < kTlMaxCtas) {
    g_tl_events[c][role][i] = uint32_t(code) << 24 | (uint32_t(clock64() - tl.start) & 0xffffffu);
    tl.n[role] = i + 1;
  }
}

__device__ __forceinline__ void tl_finish(Timeline& tl, int role) {
  tl_mark(tl, role, kTlEnd);
  const int c = tl_cta();
  if (c >= kTlMaxCtas) return;
  g_tl_count[c][role] = tl.n[role];
  if (role == kTlLead || role == kTlFollow) g_tl_ns[c][1 + role] = global_timer_ns();
}

#define FMLA_TL(ss, role, code, cond)                                             \
  do {                                                                            \
    if (cond) ::flashmla_backend::sm90::sparse_fp8::tl_mark((ss).tl, role, code); \
  } while (0)
#define FMLA_TL_FINISH(ss, role, cond)                                        \
  do {                                                                        \
    if (cond) ::flashmla_backend::sm90::sparse_fp8::tl_finish((ss).tl, role); \
  } while (0)
#else
#define FMLA_TL(ss, role, code, cond) \
  do {                                \
  } while (0)
#define FMLA_TL_FINISH(ss, role, cond) \
  do {                                 \
  } while (0)
#endif

}  // namespace flashmla_backend::sm90::sparse_fp8
