// Host-side error checking. Every CUDA runtime call and every launch is checked; failures become
// std::runtime_error, which pybind11 turns into a Python RuntimeError with the same text.
#pragma once

#include <cuda_runtime.h>

#include <sstream>
#include <stdexcept>
#include <string>

namespace flashmla_backend {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line) {
  std::ostringstream os;
  os << "flashmla_backend: CUDA error " << cudaGetErrorName(err) << " (" << cudaGetErrorString(err)
     << ") in " << what << " at " << file << ":" << line;
  throw std::runtime_error(os.str());
}

}  // namespace flashmla_backend

#define FMLA_CUDA_CHECK(expr)                                                        \
  do {                                                                               \
    cudaError_t fmla_err_ = (expr);                                                  \
    if (fmla_err_ != cudaSuccess)                                                    \
      ::flashmla_backend::throw_cuda_error(fmla_err_, #expr, __FILE__, __LINE__);    \
  } while (0)

// After a <<<>>> or cudaLaunchKernelEx: catches bad configurations (too much smem, bad grid).
#define FMLA_CHECK_LAUNCH(name) FMLA_CUDA_CHECK(cudaGetLastError())

#define FMLA_HOST_CHECK(cond, msg)                                                   \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::ostringstream fmla_os_;                                                   \
      fmla_os_ << "flashmla_backend: " << msg << " [" << #cond << " failed at "      \
               << __FILE__ << ":" << __LINE__ << "]";                                \
      throw std::runtime_error(fmla_os_.str());                                      \
    }                                                                                \
  } while (0)
