"""`python -m flashmla_backend`: environment report and a decode demo checked against a second implementation.

On a supported GPU it runs one decode step (by default b=32, 4096 keys, h_q=128 and h_q=16, bf16, causal)
through the kernels, compares it with the pure-PyTorch reference and times it. Without one it runs the CPU
path of the public API (the reference) and compares it with an independent implementation, the naive
gather-matmul decode (flashmla_backend.reference.naive_mla_decode), on the same shapes; on the CPU the
shapes are capped so that the scores fit in CPU_MAX_SCORES elements (the output says so when it caps), and
nothing is timed (the output says so: only the kernels' times mean anything).
Exit status 0 when the relative error is below TOLERANCE, 1 otherwise; 2 for bad options.
"""
from __future__ import annotations

import argparse
import sys

import torch

import flashmla_backend as fb
from flashmla_backend import _ext
from flashmla_backend.geometry import HEAD_DIM_K, HEAD_DIM_V, PAGE_SIZE
from flashmla_backend.reference import mla_decode_reference, naive_mla_decode

TOLERANCE = 1e-2          # relative norm error of out (bf16 inputs: a few 1e-3 expected)
CPU_MAX_SCORES = 2 ** 25  # b * s_k * s_q * h_q on the CPU: ~128 MiB of fp32 scores, a few seconds


