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
#include "../common/check_params.h"
#include "../common/measure.h"
#include "../launch.h"
#include "../params.h"
#ifdef FLASHMLA_BACKEND_WITH_SM90
#include "../sm90/decode/decode.h"
#include "../sm90/sparse_fp8/decode.h"
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

// How a DecodeParams field looks from Python: pointers (and the stream) as integers, the dtype as its
// int code (params.h), everything else as itself.
template <typename T>
struct PyField {
  using type = T;
  static type get(T v) { return v; }
  static T set(type v) { return v; }
};
template <typename T>
struct PyField<T*> {
  using type = std::uintptr_t;
  static type get(T* v) { return reinterpret_cast<std::uintptr_t>(v); }
  static T* set(type v) { return as_ptr<T>(v); }
};
template <>
struct PyField<KvFormat> {
  using type = int;
  static type get(KvFormat v) { return static_cast<int>(v); }
  // A byte in DecodeParams: a value that does not fit is refused here, an unknown code by check_decode_params().
  static KvFormat set(type v) {
    FMLA_HOST_CHECK(v >= 0 && v <= 255, "kv_format must be a KvFormat code (0 bf16, 1 fp16, 2 fp8_e4m3, 3 "
                                        "fp8_ds_mla), got "
                                            << v);
    return static_cast<KvFormat>(v);
  }
};
template <>
struct PyField<DType> {
  using type = int;
  static type get(DType v) { return static_cast<int>(v); }
  static DType set(type v) { return static_cast<DType>(v); }  // check_decode_params() refuses unknown codes
};

// _C.DecodeArgs: the ARG fields of DecodeParams (params.h, FMLA_DECODE_PARAMS), plus which kernel runs.
// The DERIVED fields are filled by mla_decode.
struct DecodeArgs {
  std::string kernel = "portable";  // "portable" or "sm90"
  DecodeParams params{};
};

// Names Python sets on DecodeArgs: "kernel" and every ARG field, in params.h order.
std::vector<std::string> decode_fields() {
  std::vector<std::string> names = {"kernel"};
#define FMLA_ARG_NAME(type, name) names.emplace_back(#name);
#define FMLA_SKIP(type, name)
  FMLA_DECODE_PARAMS(FMLA_ARG_NAME, FMLA_SKIP)
#undef FMLA_SKIP
#undef FMLA_ARG_NAME
  return names;
}

void bind_decode_args(py::module_& m) {
  py::class_<DecodeArgs> cls(m, "DecodeArgs");
  cls.def(py::init<>());
  cls.def_readwrite("kernel", &DecodeArgs::kernel);
#define FMLA_ARG_PROPERTY(T_, name)                                                         \
  cls.def_property(                                                                         \
      #name, [](const DecodeArgs& a) { return PyField<T_>::get(a.params.name); },           \
      [](DecodeArgs& a, typename PyField<T_>::type v) { a.params.name = PyField<T_>::set(v); });
#define FMLA_SKIP(type, name)
  FMLA_DECODE_PARAMS(FMLA_ARG_PROPERTY, FMLA_SKIP)
#undef FMLA_SKIP
#undef FMLA_ARG_PROPERTY
}

bool sm90_compiled() {
#ifdef FLASHMLA_BACKEND_WITH_SM90
  return true;
#else
  return false;
#endif
}

// Whether this build has the in-kernel measurement switches (FLASHMLA_BACKEND_MEASURE=1; common/measure.h).
bool measure_build() { return kMeasureBuild; }

