// check_decode_params(): the one host-side check of DecodeParams. The binding calls it before any
// launch with the rules every kernel shares; each launcher (portable, sm90, combine) calls it again
// with its own DecodeRequirements, so a launcher is safe whoever calls it. Every refusal throws
// std::runtime_error (a Python RuntimeError) naming the argument and what is expected.
//
// The Python layer (flashmla_backend/validate.py) checks the torch tensors first and explains shape
// errors in Python terms; these checks guard the integers it derived, and the kernels' own needs.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/check.h"
#include "params.h"

namespace flashmla_backend {

// What a kernel needs of one tensor's address and strides (elements). Defaults: nothing.
struct AccessRule {
  int align_bytes = 1;           // the base address is a multiple of this
  int stride_multiple = 1;       // every stride is a multiple of this many elements
  bool skip_unit_dims = false;   // strides of size-1 dimensions are never used (index 0): not checked
};

// What one kernel needs beyond the rules every caller shares.
struct DecodeRequirements {
  const char* kernel = "decode";  // names the kernel in messages
  bool pointers_set = false;      // every tensor pointer is non-null
  int min_num_pages = 0;
  uint32_t formats = 0;           // the KV formats the kernel reads (params.h: kv_format_bit); q_fp8 needs kFP8E4M3
  AccessRule q, kv, out, o_accum;  // o_accum: only its alignment is used (it is contiguous)
};

namespace detail {

inline bool is_aligned(const void* ptr, int bytes) { return reinterpret_cast<std::uintptr_t>(ptr) % bytes == 0; }

// One stride of a tensor: refused when it is not a multiple of rule.stride_multiple, unless the rule
// skips size-1 dimensions and this one has size 1 (pass size 0 for a stride that is always used).
inline void check_stride(const DecodeRequirements& req, const AccessRule& rule, const char* name, int64_t stride,
                         int64_t size) {
  if (rule.stride_multiple <= 1 || (rule.skip_unit_dims && size == 1)) return;
  FMLA_HOST_CHECK(stride % rule.stride_multiple == 0, req.kernel << ": " << name << " must be a multiple of "
                                                                 << rule.stride_multiple << " elements, got "
                                                                 << stride);
}

inline void check_address(const DecodeRequirements& req, const AccessRule& rule, const char* name, const void* ptr) {
  FMLA_HOST_CHECK(is_aligned(ptr, rule.align_bytes), req.kernel << ": " << name << " must be " << rule.align_bytes
                                                                << "-byte aligned, got address " << ptr);
}

}  // namespace detail

// Rules of every caller:
//  * dtype is a known code; kv_format a known code, one the kernel reads (req.formats), and a 16-bit one equal to
//    dtype; q_fp8 only with kFP8E4M3 and a bf16 output; the descales that FP8 needs are set, their strides >= 0;
//    batch, s_q, h_kv, num_sm_parts, max_pages_per_seq >= 1; h_q a multiple of h_kv;
//    num_pages >= req.min_num_pages (and >= 0);
//  * the DERIVED fields are what derive_decode_params() computes from the ARG fields;
//  * the launch grids fit: decode (num_m_blocks, h_kv, num_sm_parts), combine (.., h_kv, batch), so
//    h_kv, num_sm_parts and batch <= 65535.
// Then the kernel's own: non-null pointers, addresses and strides (req).
inline void check_decode_params(const DecodeParams& p, const DecodeRequirements& req) {
  const char* k = req.kernel;
  FMLA_HOST_CHECK(p.dtype == DType::kBF16 || p.dtype == DType::kFP16,
                  k << ": dtype must be 0 (bf16) or 1 (fp16), got " << static_cast<int>(p.dtype));
  FMLA_HOST_CHECK(p.batch >= 1, k << ": batch must be >= 1, got " << p.batch);
  FMLA_HOST_CHECK(p.seqlen_q >= 1, k << ": seqlen_q must be >= 1, got " << p.seqlen_q);
  FMLA_HOST_CHECK(p.num_heads_kv >= 1, k << ": num_heads_kv must be >= 1, got " << p.num_heads_kv);
  FMLA_HOST_CHECK(p.num_heads_q >= p.num_heads_kv && p.num_heads_q % p.num_heads_kv == 0,
                  k << ": num_heads_q must be a positive multiple of num_heads_kv (" << p.num_heads_kv << "), got "
                    << p.num_heads_q);
  FMLA_HOST_CHECK(p.num_sm_parts >= 1, k << ": num_sm_parts must be >= 1, got " << p.num_sm_parts);
  FMLA_HOST_CHECK(p.max_pages_per_seq >= 1, k << ": max_pages_per_seq must be >= 1, got " << p.max_pages_per_seq);
  FMLA_HOST_CHECK(p.num_pages >= 0 && p.num_pages >= req.min_num_pages,
                  k << ": num_pages must be >= " << (req.min_num_pages > 0 ? req.min_num_pages : 0) << ", got "
                    << p.num_pages);

  const int fmt = static_cast<int>(p.kv_format);
  FMLA_HOST_CHECK(fmt >= 0 && fmt < kNumKvFormats, k << ": kv_format must be a KvFormat code (0 bf16, 1 fp16, 2 "
                                                        "fp8_e4m3, 3 fp8_ds_mla), got "
                                                     << fmt);
  FMLA_HOST_CHECK((req.formats & kv_format_bit(p.kv_format)) != 0,
                  k << ": this kernel does not read the " << kv_format_name(p.kv_format) << " KV cache");
  FMLA_HOST_CHECK(
      !(p.kv_format == KvFormat::kBF16 || p.kv_format == KvFormat::kFP16) ||
          static_cast<int>(p.kv_format) == static_cast<int>(p.dtype),
      k << ": a 16-bit KV cache is q's dtype: kv_format " << kv_format_name(p.kv_format) << " with dtype "
        << static_cast<int>(p.dtype));
  const bool kv_e4m3 = p.kv_format == KvFormat::kFP8E4M3;
  FMLA_HOST_CHECK(!p.q_fp8 || kv_e4m3,
                  k << ": q_fp8 needs kv_format fp8_e4m3 (an FP8 q is only read against an FP8 KV cache)");
  FMLA_HOST_CHECK(!p.q_fp8 || p.dtype == DType::kBF16,
                  k << ": with q_fp8 the output dtype must be 0 (bf16), got " << static_cast<int>(p.dtype));
  FMLA_HOST_CHECK(!kv_e4m3 || p.descale_k != nullptr,
                  k << ": kv_format fp8_e4m3 needs descale_k (an fp32 tensor, [1] or [b, h_kv])");
  FMLA_HOST_CHECK(!p.q_fp8 || p.descale_q != nullptr, k << ": q_fp8 needs descale_q (an fp32 tensor, [1] or [b, h_kv])");
  FMLA_HOST_CHECK(!p.skip_combine || p.indices != nullptr,
                  k << ": skip_combine is for sparse decode (indices), whose schedule the caller computes on the host");
  FMLA_HOST_CHECK(p.descale_q_stride_b >= 0 && p.descale_q_stride_h >= 0 && p.descale_k_stride_b >= 0 &&
                      p.descale_k_stride_h >= 0,
                  k << ": descale strides must be >= 0 (0, 0 for a per-tensor scale), got descale_q ("
                    << p.descale_q_stride_b << ", " << p.descale_q_stride_h << "), descale_k (" << p.descale_k_stride_b
                    << ", " << p.descale_k_stride_h << ")");

  DecodeParams derived = p;
  derive_decode_params(derived);
  FMLA_HOST_CHECK(p.ngroups == derived.ngroups && p.q_rows == derived.q_rows &&
                      p.num_m_blocks == derived.num_m_blocks &&
                      std::memcmp(&p.scale_log2, &derived.scale_log2, sizeof(float)) == 0,  // NaN scale too
                  k << ": ngroups / q_rows / num_m_blocks / scale_log2 must be derive_decode_params()'s values (got "
                    << p.ngroups << " / " << p.q_rows << " / " << p.num_m_blocks << " / " << p.scale_log2
                    << ", expected " << derived.ngroups << " / " << derived.q_rows << " / " << derived.num_m_blocks
                    << " / " << derived.scale_log2 << ")");

  constexpr int kMaxGridYZ = 65535;
  FMLA_HOST_CHECK(p.num_heads_kv <= kMaxGridYZ, k << ": num_heads_kv must be <= 65535 (grid.y), got "
                                                  << p.num_heads_kv);
  FMLA_HOST_CHECK(p.num_sm_parts <= kMaxGridYZ, k << ": num_sm_parts must be <= 65535 (decode grid.z), got "
                                                  << p.num_sm_parts);
  FMLA_HOST_CHECK(p.batch <= kMaxGridYZ, k << ": batch must be <= 65535 (combine grid.z), got " << p.batch);

  if (req.pointers_set) {
    const struct {
      const char* name;
      const void* ptr;
    } pointers[] = {{"q", p.q},
                    {"q_pe", p.q_pe},
                    {"kv", p.kv},
                    {"block_table", p.block_table},
                    {"seqlens", p.seqlens},
                    {"sched_meta", p.sched_meta},
                    {"num_splits", p.num_splits},
                    {"out", p.out},
                    {"lse", p.lse},
                    {"lse_accum", p.lse_accum},
                    {"o_accum", p.o_accum}};
    for (const auto& ptr : pointers) FMLA_HOST_CHECK(ptr.ptr != nullptr, k << ": " << ptr.name << " must not be null");
  }

  detail::check_address(req, req.q, "q", p.q);
  detail::check_stride(req, req.q, "q_stride_b", p.q_stride_b, p.batch);
  detail::check_stride(req, req.q, "q_stride_s", p.q_stride_s, p.seqlen_q);
  detail::check_stride(req, req.q, "q_stride_h", p.q_stride_h, p.num_heads_q);
  detail::check_address(req, req.q, "q_pe", p.q_pe);
  detail::check_stride(req, req.q, "q_pe_stride_b", p.q_pe_stride_b, p.batch);
  detail::check_stride(req, req.q, "q_pe_stride_s", p.q_pe_stride_s, p.seqlen_q);
  detail::check_stride(req, req.q, "q_pe_stride_h", p.q_pe_stride_h, p.num_heads_q);
  // kv: the page and token strides are always checked (a TMA tensor map encodes them even for one page);
  // skip_unit_dims applies to the head stride only.
  detail::check_address(req, req.kv, "kv", p.kv);
  detail::check_stride(req, req.kv, "kv_stride_page", p.kv_stride_page, 0);
  detail::check_stride(req, req.kv, "kv_stride_token", p.kv_stride_token, 0);
  detail::check_stride(req, req.kv, "kv_stride_h", p.kv_stride_h, p.num_heads_kv);
  detail::check_address(req, req.out, "out", p.out);
  detail::check_stride(req, req.out, "out_stride_b", p.out_stride_b, p.batch);
  detail::check_stride(req, req.out, "out_stride_s", p.out_stride_s, p.seqlen_q);
  detail::check_stride(req, req.out, "out_stride_h", p.out_stride_h, p.num_heads_q);
  detail::check_address(req, req.o_accum, "o_accum", p.o_accum);
}

}  // namespace flashmla_backend
