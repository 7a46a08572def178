// Types of the portable split-KV MLA decode kernel: the MMA atom and the fp32 -> element-pair
// conversion per element type, and the shared-memory plan (sized by sizeof, checked against sm_80).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include <cute/arch/mma_sm80.hpp>    // SM80_16x8x16_F32{BF16BF16,F16F16}F32_TN

#include "portable/config.h"

namespace flashmla_backend::portable {

// ---- Element type: MMA atom and fp32 -> packed pair conversion ---------------------------------------
template <typename T>
struct ElementOps;

template <>
struct ElementOps<__nv_bfloat16> {
  using Mma = cute::SM80_16x8x16_F32BF16BF16F32_TN;
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);   // .x = lo (lower address)
    uint32_t u;
    memcpy(&u, &v, sizeof(u));
    return u;
  }
};

template <>
struct ElementOps<__half> {
  using Mma = cute::SM80_16x8x16_F32F16F16F32_TN;
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &v, sizeof(u));
    return u;
  }
};

// ---- Shared-memory plan (one CTA); the launch is sized with sizeof(SharedStorage) ------------------
// Elements are stored as raw 16-bit patterns (bf16 or fp16), so the plan does not depend on the type.
// No unions: the Q tile stays resident for a whole request and is overwritten by the next request's Q
// only after the last Q K^T of the current one; the KV block is refilled chunk by chunk (config.h: the
// cp.async commit groups) while P V still reads the other chunks.
struct alignas(128) SharedStorage {
  uint16_t q[kBlockM][kRowElems];      // Q tile, 64 query rows x 576 (+pad); invalid rows are zeros
  uint16_t kv[kBlockN][kRowElems];     // one KV block, 64 keys x 576 (+pad); keys outside [start, stop) are zeros
  uint16_t p[kBlockM][kPRowElems];     // P = exp2(S - max) in the element type, 64 rows x 64 keys (+pad)
  float row_max[kWarpsN][kBlockM];     // per warp column half: max over its 32 keys of the block (log2 units)
  float row_sum[kWarpsN][kBlockM];     // per warp column half: running row sum, exchanged in the epilogue
};

constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
constexpr int kMaxSmemSm80 = 163 * 1024;   // cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_80
static_assert(kSmemBytes <= kMaxSmemSm80, "shared-memory plan must fit sm_80");
static_assert(sizeof(SharedStorage) % 16 == 0 && offsetof(SharedStorage, kv) % 16 == 0 &&
                  offsetof(SharedStorage, p) % 16 == 0,
              "16-byte alignment of every tile (cp.async / ldmatrix)");

}  // namespace flashmla_backend::portable
