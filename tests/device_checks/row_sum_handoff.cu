// Does compute-sanitizer racecheck understand the barriers that order the row-sum exchange of the sm90 kernels?
//
// In both sm90 decode kernels racecheck reports a Write in publish_row_sums (csrc/sm90/decode/softmax.cuh: the
// lanes with lane % 4 == 0 write row_sum[wg][row]) against a Read in final_row_stats (every thread reads
// row_sum[0][row] + row_sum[1][row] and row_max[row]). In the kernels a barrier of all consumer threads orders the
// reads after the writes, and another one the next request's writes after the reads. This probe runs that exchange
// alone, one mode per suspect, so that racecheck's verdict on each can be read off:
//
//   syncthreads      (a) the 16-bit kernel (csrc/sm90/decode/kernel.cuh, request loop): 256 threads, per request:
//                    row_max written, __syncthreads, quad-lane writes of row_sum[wg][row], __syncthreads, every
//                    thread reads both halves and row_max, __syncthreads.
//   named            (b) the FP8 kernel (csrc/sm90/decode_fp8/kernel.cuh, consumer_loop): 384 threads; warpgroups
//                    0 and 1 each run their own copy of the loop (a template per warpgroup, so they reach the
//                    barriers at different instructions) and order it with the non-aligned `barrier.sync 11, 256`;
//                    warpgroup 2 runs a loop of its own (global memory only) and never joins barrier 11.
//   syncthreads-pdl  (c) (a) / (b) with programmatic dependent launch as the kernels use it: griddepcontrol.wait
//   named-pdl        at kernel start, griddepcontrol.launch_dependents after the last request's writes and the
//                    barrier after them but before the reads; both launches with cudaLaunchKernelEx and
//                    programmaticStreamSerializationAllowed = 1, so the second may start while the first reads.
//   syncthreads-arrive  (a) / (b) with a hand-off of the kind the kernels' main loops use between the first barrier
//   named-arrive        and the writes (bar.arrive by one warpgroup, bar.sync by the other: the pattern of
//                    named_barrier_war.cu): whether the tool's handling of those barriers spills onto this exchange.
//   syncthreads-steps   (a) / (b) with the main loops' whole hand-off, kSteps times a request before the writes:
//   named-steps         three barriers a step in both directions, as the kernels' steps use them (warpgroup 0
//                    writes scale0 and arrives on barrier 8, warpgroup 1 syncs on it, reads scale0, writes scale1 and
//                    arrives on 9; warpgroup 0 syncs on 9, reads scale1, writes P0 and arrives on 10; warpgroup 1 syncs
//                    on 10 and reads P0), every value read checked on the device. In both kernels every row_sum and
//                    row_max report pairs an access of warpgroup 1 with a later one of warpgroup 0 across the barrier
//                    of all consumers (journal, 2026-12-01): if these modes get such hazards, the last arrival before
//                    the barrier being warpgroup 1's bar.arrive is what the tool misreads.
//   named-steps-mbar    named-steps with, at each step's start, a ring of two mbarrier slots that the producer
//                    warpgroup fills (writes a value, one arrival a warp on full) and both consumer warpgroups read
//                    (wait on full, check the value, one arrival a warp on empty), as the kernels' consumers wait for
//                    the producer's stages and V^T halves: mbarrier waits are the next suspect if the -steps modes
//                    show no row_sum hazard.
//   race             control: (a) without the __syncthreads between the writes and the reads, a real race between
//                    the same two accesses. It shows what a true report looks like, and that racecheck sees these
//                    accesses at all. Its values are printed but not checked (a race may leave them right or wrong).
//
// Every mode launches its kernel twice back to back (seeds 1 and 2, same output buffers; main checks the second
// launch's values), 4 requests per CTA, one CTA per SM on every SM (128 KB of dynamic shared memory each, so no
// two fit on one SM), like the kernels' grids. Only the -pdl modes set the PDL attribute and issue griddepcontrol.
//
//   nvcc -arch=sm_90a -lineinfo -o /tmp/x tests/device_checks/row_sum_handoff.cu
//   /tmp/x --list                                     # the modes, one a line (host only: runs without a GPU)
//   compute-sanitizer --tool racecheck /tmp/x mode    # once per mode; add `--racecheck-report hazard` for each
//                                                     # hazard with its threads and source lines
//   /tmp/x mode [ctas]                                # without the tool: ctas defaults to the SM count
//
// Reading the verdict, per mode: "RACECHECK SUMMARY: 0 hazards displayed" means the tool accepts that pattern, so
// the kernel's report is not explained by it. Hazards reported at the probe's publish / read lines in a mode whose
// values are right means the tool reports that correct pattern: the kernel's report of the same pattern is then
// the tool's limitation, not a race. `race` must report hazards at those same lines; if it does not, racecheck did
// not see the accesses and no clean verdict of the other modes means anything. Each run also prints whether the
// second grid started before the first one ended: if a -pdl mode says it did not, PDL took no effect in that run
// (the sanitizer may serialize launches) and the mode says nothing about PDL beyond (a) / (b).
// tests/test_device_checks.py compiles it (CPU) and, on a GPU, runs every mode, checks the values and prints
// racecheck's output per mode.
//
// Measured on an H100 (2026-11-27, compute-sanitizer of CUDA 13.0): every mode's values right; syncthreads, named and
// both -pdl modes 0 hazards; both -arrive modes 2 hazards, both at the hand-off's own slot (write and read lines of
// the bar.arrive / bar.sync exchange), none at row_sum; race 4 hazards at the publish and read lines. In no run did
// the second grid start before the first ended (with or without the tool), so PDL was not exercised. So racecheck
// sees these accesses and accepts the exchange with each of these barriers: the kernels' row_sum reports come from
// something this probe leaves out (setmaxnreg, mbarriers, TMA, wgmma, the main loops' own named barriers in between).
// Measured on an H200 (2026-12-01, the same tool) with the -steps modes added: every mode's values right again;
// syncthreads, named and both -pdl modes 0 hazards; both -arrive modes 2 (their slot, as before); syncthreads-steps,
// named-steps and named-steps-mbar about 10 errors and a warning each, at the row_sum writes of publish_row_sums and
// the row_max write at the request's start against final_row_stats' reads, and at the steps' own slot: the kernels'
// class, reproduced with nothing but barriers whose last operation before the barrier of all consumers is one
// warpgroup's bar.arrive. So the kernels' row_sum and row_max reports are the tool's reading of those hand-offs.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "mbarrier_ptx.cuh"

