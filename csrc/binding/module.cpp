// pybind11 binding of flashmla_backend._C. It only translates: Python passes integers (device
// pointers, sizes, strides in elements, a cudaStream_t as int) that flashmla_backend/ops.py
// extracted from validated torch tensors; no torch header is included and libtorch is not linked,
// so one build serves every torch version.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../common/check.h"
#include "../launch.h"
#include "../params.h"
#ifdef FLASHMLA_BACKEND_WITH_SM90
#include "../sm90/decode/decode.h"
#endif

namespace py = pybind11;
using namespace flashmla_backend;

namespace {

// Makes `device` current for this extension's CUDA runtime for the scope, restoring the previous
// device after. (The extension links the CUDA runtime statically: its current device is its own,
// independent of torch's, so it must be set before every launch.)
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    FMLA_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device_) FMLA_CUDA_CHECK(cudaSetDevice(device_));
  }
  ~DeviceGuard() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int previous_ = 0;
};

template <typename T>
T* as_ptr(std::uintptr_t v) {
  return reinterpret_cast<T*>(v);
}

// Decode arguments as Python sets them: pointers as integers. Field meanings: params.h.
struct DecodeArgs {
  std::string kernel = "portable";  // "portable" or "sm90"
  int dtype = 0;
  int device = 0;
  std::uintptr_t stream = 0;
  int batch = 0, seqlen_q = 0, num_heads_q = 0, num_heads_kv = 0;
  int num_pages = 0, max_pages_per_seq = 0, num_sm_parts = 0;
  float scale = 0.f;
  bool causal = false;
  bool pdl = false;
  std::uintptr_t q = 0;
  int64_t q_stride_b = 0, q_stride_s = 0, q_stride_h = 0;
  std::uintptr_t kv = 0;
  int64_t kv_stride_page = 0, kv_stride_token = 0, kv_stride_h = 0;
  std::uintptr_t block_table = 0;
  int64_t block_table_stride_b = 0;
  std::uintptr_t seqlens = 0, sched_meta = 0, num_splits = 0;
  std::uintptr_t out = 0;
  int64_t out_stride_b = 0, out_stride_s = 0, out_stride_h = 0;
  std::uintptr_t lse = 0;
  int64_t lse_stride_b = 0, lse_stride_h = 0;
  std::uintptr_t lse_accum = 0, o_accum = 0;
};

DecodeParams to_params(const DecodeArgs& a) {
  FMLA_HOST_CHECK(a.dtype == static_cast<int>(DType::kBF16) || a.dtype == static_cast<int>(DType::kFP16),
                  "dtype code must be 0 (bf16) or 1 (fp16), got " << a.dtype);
  FMLA_HOST_CHECK(a.batch >= 1 && a.seqlen_q >= 1 && a.num_heads_kv >= 1 && a.num_heads_q >= a.num_heads_kv &&
                      a.num_heads_q % a.num_heads_kv == 0 && a.num_sm_parts >= 1 && a.max_pages_per_seq >= 1,
                  "inconsistent decode sizes");
  DecodeParams p{};
  p.dtype = static_cast<DType>(a.dtype);
  p.device = a.device;
  p.batch = a.batch;
  p.seqlen_q = a.seqlen_q;
  p.num_heads_q = a.num_heads_q;
  p.num_heads_kv = a.num_heads_kv;
  p.ngroups = a.num_heads_q / a.num_heads_kv;
  p.q_rows = a.seqlen_q * p.ngroups;
  p.num_m_blocks = (p.q_rows + kBlockM - 1) / kBlockM;
  p.num_sm_parts = a.num_sm_parts;
  p.num_pages = a.num_pages;
  p.max_pages_per_seq = a.max_pages_per_seq;
  p.scale = a.scale;
  p.scale_log2 = a.scale * 1.4426950408889634f;
  p.causal = a.causal;
  p.q = as_ptr<const void>(a.q);
  p.q_stride_b = a.q_stride_b;
  p.q_stride_s = a.q_stride_s;
  p.q_stride_h = a.q_stride_h;
  p.kv = as_ptr<const void>(a.kv);
  p.kv_stride_page = a.kv_stride_page;
  p.kv_stride_token = a.kv_stride_token;
  p.kv_stride_h = a.kv_stride_h;
  p.block_table = as_ptr<const int32_t>(a.block_table);
  p.block_table_stride_b = a.block_table_stride_b;
  p.seqlens = as_ptr<const int32_t>(a.seqlens);
  p.sched_meta = as_ptr<const int32_t>(a.sched_meta);
  p.num_splits = as_ptr<const int32_t>(a.num_splits);
  p.out = as_ptr<void>(a.out);
  p.out_stride_b = a.out_stride_b;
  p.out_stride_s = a.out_stride_s;
  p.out_stride_h = a.out_stride_h;
  p.lse = as_ptr<float>(a.lse);
  p.lse_stride_b = a.lse_stride_b;
  p.lse_stride_h = a.lse_stride_h;
  p.lse_accum = as_ptr<float>(a.lse_accum);
  p.o_accum = as_ptr<float>(a.o_accum);
  p.stream = as_ptr<void>(a.stream);
  p.pdl = a.pdl;
  return p;
}

bool sm90_compiled() {
#ifdef FLASHMLA_BACKEND_WITH_SM90
  return true;
#else
  return false;
#endif
}

