#!/usr/bin/env python3
"""Split-count sweep of the decode: how the number of scheduler parts changes decode + combine time.

    python benchmarks/split_sweep.py [--shapes b1-sk8192-h128,b8-sk8192-h128] [--parts 11,16,22,33,66,132] \
        [--warmup 25] [--rep 100]

For each shape (the benchmark's shape syntax and input generator, benchmarks/mla_bench: one KV head,
bf16, causal, shuffled pages) and each part count P, the metadata is built with P parts
(flashmla_backend.ops._metadata_impl, the scheduler of get_mla_metadata, which uses P = SMs / m-tiles),
one decode call is captured in a CUDA graph, and the
median of its replays over `--rep` ms is printed (the benchmark's CUDA-event timer: L2 flushed before each
replay, after `--warmup` ms of warm-up), together with the device time per kernel (torch.profiler over 20 plain calls; with PDL the combine kernel's
time includes its wait for the decode kernel). "busy" counts the parts that received work.
Needs a Hopper or Ampere GPU and the built extension.
"""
from __future__ import annotations

import argparse

import torch
from mla_bench import capture_graphs, make_inputs, make_seqlens, parse_shapes, time_with_events
from mla_bench.timing import kernel_times

import flashmla_backend as fb
from flashmla_backend import ops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="b1-sk8192-h128,b8-sk8192-h128", help="comma-separated benchmark shapes")
    ap.add_argument("--parts", default="11,16,22,33,66,132", help="part counts to try (the default count is added)")
    ap.add_argument("--warmup", type=float, default=25.0, help="warm-up per part count in ms (default 25)")
    ap.add_argument("--rep", type=float, default=100.0, help="timed replays per part count in ms (default 100)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("split_sweep.py needs a CUDA GPU")
    dev = torch.device("cuda")
    for shape in parse_shapes(args.shapes):
        seqlens = make_seqlens(shape, 0)
        inp = make_inputs(shape, seqlens, torch.bfloat16, dev, seed=0, copies=1)[0]
        q, kc, table = inp.q, inp.k_cache, inp.block_table
        lens = torch.tensor(seqlens, dtype=torch.int32, device=dev)
        default_parts = fb.get_mla_metadata(lens, shape.s_q * shape.h_q, 1)[0].shape[0]
        for parts in sorted({default_parts, *(int(x) for x in args.parts.split(","))}):
            meta, splits = ops._metadata_impl(lens, parts)

            def call():
                return fb.flash_mla_with_kvcache(q, kc, table, lens, 512, meta, splits, causal=True)

            timing = time_with_events(capture_graphs([call])[0], args.warmup, args.rep)
            busy = int((meta[:, 0] <= meta[:, 2]).sum())
            kernels = ", ".join(f"{k} {v:.1f}" for k, v in kernel_times(call).items())
            mark = " (default)" if parts == default_parts else ""
            print(f"{shape.name}: parts {parts}{mark}, busy {busy}, splits {int(splits[-1])}: graph median "
                  f"{timing.median_us:.1f} us; kernels (us): {kernels}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