constexpr int kRows = 64;                 // rows of the M tile (kBlockM)
constexpr int kWgThreads = 128;           // a warpgroup
constexpr int kConsumers = 2 * kWgThreads;
constexpr int kRequests = 4;              // request-loop iterations per CTA
constexpr int kSmemBytes = 128 * 1024;    // more than half an SM's shared memory: one CTA per SM
constexpr int kConsumerBarrier = 11;      // the FP8 kernel's kConsumers (3) + CUTLASS's 8 reserved barriers
constexpr int kHandoffA = 8, kHandoffB = 9;  // main-loop hand-off barriers (the kernels' named barriers start at 8)
constexpr int kHandoffC = 10;                // the -steps modes' third one (the kernels' kP0Ready)
constexpr int kSteps = 16;                   // the -steps modes' hand-off steps a request

struct RowState {
  float row_max[kRows];
  float row_sum[2][kRows];
  float slot[kWgThreads];  // the -arrive modes' hand-off slot
  float step[3][kWgThreads];  // the -steps modes' scale0, scale1 and P0 slots
  float pslot[2][kWgThreads];  // named-steps-mbar: the producer's ring of two slots
  alignas(8) uint64_t full[2], empty[2];  // and its mbarriers
};

struct Args {
  float* out;                  // [cta][request][consumer thread][l0, l1, m0, m1]
  float* prod;                 // [cta][producer thread]: the named modes' third warpgroup
  unsigned long long* times;   // [launch][first CTA start, last CTA end] in ns (%globaltimer)
  int seed;                    // 1 or 2: which launch
  int requests;
  int* step_bad;               // the -steps modes: values read from a step slot that were not the step's
};