void mla_decode(const DecodeArgs& args) {
  const DecodeParams p = to_params(args);
  DeviceGuard guard(p.device);
  if (args.kernel == "portable") {
    run_portable_decode(p);
  } else if (args.kernel == "sm90") {
#ifdef FLASHMLA_BACKEND_WITH_SM90
    run_sm90_decode(p);
#else
    FMLA_HOST_CHECK(false, "this build has no sm90 kernel (built without the sm_90a target)");
#endif
  } else {
    FMLA_HOST_CHECK(false, "unknown kernel '" << args.kernel << "' (expected 'portable' or 'sm90')");
  }
  run_combine(p);
}

void tile_scheduler(std::uintptr_t seqlens, int batch, int num_sm_parts, std::uintptr_t metadata,
                    std::uintptr_t num_splits, int device, std::uintptr_t stream) {
  DeviceGuard guard(device);
  SchedParams p{};
  p.seqlens = as_ptr<const int32_t>(seqlens);
  p.metadata = as_ptr<int32_t>(metadata);
  p.num_splits = as_ptr<int32_t>(num_splits);
  p.batch = batch;
  p.num_sm_parts = num_sm_parts;
  p.stream = as_ptr<void>(stream);
  run_tile_scheduler(p);
}

py::dict device_info(int device) {
  int count = 0;
  FMLA_CUDA_CHECK(cudaGetDeviceCount(&count));
  FMLA_HOST_CHECK(device >= 0 && device < count, "device " << device << " out of range (" << count << " devices)");
  cudaDeviceProp prop{};
  FMLA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  int smem_optin = 0;
  FMLA_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  py::dict d;
  d["name"] = std::string(prop.name);
  d["major"] = prop.major;
  d["minor"] = prop.minor;
  d["sm_count"] = prop.multiProcessorCount;
  d["smem_per_block_optin"] = smem_optin;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "flashmla_backend CUDA kernels (torch-free binding; see flashmla_backend/ops.py)";

  py::class_<DecodeArgs>(m, "DecodeArgs")
      .def(py::init<>())
#define FMLA_FIELD(name) .def_readwrite(#name, &DecodeArgs::name)
      FMLA_FIELD(kernel) FMLA_FIELD(dtype) FMLA_FIELD(device) FMLA_FIELD(stream)
      FMLA_FIELD(batch) FMLA_FIELD(seqlen_q) FMLA_FIELD(num_heads_q) FMLA_FIELD(num_heads_kv)
      FMLA_FIELD(num_pages) FMLA_FIELD(max_pages_per_seq) FMLA_FIELD(num_sm_parts)
      FMLA_FIELD(scale) FMLA_FIELD(causal) FMLA_FIELD(pdl)
      FMLA_FIELD(q) FMLA_FIELD(q_stride_b) FMLA_FIELD(q_stride_s) FMLA_FIELD(q_stride_h)
      FMLA_FIELD(kv) FMLA_FIELD(kv_stride_page) FMLA_FIELD(kv_stride_token) FMLA_FIELD(kv_stride_h)
      FMLA_FIELD(block_table) FMLA_FIELD(block_table_stride_b)
      FMLA_FIELD(seqlens) FMLA_FIELD(sched_meta) FMLA_FIELD(num_splits)
      FMLA_FIELD(out) FMLA_FIELD(out_stride_b) FMLA_FIELD(out_stride_s) FMLA_FIELD(out_stride_h)
      FMLA_FIELD(lse) FMLA_FIELD(lse_stride_b) FMLA_FIELD(lse_stride_h)
      FMLA_FIELD(lse_accum) FMLA_FIELD(o_accum)
#undef FMLA_FIELD
      ;

  m.def("mla_decode", &mla_decode, py::arg("args"),
        "Split-KV decode followed by the combine kernel, asynchronously on args.stream.");
  m.def("tile_scheduler", &tile_scheduler, py::arg("seqlens"), py::arg("batch"), py::arg("num_sm_parts"),
        py::arg("metadata"), py::arg("num_splits"), py::arg("device"), py::arg("stream"),
        "Fills tile-scheduler metadata [num_sm_parts, 8] and num_splits [batch + 1] on the GPU.");
  m.def("device_info", &device_info, py::arg("device"));
  m.def("portable_decode_smem_bytes", &portable_decode_smem_bytes);
  m.def("sm90_compiled", &sm90_compiled);
#ifdef FLASHMLA_BACKEND_WITH_SM90
  m.def("sm90_decode_smem_bytes", &sm90_decode_smem_bytes);
#endif
#ifndef FLASHMLA_BACKEND_ARCH_LIST
#error "setup.py passes -DFLASHMLA_BACKEND_ARCH_LIST=\"80;90a\" (the targets this build compiled)"
#endif
  m.attr("cuda_archs") = std::string(FLASHMLA_BACKEND_ARCH_LIST);
  m.attr("cuda_runtime_version") = CUDART_VERSION;
  m.attr("schedule_constants") = py::dict(py::arg("page_size") = kPageSize, py::arg("block_m") = kBlockM,
                                          py::arg("fixed_overhead_blocks") = kFixedOverheadBlocks,
                                          py::arg("meta_ints") = kSchedMetaInts,
                                          py::arg("head_dim_k") = kHeadDimK, py::arg("head_dim_v") = kHeadDimV);
}
