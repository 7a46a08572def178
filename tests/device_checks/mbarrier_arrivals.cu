// Does compute-sanitizer racecheck see the order of an mbarrier phase that several warps complete together?
//
// The sparse kernel (csrc/sm90/sparse_fp8) hands data between roles through mbarrier pairs, and racecheck reports
// hazards at two of them: the P slots (warpgroup 0's store_p / warpgroup 1's loads, p_full / p_empty) and the words'
// pairs (the transposer warps' block_group_factors / the consumers' build_words, published by vt_full, freed by
// empty). In both, each of several warps writes its part, then its lane 0 arrives once after __syncwarp (the
// barrier's count is the number of warps), and the readers wait for the phase. tests/device_checks/mbarrier_chain.cu
// showed that racecheck does follow a pair whose phase one warp completes (no report between the writer and the
// readers there). This probe runs the sparse kernel's hand-off alone, two slots in a ring as the P slots, with the
// same PTX (mbarrier.arrive; mbarrier.try_wait.parity in a loop, as common/device.cuh: mbarrier_wait):
//
//   one-warp     warp 0 of the writer warpgroup writes a whole 8 KB slot and arrives (full's count 1); the four reader
//                warps wait for full, read the slot, and each arrives on the slot's empty (count 4) after __syncwarp;
//                the writer waits for empty before it rewrites the slot two blocks later.
//   four-warps   the kernel's pattern: each of the writer warpgroup's four warps writes its quarter of the slot and
//                arrives on full (count 4); the readers as above (each reads the whole slot).
//   race         control: four-warps, and each reader thread also reads the slot before its wait for full.
//
//   nvcc -arch=sm_90a -lineinfo -o /tmp/mbarrier_arrivals tests/device_checks/mbarrier_arrivals.cu
//   /tmp/mbarrier_arrivals four-warps        # without the tool: checks every value the readers read
//   compute-sanitizer --tool racecheck /tmp/mbarrier_arrivals four-warps
//
// Reading the verdict: `one-warp` and `four-warps` must read no wrong value and `race` must be reported. Hazards in
// `four-warps` but not in `one-warp` would mean racecheck orders a phase only after the arrival that completed it.
//
// Measured (H200, compute-sanitizer of CUDA 13.0): all three modes read what they must (race: 1,023 wrong values, as
// intended). racecheck reports the same four hazards in `one-warp` and `four-warps`, with the same counts (249,984
// each): the readers' loads after their wait for full against the writer's st.shared, i.e. the slot's rewrite two
// blocks later, which the empty barrier orders (four reader warps complete its phase in every mode). `race` adds its
// reads before the wait. So how many warps complete the full phase changes nothing, and racecheck does not follow
// the slot's release through the empty barrier (write after read); whether it would with one reader warp is not
// tested here. The sparse kernel's reports are all of that kind: warpgroup 1's loads of a P slot and of the rows'
// factors against warpgroup 0's rewrite after p_empty, and the consumers' loads of the words' pairs against the
// transposer warps' rewrite after the V^T chain's releases (every phase completed by four warps or more).
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "mbarrier_ptx.cuh"

constexpr int kSlotWords = 2048;  // 8 KB, as a P slot in fp16
constexpr int kSlots = 2;
constexpr int kBlocks = 64;
constexpr int kWriterWarps = 4;
constexpr int kReaderWarps = 4;

enum Mode { kOneWarp, kFourWarps, kRace };

// Warps 0..3 write, warps 4..7 read. Block g uses slot g % 2: full[s] phase g / 2, empty[s] phase g / 2.
__global__ void handoff(int* wrong, int mode) {
  __shared__ alignas(16) uint32_t slot[kSlots][kSlotWords];
  __shared__ alignas(8) uint64_t bars[2 * kSlots];  // full[2], empty[2]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const uint32_t full0 = uint32_t(__cvta_generic_to_shared(&bars[0]));
  const uint32_t empty0 = uint32_t(__cvta_generic_to_shared(&bars[kSlots]));
  if (tid == 0) {
    for (int s = 0; s < kSlots; ++s) {
      mbar_init(full0 + 8 * s, mode == kOneWarp ? 1 : kWriterWarps);
      mbar_init(empty0 + 8 * s, kReaderWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp < kWriterWarps) {
    if (mode == kOneWarp && warp > 0) return;
    const int writers = mode == kOneWarp ? 1 : kWriterWarps;
    const int words = kSlotWords / writers;  // this warp's part of a slot
    for (int g = 0; g < kBlocks; ++g) {
      const int s = g % kSlots;
      if (g >= kSlots) mbar_wait(empty0 + 8 * s, ((g / kSlots) - 1) & 1);
      const uint32_t base = uint32_t(__cvta_generic_to_shared(&slot[s][warp * words]));
      for (int i = lane * 4; i < words; i += 128) {
        const uint32_t v0 = uint32_t(g * kSlotWords + warp * words + i);
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(base + 4 * i), "r"(v0), "r"(v0 + 1),
                     "r"(v0 + 2), "r"(v0 + 3)
                     : "memory");
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(full0 + 8 * s);
    }
  } else {
    const int rt = tid - 32 * kWriterWarps;  // 0..127
    int bad = 0;
    for (int g = 0; g < kBlocks; ++g) {
      const int s = g % kSlots;
      if (mode == kRace) {  // the control: a read before the wait for the write (the pairs themselves stay intact)
        for (int i = rt; i < kSlotWords; i += 128) bad += slot[s][i] != uint32_t(g * kSlotWords + i);
      }
      mbar_wait(full0 + 8 * s, (g / kSlots) & 1);
      for (int i = rt; i < kSlotWords; i += 128) bad += slot[s][i] != uint32_t(g * kSlotWords + i);
      __syncwarp();
      if (lane == 0) mbar_arrive(empty0 + 8 * s);
    }
    if (bad) atomicAdd(wrong, bad);
  }
}

int main(int argc, char** argv) {
  const char* names[] = {"one-warp", "four-warps", "race"};
  const char* arg = argc > 1 ? argv[1] : "four-warps";
  if (std::strcmp(arg, "--list") == 0) {
    for (const char* n : names) std::printf("%s\n", n);
    return 0;
  }
  int mode = -1;
  for (int m = 0; m < 3; ++m) {
    if (std::strcmp(arg, names[m]) == 0) mode = m;
  }
  if (mode < 0) {
    std::printf("unknown mode '%s' (one-warp, four-warps or race)\n", arg);
    return 2;
  }
  int* wrong;
  cudaMalloc(&wrong, sizeof(int));
  cudaMemset(wrong, 0, sizeof(int));
  handoff<<<1, 32 * (kWriterWarps + kReaderWarps)>>>(wrong, mode);
  const cudaError_t err = cudaDeviceSynchronize();
  int bad = -1;
  cudaMemcpy(&bad, wrong, sizeof(int), cudaMemcpyDeviceToHost);
  std::printf("mbarrier arrivals probe (%s): %s, %d wrong values\n", arg, cudaGetErrorString(err), bad);
  return err != cudaSuccess || (mode != kRace && bad != 0);
}
