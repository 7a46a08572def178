#!/usr/bin/env python3
"""What concatenating the decode query costs next to the decode itself, and what reading it in two parts costs.

    python benchmarks/q_parts_cost.py [--batch 128] [--heads 128] [--seqlens 1024,4096,8192] [--kv-dtype bf16,fp8]

vLLM hands an MLA decode backend q as two tensors, ql_nope [T, N, 512] (the transposed output of its batched
up-projection: head-major in memory) and q_pe [T, N, 64] (a slice of the projected query). A backend that needs
one [T, N, 576] tensor concatenates them in every layer; flash_mla_with_kvcache(..., q_pe=) reads both in place.
For each context length this times, as CUDA-graph replays (triton.testing.do_bench medians, random data, causal,
page 64, every request at the full length), on the same inputs:
  cat        torch.cat((ql_nope, q_pe), -1): the copy a one-tensor API needs per layer
  one q      decode with the concatenated q
  two parts  decode with q=ql_nope, q_pe=q_pe (no copy)
and prints cat / (one q), the share of the decode step the copy adds, and (two parts) / (one q).
Needs a CUDA GPU and the compiled module (sm_90a for --kv-dtype fp8).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mla_bench.timing import capture_graphs, pick_timer  # noqa: E402

import flashmla_backend as fb  # noqa: E402
from flashmla_backend.geometry import HEAD_DIM_K, HEAD_DIM_V, PAGE_SIZE, ROPE_DIM  # noqa: E402

FP8 = torch.float8_e4m3fn


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--seqlens", default="1024,4096,8192", help="context lengths, comma-separated")
    ap.add_argument("--kv-dtype", default="bf16,fp8", help="bf16 and/or fp8 (e4m3 cache, bf16 q: the accurate mode)")
    ap.add_argument("--warmup-ms", type=float, default=50)
    ap.add_argument("--rep-ms", type=float, default=300)
    args = ap.parse_args(argv)
    args.seqlens = [int(x) for x in args.seqlens.split(",") if x]
    args.kv_dtype = [x.strip() for x in args.kv_dtype.split(",") if x.strip()]
    bad = [x for x in args.kv_dtype if x not in ("bf16", "fp8")]
    if bad or not args.kv_dtype:
        ap.error(f"--kv-dtype takes bf16 and/or fp8, got {args.kv_dtype}")
    if args.batch < 1 or args.heads < 1 or not args.seqlens or min(args.seqlens) < 1:
        ap.error("--batch, --heads and every --seqlens value must be positive")
    return args


def inputs(b: int, h: int, seqlen: int, kv_dtype: str, gen: torch.Generator):
    dev = torch.device("cuda")
    pages = -(-seqlen // PAGE_SIZE)
    cache = torch.randn((b * pages, PAGE_SIZE, 1, HEAD_DIM_K), generator=gen, device=dev) / 4
    descale_k = None
    if kv_dtype == "fp8":
        descale_k = (cache.abs().amax() / 448).reshape(1).float()
        cache = (cache / descale_k).to(FP8)
    else:
        cache = cache.to(torch.bfloat16)
    table = torch.randperm(b * pages, generator=gen, device=dev).to(torch.int32).reshape(b, pages)
    lens = torch.full((b,), seqlen, dtype=torch.int32, device=dev)
    # vLLM's layout: ql_nope = bmm output [N, T, 512] transposed; q_pe = a slice of q [T, N, 192].
    ql_nope = torch.randn((h, b, HEAD_DIM_V), generator=gen, device=dev).to(torch.bfloat16).transpose(0, 1)
    q_pe = torch.randn((b, h, 128 + ROPE_DIM), generator=gen, device=dev).to(torch.bfloat16)[..., 128:]
    return ql_nope, q_pe, cache, table, lens, descale_k


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("q_parts_cost: needs a CUDA GPU", file=sys.stderr)
        return 2
    timer = pick_timer()
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, h = args.batch, args.heads
    print(f"q_parts_cost: {torch.cuda.get_device_name()}, b={b}, h_q={h}, s_q=1, graph replays, {timer.__name__}",
          flush=True)
    header = f"{'kv':<5}{'seqlen':>7}{'cat us':>9}{'one q us':>10}{'two parts us':>14}{'cat/one':>9}{'two/one':>9}"
    rows = []
    for kv_dtype in args.kv_dtype:
        for seqlen in args.seqlens:
            ql_nope, q_pe, cache, table, lens, descale_k = inputs(b, h, seqlen, kv_dtype, gen)
            meta, splits = fb.get_mla_metadata(lens, h, 1)
            q_one = torch.cat((ql_nope, q_pe), dim=-1)

            def decode(q, pe):
                return fb.flash_mla_with_kvcache(q.unsqueeze(1), cache, table, lens, HEAD_DIM_V, meta, splits,
                                                 softmax_scale=0.1, causal=True, descale_k=descale_k,
                                                 q_pe=None if pe is None else pe.unsqueeze(1))

            calls = [lambda: torch.cat((ql_nope, q_pe), dim=-1), lambda: decode(q_one, None),
                     lambda: decode(ql_nope, q_pe)]
            one_out = decode(q_one, None)[0]
            two_out = decode(ql_nope, q_pe)[0]
            if not torch.equal(one_out, two_out):
                print(f"q_parts_cost: the two-part decode differs from the one-q decode ({kv_dtype}, {seqlen})",
                      file=sys.stderr)
                return 1
            cat_us, one_us, two_us = (timer(g, args.warmup_ms, args.rep_ms).median_us for g in capture_graphs(calls))
            rows.append(f"{kv_dtype:<5}{seqlen:>7}{cat_us:>9.1f}{one_us:>10.1f}{two_us:>14.1f}"
                        f"{cat_us / one_us:>9.3f}{two_us / one_us:>9.3f}")
            print(f"  {kv_dtype} seqlen {seqlen}: cat {cat_us:.1f} us, one q {one_us:.1f} us, two parts {two_us:.1f} us",
                  flush=True)
    print(header)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
