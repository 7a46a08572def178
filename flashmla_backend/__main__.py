"""`python -m flashmla_backend`: environment report and a decode demo checked against the reference.

On a supported GPU it runs one decode step (b=32, 4096 keys, h_q=128 and h_q=16, bf16, causal),
compares it with the pure-PyTorch reference and times it; elsewhere it runs the CPU reference path.
Options: --batch, --seqlen, --heads (comma list), --seqlen-q, --device cpu|cuda.
"""
from __future__ import annotations

import argparse
import sys

import torch

import flashmla_backend as fb
from flashmla_backend import _ext
from flashmla_backend.reference import mla_decode_reference


def make(b: int, n: int, s_q: int, h_q: int, dev: str):
    pages_per_req = -(-n // 64)
    perm = torch.randperm(b * pages_per_req, device=dev)
    block_table = perm.view(b, pages_per_req).int()
    k_cache = torch.randn(b * pages_per_req, 64, 1, 576, dtype=torch.bfloat16, device=dev)
    q = torch.randn(b, s_q, h_q, 576, dtype=torch.bfloat16, device=dev)
    seqlens = torch.full((b,), n, dtype=torch.int32, device=dev)
    return q, k_cache, block_table, seqlens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashmla_backend", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--seqlen-q", type=int, default=1)
    ap.add_argument("--heads", default="128,16")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = ap.parse_args(argv)

    print(f"flashmla_backend {fb.__version__}; torch {torch.__version__}")
    if _ext.available():
        C = _ext.ext()
        print(f"extension: {C.__file__} (targets {C.cuda_archs}, CUDA runtime {C.cuda_runtime_version}, "
              f"sm90 kernel {'yes' if C.sm90_compiled() else 'no'})")
    else:
        print("extension: not built (CPU reference only)")
        if torch.cuda.is_available():
            print(f"warning: {fb.__file__} has no compiled module; if flashmla_backend is installed, run this "
                  "from another folder (the source checkout shadows the installed package), or build in place "
                  "with `python setup.py build_ext --inplace`", file=sys.stderr)
    ok, why = fb.is_supported()
    dev = args.device if args.device != "auto" else ("cuda" if ok else "cpu")
    if dev == "cuda" and not ok:
        print(f"error: cannot run on the GPU: {why}", file=sys.stderr)
        return 1
    print(f"GPU: {torch.cuda.get_device_name() + ', kernel ' + why if ok else why}")
    b, n, s_q = (args.batch, args.seqlen, args.seqlen_q) if dev == "cuda" else (2, min(args.seqlen, 300), args.seqlen_q)
    torch.manual_seed(0)
    worst = 0.0
    for h_q in (int(h) for h in args.heads.split(",")):
        q, k_cache, bt, seqlens = make(b, n, s_q, h_q, dev)
        meta, ns = fb.get_mla_metadata(seqlens, s_q * h_q, 1)
        out, lse = fb.flash_mla_with_kvcache(q, k_cache, bt, seqlens, 512, meta, ns, causal=True)
        ref_out, ref_lse = mla_decode_reference(q, k_cache, bt, seqlens, 512, None, True)
        err = float((out.float() - ref_out.float()).norm() / ref_out.float().norm())
        lse_err = float((lse - ref_lse).abs().max())
        worst = max(worst, err)
        line = f"b={b} s_k={n} h_q={h_q} s_q={s_q} on {dev}: out rel err {err:.2e}, lse max abs err {lse_err:.2e}"
        if dev == "cuda":
            for _ in range(3):
                fb.flash_mla_with_kvcache(q, k_cache, bt, seqlens, 512, meta, ns, causal=True)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            reps = 20
            start.record()
            for _ in range(reps):
                fb.flash_mla_with_kvcache(q, k_cache, bt, seqlens, 512, meta, ns, causal=True)
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) * 1000 / reps
            flops = 2 * h_q * s_q * b * n * (576 + 512)
            nbytes = b * n * 576 * 2
            line += f"; {us:.1f} us, {flops / us / 1e6:.0f} TFLOP/s, {nbytes / us / 1e3:.0f} GB/s"
        print(line, flush=True)
    if worst > 1e-2:
        print(f"error: relative error {worst:.2e} is too large", file=sys.stderr)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
