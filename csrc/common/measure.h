// In-kernel measurement switches: compiled only into a measurement build.
//
// Some measurement switches (FLASHMLA_BACKEND_FP8_DEBUG bit 1, every FLASHMLA_BACKEND_SPARSE_DEBUG bit) leave work out
// inside a kernel, so the kernel reads them at run time. Such a test of a kernel argument in a producer's or a
// consumer's loop is not free: on an H200 the kernels with their `debug` argument forced to 0 at entry were 1-3%
// faster (FP8 fast mode 335 against 342 us at b128-sk8192-h128, 175 against 178-181 at h_q 16; sparse 202 against 205
// us at b128-topk2048, 76 against 79 at top-k 512). So a default build compiles the kernels with no such switch, and
// a build configured with FLASHMLA_BACKEND_MEASURE=1 (docs/build.md) keeps them. The launchers refuse a switch the
// build lacks, naming the setting, instead of timing a kernel that ignores it. Switches that only choose a kernel or a
// plan on the host work in every build.
#pragma once

namespace flashmla_backend {

#if defined(FLASHMLA_BACKEND_MEASURE)
inline constexpr bool kMeasureBuild = true;
#else
inline constexpr bool kMeasureBuild = false;
#endif
// A kernel takes its bits as `const int debug = kMeasureBuild ? debug_arg : 0;`: a constant 0 in a default build, so
// the compiler removes every test of them.

}  // namespace flashmla_backend