// Small integers: every sum below is exact in fp32 whatever the order of the additions.
__host__ __device__ inline float partial(int seed, int cta, int req, int wg, int t, int v) {
  return float((seed * 7 + cta * 3 + req * 5 + wg * 11 + t * 2 + v * 13) % 97 + 1);
}
__host__ __device__ inline float row_max_value(int seed, int cta, int req, int row) {
  return float(((seed * 256 + cta) * kRequests + req) * kRows + row);
}
__host__ __device__ inline float slot_value(int seed, int cta, int req, int t) {
  return float((seed + cta + req + t) % 5);
}
__host__ __device__ inline float step_value(int seed, int cta, int req, int step, int which, int t) {
  return float((seed * 3 + cta + req * 7 + step * 5 + which * 11 + t) % 251);
}
__host__ __device__ inline float producer_value(int seed, int cta, int requests, int t) {
  float acc = 0.f;
  for (int r = 0; r < requests; ++r) acc += float(r + 1) * partial(seed, cta, r, 2, t, 0);
  return acc;
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
// Non-aligned: the participating threads may reach it at different instructions (bar.sync is barrier.sync.aligned).
__device__ __forceinline__ void barrier_sync_unaligned(int id, int n) {
  asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The barrier of all consumer threads: __syncthreads in the 16-bit kernel, barrier 11 of 256 in the FP8 one.
template <bool kNamed>
__device__ __forceinline__ void consumers_sync() {
  if constexpr (kNamed) {
    barrier_sync_unaligned(kConsumerBarrier, kConsumers);
  } else {
    __syncthreads();
  }
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The -steps modes' main loop: kSteps of the kernels' three-barrier hand-off (see the header), every read checked;
// kMbar: each step first takes the producer's slot of the step from the mbarrier ring (producer_steps).
template <bool kMbar>
__device__ __forceinline__ void hand_off_steps(RowState& s, const Args& a, int req, int wg, int t) {
  const int cta = blockIdx.x;
  int bad = 0;
#pragma unroll 1
  for (int k = 0; k < kSteps; ++k) {
    if constexpr (kMbar) {
      const int n = req * kSteps + k, slot = n % 2;
      mbar_wait(smem_u32(&s.full[slot]), uint32_t(n / 2) & 1u);
      bad += s.pslot[slot][t] != step_value(a.seed, cta, req, k, 3, t);
      __syncwarp();
      if ((t & 31) == 0) mbar_arrive(smem_u32(&s.empty[slot]));
    }
    if (wg == 0) {
      s.step[0][t] = step_value(a.seed, cta, req, k, 0, t);
      bar_arrive(kHandoffA, kConsumers);
      bar_sync(kHandoffB, kConsumers);
      bad += s.step[1][t] != step_value(a.seed, cta, req, k, 1, t);
      s.step[2][t] = step_value(a.seed, cta, req, k, 2, t);
      bar_arrive(kHandoffC, kConsumers);
    } else {
      bar_sync(kHandoffA, kConsumers);
      bad += s.step[0][t] != step_value(a.seed, cta, req, k, 0, t);
      s.step[1][t] = step_value(a.seed, cta, req, k, 1, t);
      bar_arrive(kHandoffB, kConsumers);
      bar_sync(kHandoffC, kConsumers);
      bad += s.step[2][t] != step_value(a.seed, cta, req, k, 2, t);
    }
  }
  if (bad) atomicAdd(a.step_bad, bad);
}

// named-steps-mbar's producer warpgroup: each step's value into the ring (after the slot's last use was read by all
// eight consumer warps), one arrival a warp on full.
__device__ __forceinline__ void producer_steps(RowState& s, const Args& a, int t) {
  const int cta = blockIdx.x;
#pragma unroll 1
  for (int req = 0; req < a.requests; ++req) {
#pragma unroll 1
    for (int k = 0; k < kSteps; ++k) {
      const int n = req * kSteps + k, slot = n % 2;
      if (n >= 2) mbar_wait(smem_u32(&s.empty[slot]), uint32_t(n / 2 - 1) & 1u);
      s.pslot[slot][t] = step_value(a.seed, cta, req, k, 3, t);
      __syncwarp();
      if ((t & 31) == 0) mbar_arrive(smem_u32(&s.full[slot]));
    }
  }
}

// The request loop of the consumer threads. kWG < 0: one copy for both warpgroups (the 16-bit kernel's loop);
// kWG = 0 / 1: the copy of that warpgroup (the FP8 kernel's consumer_loop<T, kWG>).
template <int kWG, bool kNamed, bool kPdl, bool kArrive, bool kRace, bool kStepsMode = false, bool kMbar = false>
__device__ __forceinline__ void request_loop(RowState& s, const Args& a, int tid) {
  const int wg = kWG >= 0 ? kWG : tid / kWgThreads;
  const int t = tid % kWgThreads;
  const int lane = tid & 31;
  const int cta = blockIdx.x;
  int row[2];
  row[0] = 16 * (t / 32) + lane / 4;  // rows of a wgmma accumulator fragment, as in the kernels
  row[1] = row[0] + 8;

#pragma unroll 1
  for (int req = 0; req < a.requests; ++req) {
    if (tid < kRows) s.row_max[tid] = row_max_value(a.seed, cta, req, tid);
    consumers_sync<kNamed>();

    // "Main loop": this thread's partial row sums.
    float sum[2] = {partial(a.seed, cta, req, wg, t, 0), partial(a.seed, cta, req, wg, t, 1)};
    if constexpr (kArrive) {
      if (wg == 0) {
        bar_arrive(kHandoffA, kConsumers);  // my read of slot in the previous request is done
        bar_sync(kHandoffB, kConsumers);    // warpgroup 1's write of slot is visible
        sum[0] += s.slot[t];
      } else {
        bar_sync(kHandoffA, kConsumers);
        s.slot[t] = slot_value(a.seed, cta, req, t);
        bar_arrive(kHandoffB, kConsumers);
      }
    }

    if constexpr (kStepsMode) hand_off_steps<kMbar>(s, a, req, wg, t);

    // publish_row_sums: the warpgroup's row sums, one lane of each quad writes them.
    sum[0] = quad_sum(sum[0]);
    sum[1] = quad_sum(sum[1]);
    if ((lane & 3) == 0) {
      s.row_sum[wg][row[0]] = sum[0];
      s.row_sum[wg][row[1]] = sum[1];
    }
    if constexpr (!kRace) consumers_sync<kNamed>();
    if (kPdl && req == a.requests - 1) launch_dependents();

    // final_row_stats: both halves and the row max, written out for main to check.
    float* o = a.out + ((size_t(cta) * a.requests + req) * kConsumers + tid) * 4;
    o[0] = s.row_sum[0][row[0]] + s.row_sum[1][row[0]];
    o[1] = s.row_sum[0][row[1]] + s.row_sum[1][row[1]];
    o[2] = s.row_max[row[0]];
    o[3] = s.row_max[row[1]];
    consumers_sync<kNamed>();  // row_max / row_sum are reused by the next request
  }
}

__device__ __forceinline__ RowState& row_state() {
  extern __shared__ __align__(16) unsigned char smem[];
  return *reinterpret_cast<RowState*>(smem);
}

// (a): 256 threads, __syncthreads.
template <bool kPdl, bool kArrive, bool kRace, bool kStepsMode = false>
__global__ void __launch_bounds__(kConsumers, 1) syncthreads_handoff(Args a) {
  const int tid = threadIdx.x;
  if (tid == 0) atomicMin(&a.times[2 * (a.seed - 1)], global_ns());
  if (kPdl) grid_dependency_wait();
  request_loop<-1, false, kPdl, kArrive, kRace, kStepsMode>(row_state(), a, tid);
  if (tid == 0) atomicMax(&a.times[2 * (a.seed - 1) + 1], global_ns());
}

// (b): 384 threads; two consumer warpgroups with their own loops on barrier 11, a producer warpgroup outside it.
template <bool kPdl, bool kArrive, bool kStepsMode = false, bool kMbar = false>
__global__ void __launch_bounds__(3 * kWgThreads, 1) named_handoff(Args a) {
  const int tid = threadIdx.x;
  if (tid == 0) atomicMin(&a.times[2 * (a.seed - 1)], global_ns());
  if (kPdl) grid_dependency_wait();
  if (kMbar && tid == 0) {
    RowState& s = row_state();
    for (int i = 0; i < 2; ++i) {
      mbar_init(smem_u32(&s.full[i]), 4);    // the producer's four warps
      mbar_init(smem_u32(&s.empty[i]), 8);   // the consumers' eight warps
    }
  }
  __syncthreads();  // the FP8 kernel's one CTA-wide barrier (after its mbarrier init)
  const int wg = __shfl_sync(0xffffffffu, tid / kWgThreads, 0);
  if (wg == 2) {
    // Producer: a loop of its own, never on barrier 11 (and never launch_dependents); named-steps-mbar: then the ring.
    const int t = tid - kConsumers;
    float acc = 0.f;
#pragma unroll 1
    for (int r = 0; r < a.requests; ++r) acc += float(r + 1) * partial(a.seed, blockIdx.x, r, 2, t, 0);
    a.prod[blockIdx.x * kWgThreads + t] = acc;
    if constexpr (kMbar) producer_steps(row_state(), a, t);
    if (t == 0) atomicMax(&a.times[2 * (a.seed - 1) + 1], global_ns());
  } else if (wg == 0) {
    request_loop<0, true, kPdl, kArrive, false, kStepsMode, kMbar>(row_state(), a, tid);
  } else {
    request_loop<1, true, kPdl, kArrive, false, kStepsMode, kMbar>(row_state(), a, tid);
  }
  if (tid == 0) atomicMax(&a.times[2 * (a.seed - 1) + 1], global_ns());
}

// ---- host ------------------------------------------------------------------------------------------------------
using Kernel = void (*)(Args);
struct Mode {
  const char* name;
  Kernel kernel;
  int threads;
  bool named, pdl, arrive, race;
  const char* what;
};

const Mode kModes[] = {
    {"syncthreads", syncthreads_handoff<false, false, false>, kConsumers, false, false, false, false,
     "(a) 16-bit kernel: 256 threads, __syncthreads"},
    {"named", named_handoff<false, false>, 3 * kWgThreads, true, false, false, false,
     "(b) FP8 kernel: 2 x 128 threads in their own loops on barrier.sync 11, 256; 128 producer threads outside"},
    {"syncthreads-pdl", syncthreads_handoff<true, false, false>, kConsumers, false, true, false, false,
     "(c) (a) + PDL: griddepcontrol.wait, launch_dependents before the last reads"},
    {"named-pdl", named_handoff<true, false>, 3 * kWgThreads, true, true, false, false,
     "(c) (b) + PDL: griddepcontrol.wait, launch_dependents before the last reads"},
    {"syncthreads-arrive", syncthreads_handoff<false, true, false>, kConsumers, false, false, true, false,
     "(a) + a bar.arrive / bar.sync hand-off between the first barrier and the writes"},
    {"named-arrive", named_handoff<false, true>, 3 * kWgThreads, true, false, true, false,
     "(b) + a bar.arrive / bar.sync hand-off between the first barrier and the writes"},
    {"syncthreads-steps", syncthreads_handoff<false, false, false, true>, kConsumers, false, false, false, false,
     "(a) + the main loops' three-barrier hand-off, 16 steps a request, before the writes"},
    {"named-steps", named_handoff<false, false, true>, 3 * kWgThreads, true, false, false, false,
     "(b) + the main loops' three-barrier hand-off, 16 steps a request, before the writes"},
    {"named-steps-mbar", named_handoff<false, false, true, true>, 3 * kWgThreads, true, false, false, false,
     "named-steps + a ring of two mbarrier slots the producer warpgroup fills and both consumers read, each step"},
    {"race", syncthreads_handoff<false, false, true>, kConsumers, false, false, false, true,
     "control: (a) without the __syncthreads between the writes and the reads (a real race)"},
};

static int usage(const char* prog) {
  fprintf(stderr, "usage: %s MODE [CTAS]   or   %s --list\nmodes:\n", prog, prog);
  for (const Mode& m : kModes) fprintf(stderr, "  %-19s %s\n", m.name, m.what);
  return 2;
}

#define CHECK(call)                                                                           \
  do {                                                                                        \
    cudaError_t e_ = (call);                                                                  \
    if (e_ != cudaSuccess) {                                                                  \
      printf("row_sum_handoff: %s failed: %s\n", #call, cudaGetErrorString(e_));              \
      return 1;                                                                               \
    }                                                                                         \
  } while (0)

int main(int argc, char** argv) {
  if (argc == 2 && strcmp(argv[1], "--list") == 0) {
    for (const Mode& m : kModes) printf("%s\n", m.name);
    return 0;
  }
  if (argc < 2 || argc > 3) return usage(argv[0]);
  const Mode* mode = nullptr;
  for (const Mode& m : kModes) {
    if (strcmp(argv[1], m.name) == 0) mode = &m;
  }
  if (mode == nullptr) return usage(argv[0]);

  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int ctas = argc == 3 ? atoi(argv[2]) : sms;
  if (ctas < 1 || ctas > 4096) return usage(argv[0]);
  printf("mode %s: %s; %d CTAs x %d threads, %d B shared memory each, 2 launches%s\n", mode->name, mode->what, ctas,
         mode->threads, kSmemBytes, mode->pdl ? " with PDL" : "");

  CHECK(cudaFuncSetAttribute(mode->kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const size_t n_out = size_t(ctas) * kRequests * kConsumers * 4;
  const size_t n_prod = size_t(ctas) * kWgThreads;
  float *out, *prod;
  unsigned long long* times;
  CHECK(cudaMalloc(&out, n_out * sizeof(float)));
  CHECK(cudaMalloc(&prod, n_prod * sizeof(float)));
  CHECK(cudaMalloc(&times, 4 * sizeof(unsigned long long)));
  int* step_bad;
  CHECK(cudaMalloc(&step_bad, sizeof(int)));
  CHECK(cudaMemset(step_bad, 0, sizeof(int)));
  CHECK(cudaMemset(out, 0xff, n_out * sizeof(float)));  // NaN: a value never written is wrong
  CHECK(cudaMemset(prod, 0xff, n_prod * sizeof(float)));
  const unsigned long long times0[4] = {~0ull, 0ull, ~0ull, 0ull};
  CHECK(cudaMemcpy(times, times0, sizeof(times0), cudaMemcpyHostToDevice));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = mode->pdl ? 1 : 0;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(ctas);
  cfg.blockDim = dim3(mode->threads);
  cfg.dynamicSmemBytes = kSmemBytes;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  for (int seed = 1; seed <= 2; ++seed) {
    const Args a{out, prod, times, seed, kRequests, step_bad};
    CHECK(cudaLaunchKernelEx(&cfg, mode->kernel, a));
  }
  const cudaError_t err = cudaStreamSynchronize(stream);

  std::vector<float> host(n_out), host_prod(n_prod);
  unsigned long long t[4] = {0, 0, 0, 0};
  int host_step_bad = 0;
  if (err == cudaSuccess) {
    CHECK(cudaMemcpy(&host_step_bad, step_bad, sizeof(int), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(host.data(), out, n_out * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(host_prod.data(), prod, n_prod * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(t, times, sizeof(t), cudaMemcpyDeviceToHost));
  }

  // Expected values of the second launch (seed 2); the -steps modes' hand-off reads of both launches were checked on
  // the device.
  const int seed = 2;
  long bad = host_step_bad;
  for (int cta = 0; cta < ctas; ++cta) {
    for (int req = 0; req < kRequests; ++req) {
      float sums[2][kRows] = {};
      for (int wg = 0; wg < 2; ++wg) {
        for (int tt = 0; tt < kWgThreads; ++tt) {
          for (int v = 0; v < 2; ++v) {
            const int r = 16 * (tt / 32) + (tt % 32) / 4 + 8 * v;
            sums[wg][r] += partial(seed, cta, req, wg, tt, v);
            if (mode->arrive && wg == 0 && v == 0) sums[wg][r] += slot_value(seed, cta, req, tt);
          }
        }
      }
      for (int tid = 0; tid < kConsumers; ++tid) {
        const int tt = tid % kWgThreads;
        const int r0 = 16 * (tt / 32) + (tt % 32) / 4;
        const int rows[2] = {r0, r0 + 8};
        const float* o = &host[((size_t(cta) * kRequests + req) * kConsumers + tid) * 4];
        for (int v = 0; v < 2; ++v) {
          bad += o[v] != sums[0][rows[v]] + sums[1][rows[v]];
          bad += o[2 + v] != row_max_value(seed, cta, req, rows[v]);
        }
      }
    }
    if (mode->named) {
      for (int tt = 0; tt < kWgThreads; ++tt)
        bad += host_prod[size_t(cta) * kWgThreads + tt] != producer_value(seed, cta, kRequests, tt);
    }
  }

  if (err == cudaSuccess) {
    // times: [first launch start, first launch end, second launch start, second launch end]
    const double gap_us = (double(t[2]) - double(t[1])) * 1e-3;
    if (gap_us < 0)
      printf("second grid started %.1f us before the first one ended (the launches overlapped)\n", -gap_us);
    else
      printf("second grid started %.1f us after the first one ended (no overlap)\n", gap_us);
  }
  printf("row_sum_handoff %s: %s, %ld wrong values%s\n", mode->name, cudaGetErrorString(err), bad,
         mode->race ? " (not checked: this mode races on purpose)" : "");
  return err != cudaSuccess || (!mode->race && bad != 0);
}