def make(b: int, n: int, s_q: int, h_q: int, dev: str):
    pages_per_req = -(-n // PAGE_SIZE)
    perm = torch.randperm(b * pages_per_req, device=dev)
    block_table = perm.view(b, pages_per_req).int()
    k_cache = torch.randn(b * pages_per_req, PAGE_SIZE, 1, HEAD_DIM_K, dtype=torch.bfloat16, device=dev)
    q = torch.randn(b, s_q, h_q, HEAD_DIM_K, dtype=torch.bfloat16, device=dev)
    seqlens = torch.full((b,), n, dtype=torch.int32, device=dev)
    return q, k_cache, block_table, seqlens


def cuda_version_text(version: int) -> str:
    """CUDA's integer version (1000 * major + 10 * minor, e.g. 13000, 12080) as 'major.minor' ('13.0', '12.8')."""
    return f"{version // 1000}.{version % 1000 // 10}"


def cpu_shapes(b: int, n: int, s_q: int, heads: list[int]) -> tuple[int, int, str]:
    """(batch, seqlen) to run on the CPU and, when they are capped, a sentence saying so and why."""
    per_key = s_q * max(heads)
    if b * n * per_key <= CPU_MAX_SCORES:
        return b, n, ""
    b2 = min(b, max(1, CPU_MAX_SCORES // per_key))
    n2 = max(1, min(n, CPU_MAX_SCORES // (b2 * per_key)))
    return b2, n2, (f"note: on the CPU, batch x seqlen x seqlen_q x heads is capped at {CPU_MAX_SCORES} scores "
                    f"(the reference and the naive decode hold every score in host memory, and take seconds at "
                    f"this size): running b={b2} s_k={n2} instead of b={b} s_k={n}")


def positive_int(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def head_counts(text: str) -> list[int]:
    parts = text.split(",")
    try:
        return [positive_int(p.strip()) for p in parts]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of positive integers (query heads), got {text!r}") from None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m flashmla_backend", description=__doc__,
                                 epilog=f"CPU_MAX_SCORES = {CPU_MAX_SCORES}, TOLERANCE = {TOLERANCE:g}",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=positive_int, default=32, metavar="B",
                    help="requests in the decode step (default: %(default)s)")
    ap.add_argument("--seqlen", type=positive_int, default=4096, metavar="N",
                    help="keys (cached tokens) per request (default: %(default)s)")
    ap.add_argument("--seqlen-q", type=positive_int, default=1, metavar="S",
                    help="query tokens per request, e.g. 2 with speculative decoding (default: %(default)s)")
    ap.add_argument("--heads", type=head_counts, default=[128, 16], metavar="H[,H...]",
                    help="query head counts to run, comma-separated, one KV head (default: 128,16)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="where to run: the GPU kernels (cuda), the CPU reference (cpu), or the GPU when one is "
                         "supported (auto, the default)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)

    print(f"flashmla_backend {fb.__version__}; torch {torch.__version__}")
    if _ext.available():
        C = _ext.ext()
        print(f"extension: {C.__file__} (targets {C.cuda_archs}, "
              f"CUDA runtime {cuda_version_text(C.cuda_runtime_version)}, "
              f"sm90 kernel {'yes' if C.sm90_compiled() else 'no'})")
    else:
        print("extension: not built (CPU reference only)")
        if torch.cuda.is_available():
            print(f"warning: {fb.__file__} has no compiled module; if flashmla_backend is installed, run this "
                  "from another folder (the source checkout shadows the installed package), or build in place "
                  "with `cmake -S . -B build -G Ninja && cmake --build build` (docs/build.md)", file=sys.stderr)
    ok, why = fb.is_supported()
    dev = args.device if args.device != "auto" else ("cuda" if ok else "cpu")
    if dev == "cuda" and not ok:
        print(f"error: cannot run on the GPU: {why}", file=sys.stderr)
        return 1
    print(f"GPU: {torch.cuda.get_device_name() + ', kernel ' + why if ok else why}")
    b, n, s_q = args.batch, args.seqlen, args.seqlen_q
    if dev == "cpu":
        b, n, note = cpu_shapes(b, n, s_q, args.heads)
        if note:
            print(note)
        print("on the CPU: the public API (the pure-PyTorch reference) against the naive gather-matmul decode")
    else:
        print("on the GPU: the kernels against the pure-PyTorch reference")
    torch.manual_seed(0)
    errors = []
    for h_q in args.heads:
        q, k_cache, bt, seqlens = make(b, n, s_q, h_q, dev)
        meta, ns = fb.get_mla_metadata(seqlens, s_q * h_q, 1)
        out, lse = fb.flash_mla_with_kvcache(q, k_cache, bt, seqlens, HEAD_DIM_V, meta, ns, causal=True)
        if dev == "cuda":
            other, name = mla_decode_reference(q, k_cache, bt, seqlens, HEAD_DIM_V, None, True), "reference"
        else:
            other, name = naive_mla_decode(q, k_cache, bt, seqlens, HEAD_DIM_V, n, causal=True), "naive decode"
        ref_out, ref_lse = other
        err = float((out.float() - ref_out.float()).norm() / ref_out.float().norm())
        lse_err = float((lse - ref_lse).abs().max())
        errors.append(err)
        line = (f"b={b} s_k={n} h_q={h_q} s_q={s_q} on {dev}: vs {name}: out rel err {err:.2e}, "
                f"lse max abs err {lse_err:.2e}")
        if dev == "cuda":
            for _ in range(3):
                fb.flash_mla_with_kvcache(q, k_cache, bt, seqlens, HEAD_DIM_V, meta, ns, causal=True)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            reps = 20
            start.record()
            for _ in range(reps):
                fb.flash_mla_with_kvcache(q, k_cache, bt, seqlens, HEAD_DIM_V, meta, ns, causal=True)
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) * 1000 / reps
            flops = 2 * h_q * s_q * b * n * (HEAD_DIM_K + HEAD_DIM_V)
            nbytes = b * n * HEAD_DIM_K * k_cache.element_size()
            line += f"; {us:.1f} us, {flops / us / 1e6:.0f} TFLOP/s, {nbytes / us / 1e3:.0f} GB/s"
        print(line, flush=True)
    if dev == "cpu":
        print("timed nothing: on the CPU the demo checks results only (it times the GPU kernels, not the reference)")
    bad = [e for e in errors if not e < TOLERANCE]  # (NaN fails too)
    if bad:
        print(f"error: relative error {bad[0]:.2e} is too large (tolerance {TOLERANCE:.0e})", file=sys.stderr)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
