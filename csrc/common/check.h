// Host-side error checking. Every CUDA runtime call and every launch is checked; failures become
// std::runtime_error, which pybind11 turns into a Python RuntimeError with the same text.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace flashmla_backend {

// The text of an error, built with `<<` like a stream but without iostreams: in the extension on the GPU machine
// (torch 2.11, nvcc 13.0), an std::ostringstream formatting an integer crashed the process with a segmentation
// fault inside std::basic_ostream::_M_insert<long>, so every failed check became a crash instead of a Python
// RuntimeError. std::string, std::to_string and snprintf do not touch the stream locale machinery.
class ErrorText {
 public:
  ErrorText& operator<<(const char* s) { return append(s != nullptr ? s : "(null)"); }
  ErrorText& operator<<(const std::string& s) { return append(s.c_str()); }
  ErrorText& operator<<(char c) {
    text_ += c;
    return *this;
  }
  ErrorText& operator<<(bool b) { return append(b ? "true" : "false"); }
  template <class T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> &&
                                          !std::is_same_v<T, char>, int> = 0>
  ErrorText& operator<<(T v) {
    text_ += std::to_string(v);
    return *this;
  }
  template <class T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
  ErrorText& operator<<(T v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", double(v));
    return append(buf);
  }
  template <class T, std::enable_if_t<std::is_enum_v<T>, int> = 0>
  ErrorText& operator<<(T v) {
    return *this << static_cast<std::underlying_type_t<T>>(v);
  }
  ErrorText& operator<<(const void* ptr) {
    char buf[24];
    std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(ptr)));
    return append(buf);
  }
  const std::string& str() const { return text_; }

 private:
  ErrorText& append(const char* s) {
    text_ += s;
    return *this;
  }
  std::string text_;
};

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line) {
  ErrorText os;
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
      ::flashmla_backend::ErrorText fmla_os_;                                        \
      fmla_os_ << "flashmla_backend: " << msg << " [" << #cond << " failed at "      \
               << __FILE__ << ":" << __LINE__ << "]";                                \
      throw std::runtime_error(fmla_os_.str());                                      \
    }                                                                                \
  } while (0)
