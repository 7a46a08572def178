// Does compute-sanitizer racecheck understand the named-barrier hand-off the sm90 kernel uses?
//
// Two "warpgroups" (128 threads each) exchange one value per row through shared memory, exactly as
// the sm90 decode kernel exchanges scale1: the producer writes, then arrives on barrier B; the
// consumer syncs on B and reads. Before the producer overwrites the slot in the next step it syncs
// on barrier A, which the consumer arrives on only after its read. The hand-off is correct by the
// PTX barrier semantics (arrive orders the thread's prior memory accesses before the barrier
// completes); if racecheck still reports a Write/Read hazard here, reports of this pattern in the
// kernel are a limitation of the tool, not a race.
//
//   nvcc -arch=sm_90a -o /tmp/probe tests/device_checks/named_barrier_war.cu
//   compute-sanitizer --tool racecheck /tmp/probe
// tests/test_device_checks.py compiles it (CPU) and, on a GPU, runs it and checks the values handed off.
// Measured on an H100 (2026-11-27, compute-sanitizer of CUDA 13.0): 0 wrong values, and racecheck reports
// Write/Read hazards at the slot: the tool does not see the ordering of this hand-off.
#include <cstdio>

__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }

__global__ void handoff(float* out, int steps) {
  __shared__ float slot[128];
  const int tid = threadIdx.x;
  float acc = 0.f;
  for (int step = 0; step < steps; ++step) {
    if (tid < 128) {          // consumer (like warpgroup 0)
      bar_arrive(1, 256);     // "kScale0Ready": my previous read of slot is done
      bar_sync(2, 256);       // "kScale1Ready": the producer's write is visible
      acc += slot[tid];
    } else {                  // producer (like warpgroup 1)
      bar_sync(1, 256);
      slot[tid - 128] = float(step + tid);
      bar_arrive(2, 256);
    }
  }
  if (tid < 128) out[tid] = acc;
}

int main() {
  float* out;
  cudaMalloc(&out, 128 * sizeof(float));
  handoff<<<1, 256>>>(out, 4);
  cudaError_t err = cudaDeviceSynchronize();
  float host[128];
  cudaMemcpy(host, out, sizeof(host), cudaMemcpyDeviceToHost);
  // slot[t] at step s = s + 128 + t; the sum over 4 steps is 6 + 4 * (128 + t)
  int bad = 0;
  for (int t = 0; t < 128; ++t) bad += host[t] != 6.f + 4.f * (128 + t);
  printf("handoff probe: %s, %d wrong values\n", cudaGetErrorString(err), bad);
  return err != cudaSuccess || bad != 0;
}
