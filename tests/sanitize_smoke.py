"""Small-shape run of every GPU kernel (the 16-bit decode of each kernel; on sm_90a also the FP8-cache decode with
bf16 q, fp16 q and e4m3 q, and the sparse decode on fp8_ds_mla caches), for compute-sanitizer (memcheck, racecheck,
synccheck):

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 python tests/sanitize_smoke.py

(without the caching allocator every tensor is its own allocation, so memcheck sees any read past
one). Exits non-zero if a kernel's result differs from the reference.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import flashmla_backend as fb  # noqa: E402
from flashmla_backend import _ext, device, kv_format  # noqa: E402
from flashmla_backend.reference import mla_decode_reference  # noqa: E402
from fp8kit import ACCURATE_LSE, dequantized, fp8_inputs, out_tolerance, rel_norm, run_fp8_decode  # noqa: E402
from kit import D_V, PAGE, Case, brute_force_fp64, compare, make_inputs  # noqa: E402
from sparsekit import SparseCase, make_sparse_inputs, naive_sparse_fp64  # noqa: E402

CASES = [
    Case(lengths=[1, PAGE - 1, PAGE, PAGE + 1, 2 * PAGE, 2 * PAGE + 1, 3 * PAGE, 4 * PAGE, 4 * PAGE + 1], s_q=1,
         h_q=64, causal=False),
    Case(lengths=[0, 1, 65, 140], s_q=1, h_q=16),
    Case(lengths=[63, 200], s_q=2, h_q=128, h_kv=2),
    Case(lengths=[3, PAGE], s_q=4, h_q=20, causal=True),
    Case(lengths=[130, 9], s_q=1, h_q=64, causal=False, dtype=torch.float16),
    Case(lengths=[5000], s_q=1, h_q=16),  # one request in many splits: the splits-in-parallel combine
]

# FP8 cache (sm_90a only): empty requests, page edges, two KV heads with s_q 2, one request in many splits, 32 query
# rows over 16 requests (the accurate mode's stacked Q tile, P V on e4m3 tensor cores; with
# FLASHMLA_BACKEND_FP8_DEBUG=16384 its fp16 P V form with 3 KV stages, chosen from 8 (request, KV head) pairs on, and
# with 16384 + 256 that form's 2-stage plan; every tile at every row count with 512 + 16), and two and
# four M tiles of h_q 128 whose pairs see the same keys (the fast mode's 2-CTA cluster plans with
# FLASHMLA_BACKEND_FP8_DEBUG=8, the shared transposition, at two tiles, and 8192, the multicast copies, at both).
FP8_CASES = [
    Case(lengths=[0, 1, 65, 140], s_q=1, h_q=16),
    Case(lengths=[(37 * i) % 300 for i in range(16)], s_q=1, h_q=32),
    Case(lengths=[63, 200], s_q=2, h_q=128, h_kv=2),
    Case(lengths=[3000], s_q=1, h_q=16),
    Case(lengths=[0, 65, 700], s_q=1, h_q=128),
    Case(lengths=[1, 64, 300], s_q=2, h_q=128),
]
# Sparse decode (sm_90a only): skipped entries of every kind, a cut row and an empty one, heads padded to the M tile,
# pages of one token; NaN in every slot no counted entry names.
SPARSE_CASES = [
    SparseCase(b=3, s_q=2, h_q=128, topk=200, num_pages=8, topk_length=[200, 77, 0], sink=True, seed=30),
    SparseCase(b=2, s_q=1, h_q=16, topk=40, page_size=1, num_pages=150, skipped=0.5, seed=31),
    SparseCase(b=48, s_q=3, h_q=64, topk=130, num_pages=6, topk_length=[(37 * i) % 131 for i in range(48)], seed=32),
]
FP8_MODES = {"bf16 q": (torch.bfloat16, False), "fp16 q": (torch.float16, False), "e4m3 q": (torch.bfloat16, True)}


def run_fp8(case: Case, mode: str) -> dict:
    """One FP8 case against fp64 on the dequantized inputs, with test_fp8_gpu.py's bounds."""
    q_dtype, q_fp8 = FP8_MODES[mode]
    case = Case(**{**case.__dict__, "dtype": q_dtype})
    inp, dq, dk = fp8_inputs(case, "cuda", q_fp8=q_fp8)
    out, lse = run_fp8_decode(inp, case, dq, dk)
    ref_out, ref_lse = brute_force_fp64(dequantized(inp, dq, dk), case.causal)
    figures = {"out_rel_norm": rel_norm(out, ref_out), "lse_rel_norm": rel_norm(lse, ref_lse)}
    assert figures["out_rel_norm"] < out_tolerance(q_fp8), f"out {figures}"
    assert figures["lse_rel_norm"] < ACCURATE_LSE, f"lse {figures}"
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(ref_lse.cpu())), "rows without keys differ"
    return figures


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    kernels = ["portable"] + (["sm90"] if device.device_props(0).major == 9 and _ext.ext().sm90_compiled() else [])
    failures = 0
    for kernel in kernels:
        os.environ[device.KERNEL_ENV] = kernel
        for case in CASES:
            inp = make_inputs(case, "cuda")
            meta, ns = fb.get_mla_metadata(inp.cache_seqlens, case.s_q * case.h_q // case.h_kv, case.h_kv)
            out, lse = fb.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta,
                                                 ns, softmax_scale=inp.scale, causal=case.causal)
            ref = mla_decode_reference(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, inp.scale,
                                       case.causal)
            try:
                figures = compare(out, lse, *ref, case.lengths, case.s_q, case.causal)
            except AssertionError as e:
                failures += 1
                print(f"{kernel:8s} {case}: FAIL {e}", flush=True)
                continue
            print(f"{kernel:8s} {case}: ok {figures}", flush=True)
    for fp8_kernel in [k for k in kernels if k in kv_format.FP8_E4M3.dense_kernels]:
        os.environ[device.KERNEL_ENV] = fp8_kernel
        for case in FP8_CASES:
            for mode in FP8_MODES:
                try:
                    figures = run_fp8(case, mode)
                except AssertionError as e:
                    failures += 1
                    print(f"{fp8_kernel} fp8 {mode} {case}: FAIL {e}", flush=True)
                    continue
                print(f"{fp8_kernel} fp8 {mode} {case}: ok {figures}", flush=True)
    if "sm90" in kernels:
        from test_sparse_gpu import LSE_ATOL, OUT_MAX_REL, OUT_REL_NORM
        for case in SPARSE_CASES:
            inp = make_sparse_inputs(case)
            meta, _ = fb.get_mla_metadata()
            out, lse = fb.flash_mla_with_kvcache(
                inp.q.cuda(), inp.k_cache.cuda(), None, None, D_V, meta, None, softmax_scale=inp.scale,
                is_fp8_kvcache=True, indices=inp.indices.cuda(),
                topk_length=None if inp.topk_length is None else inp.topk_length.cuda(),
                attn_sink=None if inp.attn_sink is None else inp.attn_sink.cuda())
            try:
                figures = compare(out, lse, *naive_sparse_fp64(inp), [], case.s_q, False, out_rel_norm=OUT_REL_NORM,
                                  out_max_rel=OUT_MAX_REL, lse_atol=LSE_ATOL, lse_rtol=0.0)
            except AssertionError as e:
                failures += 1
                print(f"sm90 sparse {case}: FAIL {e}", flush=True)
                continue
            print(f"sm90 sparse {case}: ok {figures}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
