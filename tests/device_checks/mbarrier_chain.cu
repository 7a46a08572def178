// Does compute-sanitizer racecheck follow the mbarrier chain that orders the FP8 kernel's V buffer writes?
//
// In the accurate mode of the FP8 tensor-core kernel (csrc/sm90/decode_fp8/producer.cuh: widen_piece) racecheck
// reports Write/Write hazards between two producer warps' stores into the same fp16 V slot. The stores of
// consecutive uses of a slot are ordered by a chain through the consumers: the writing warp arrives on the slot's
// `full` mbarrier, the consumer warpgroup waits on it, reads the slot and arrives on `empty`, and the warp that
// writes the next use waits on `empty` first. This probe runs that chain alone, with the kernel's roles:
//
//   chain     three producer warps take the uses of one 4 KB slot round-robin (use u: producer warp u % 3); each
//             waits for the release of use u - 1 (parity), writes the slot with st.shared.v4 (the value
//             u x 1024 + index) and arrives on `full`. 128 consumer threads wait `full` for use u, read the slot with ld.shared (the
//             kernel's wgmma reads it; a generic read is what racecheck can see) and arrive on `empty` (one lane a
//             warp, count 4; use u on the u % 3-th of three `empty` barriers), as the kernel's release does.
//   race      control: the same, and each consumer thread also reads the slot before its wait on `full`, a real
//             race with the producers' writes (values printed, not checked).
//
//   nvcc -arch=sm_90a -lineinfo -o /tmp/mbarrier_chain tests/device_checks/mbarrier_chain.cu
//   compute-sanitizer --tool racecheck /tmp/mbarrier_chain chain
//   /tmp/mbarrier_chain chain        # without the tool: checks every value the consumers read
//
// Reading the verdict: hazards between the producers' writes in `chain`, with every value right, mean racecheck
// does not follow an mbarrier chain through another role, and the kernel's reports of that pattern are the tool's
// limitation; no hazards mean the kernel's reports need another explanation. `race` must report hazards.
// Measured on an H100 (2026-11-27, compute-sanitizer of CUDA 13.0): `chain` 0 wrong values, and racecheck reports 4
// Write hazards at the producers' st.shared: the tool does not follow the chain. `race` gets wrong values and the
// same reports.
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "mbarrier_ptx.cuh"

constexpr int kSlotWords = 1024;  // 4 KB
constexpr int kUses = 24;

// Warps 0..3: the consumer warpgroup; warps 4, 5, 6: the producer warps.
__global__ void chain(int* wrong, bool race) {
  __shared__ alignas(16) uint32_t slot[kSlotWords];
  __shared__ alignas(8) uint64_t bars[4];  // full, empty[3]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const uint32_t full = uint32_t(__cvta_generic_to_shared(&bars[0]));
  const uint32_t empty0 = uint32_t(__cvta_generic_to_shared(&bars[1]));
  if (tid == 0) {
    mbar_init(full, 1);
    for (int k = 0; k < 3; ++k) mbar_init(empty0 + 8 * k, 4);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp < 4) {  // consumers: the release of use u goes to empty[u % 3]
    int bad = 0;
    for (int u = 0; u < kUses; ++u) {
      if (race) {  // the control: a read before the wait for the write (the chain itself stays intact)
        for (int i = tid; i < kSlotWords; i += 128) bad += slot[i] != uint32_t(u * kSlotWords + i);
      }
      mbar_wait(full, u & 1);
      for (int i = tid; i < kSlotWords; i += 128) bad += slot[i] != uint32_t(u * kSlotWords + i);
      __syncwarp();
      if (lane == 0) mbar_arrive(empty0 + 8 * (u % 3));
    }
    if (bad) atomicAdd(wrong, bad);
  } else {  // producer warp pw = warp - 4 writes the uses u = pw, pw + 3, ...
    const int pw = warp - 4;
    const uint32_t base = uint32_t(__cvta_generic_to_shared(slot));
    for (int u = pw; u < kUses; u += 3) {
      // The release of use u - 1: always the same barrier for this warp, which waits for each of its completions
      // in turn (the kernel's kVtEmptyCopies keeps its waits within one phase the same way).
      if (u > 0) mbar_wait(empty0 + 8 * ((u - 1) % 3), ((u - 1) / 3) & 1);
      for (int i = lane * 4; i < kSlotWords; i += 128) {
        const uint32_t v0 = u * kSlotWords + i;
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(base + 4 * i), "r"(v0), "r"(v0 + 1),
                     "r"(v0 + 2), "r"(v0 + 3)
                     : "memory");
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(full);
    }
  }
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "chain";
  if (std::strcmp(mode, "--list") == 0) {
    std::printf("chain\nrace\n");
    return 0;
  }
  const bool race = std::strcmp(mode, "race") == 0;
  if (!race && std::strcmp(mode, "chain") != 0) {
    std::printf("unknown mode '%s' (chain or race)\n", mode);
    return 2;
  }
  int* wrong;
  cudaMalloc(&wrong, sizeof(int));
  cudaMemset(wrong, 0, sizeof(int));
  chain<<<1, 224>>>(wrong, race);
  const cudaError_t err = cudaDeviceSynchronize();
  int bad = -1;
  cudaMemcpy(&bad, wrong, sizeof(int), cudaMemcpyDeviceToHost);
  std::printf("mbarrier chain probe (%s): %s, %d wrong values\n", mode, cudaGetErrorString(err), bad);
  return err != cudaSuccess || (!race && bad != 0);
}