void mla_decode(const DecodeArgs& args) {
  DecodeParams p = args.params;
  derive_decode_params(p);
  DecodeRequirements shared;
  shared.formats = ~0u;  // which formats the chosen kernel reads is its launcher's check
  check_decode_params(p, shared);  // the launchers add their kernel's own requirements
  DeviceGuard guard(p.device);
  if (p.indices != nullptr) {  // sparse decode (params.h: the sparse mapping)
#ifdef FLASHMLA_BACKEND_WITH_SM90
    FMLA_HOST_CHECK(args.kernel == "sm90", "sparse decode (indices) runs on the sm90 kernel only, got kernel '"
                                               << args.kernel << "'");
    run_sm90_sparse_decode(p);
#else
    FMLA_HOST_CHECK(false, "this build has no sm90 kernel (built without the sm_90a target), which sparse decode needs");
#endif
  } else if (args.kernel == "portable") {
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
  // Sparse decode knows its schedule on the host (flashmla_backend/ops.py: _sparse_schedule_splits): where it cuts
  // no row, every row was written by the decode kernel and the combine, whose CTAs would all return at once, is not
  // launched (about 5 us of 4,096 empty CTAs at b128 h_q 128; docs/perf/journal.md, 2026-12-02).
  if (!p.skip_combine) run_combine(p);
}

void tile_scheduler(std::uintptr_t seqlens, int batch, int num_sm_parts, int min_part_blocks, std::uintptr_t metadata,
                    std::uintptr_t num_splits, int device, std::uintptr_t stream) {
  DeviceGuard guard(device);
  SchedParams p{};
  p.seqlens = as_ptr<const int32_t>(seqlens);
  p.metadata = as_ptr<int32_t>(metadata);
  p.num_splits = as_ptr<int32_t>(num_splits);
  p.batch = batch;
  p.num_sm_parts = num_sm_parts;
  p.min_part_blocks = min_part_blocks;
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

// The names of the formats in a set of format bits (launch.h), in code order.
py::tuple format_names(uint32_t bits) {
  std::vector<std::string> names;
  for (int f = 0; f < kNumKvFormats; ++f) {
    if (bits & (1u << f)) names.emplace_back(kv_format_name(static_cast<KvFormat>(f)));
  }
  return py::tuple(py::cast(names));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "flashmla_backend CUDA kernels (torch-free binding; see flashmla_backend/ops.py)";

  bind_decode_args(m);
  m.attr("decode_fields") = py::tuple(py::cast(decode_fields()));
  m.def("mla_decode", &mla_decode, py::arg("args"),
        "Split-KV decode followed by the combine kernel, asynchronously on args.stream.");
  m.def("tile_scheduler", &tile_scheduler, py::arg("seqlens"), py::arg("batch"), py::arg("num_sm_parts"),
        py::arg("min_part_blocks"), py::arg("metadata"), py::arg("num_splits"), py::arg("device"), py::arg("stream"),
        "Fills tile-scheduler metadata [num_sm_parts, 8] and num_splits [batch + 1] on the GPU.");
  m.def("device_info", &device_info, py::arg("device"));
  m.def("portable_decode_smem_bytes", &portable_decode_smem_bytes);
  m.def("sm90_compiled", &sm90_compiled);
  m.def("measure_build", &measure_build);
#ifdef FLASHMLA_BACKEND_WITH_SM90
  m.def("sm90_decode_smem_bytes", &sm90_decode_smem_bytes);
  m.def(
      "sparse_timeline",
      [](int device) {
        DeviceGuard guard(device);
        SparseTimeline t;
        FMLA_HOST_CHECK(read_sm90_sparse_timeline(t),
                        "this build records no sparse timeline; configure it with "
                        "FLASHMLA_BACKEND_NVCC_FLAGS=-DFMLA_SPARSE_TIMELINE=1 (docs/build.md)");
        return py::dict(py::arg("max_ctas") = t.max_ctas, py::arg("roles") = t.roles, py::arg("events") = t.events,
                        py::arg("words") = t.words, py::arg("counts") = t.counts, py::arg("ns") = t.ns);
      },
      py::arg("device"),
      "The sparse kernel's timeline of its last launch on `device` (a timeline build only: "
      "csrc/sm90/sparse_fp8/timeline.cuh); its counts are cleared.");
#endif
#ifndef FLASHMLA_BACKEND_ARCH_LIST
#error "CMakeLists.txt passes -DFLASHMLA_BACKEND_ARCH_LIST=\"80;90a\" (the targets this build compiled)"
#endif
  // params.h: KvFormat (name -> code) and launch.h: the formats each kernel reads; flashmla_backend/kv_format.py states
  // the same (tests/test_build.py compares them).
  py::dict kv_formats;
  for (int f = 0; f < kNumKvFormats; ++f) kv_formats[kv_format_name(static_cast<KvFormat>(f))] = f;
  m.attr("kv_formats") = kv_formats;
  py::dict kernel_formats;
  kernel_formats["portable"] = py::dict(py::arg("dense") = format_names(kPortableDenseFormats),
                                        py::arg("sparse") = format_names(0));
  kernel_formats["sm90"] = py::dict(py::arg("dense") = format_names(kSm90DenseFormats),
                                    py::arg("sparse") = format_names(kSm90SparseFormats));
  m.attr("kernel_kv_formats") = kernel_formats;
  m.attr("cuda_archs") = std::string(FLASHMLA_BACKEND_ARCH_LIST);
  m.attr("cuda_runtime_version") = CUDART_VERSION;
  m.attr("schedule_constants") = py::dict(py::arg("page_size") = kPageSize, py::arg("block_m") = kBlockM,
                                          py::arg("fixed_overhead_blocks") = kFixedOverheadBlocks,
                                          py::arg("min_part_blocks") = kMinPartBlocks,
                                          py::arg("sparse_min_part_blocks") = kSparseMinPartBlocks,
                                          py::arg("meta_ints") = kSchedMetaInts,
                                          py::arg("head_dim_k") = kHeadDimK, py::arg("head_dim_v") = kHeadDimV);
}
