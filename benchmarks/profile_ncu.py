"""Nsight Compute profile of the decode kernels on the main benchmark shapes (what limits each).

    ncu --target-processes all -k regex:"decode_kernel|combine_kernel" --section SpeedOfLight \
        --section WarpStateStats --section Occupancy --csv python benchmarks/profile_ncu.py [shapes...]

Runs each shape once per kernel (FLASHMLA_BACKEND_KERNEL=sm90 and portable unless --kernels says
otherwise) after a warm-up outside the profiled range (ncu profiles every matching launch, so the
script launches each configuration exactly twice: warm-up, then the profiled run; use
--launch-skip/--launch-count or look at the second row per shape). Shapes use the benchmark's syntax.
With --impls ours,flashmla it also runs vLLM's bundled FlashMLA on the same inputs (its kernels are
named flash_fwd_splitkv_mla_kernel / flash_fwd_mla_combine_kernel: add them to ncu's -k regex).
"""
import argparse
import os

import torch
from mla_bench import make_inputs, make_seqlens, parse_shapes

import flashmla_backend as fb
from flashmla_backend import device


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["b128-sk8192-h128-sq1", "b128-sk8192-h16-sq1", "b1-sk8192-h128-sq1"])
    ap.add_argument("--kernels", default="sm90")
    ap.add_argument("--impls", default="ours", help="ours, flashmla (vLLM's bundled FlashMLA) or both")
    args = ap.parse_args()
    impls = args.impls.split(",")
    for shape in parse_shapes(",".join(args.shapes)):
        lens = make_seqlens(shape, 0)
        inp = make_inputs(shape, lens, torch.bfloat16, torch.device("cuda"), seed=0, copies=1)[0]
        q, cache, table = inp.q, inp.k_cache, inp.block_table
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        if "flashmla" in impls:
            from vllm.third_party.flashmla import flash_mla_interface as fmi

            sched, _ = fmi.get_mla_metadata()
            for _ in range(2):
                fmi.flash_mla_with_kvcache(q, cache, table, seqlens, 512, sched, None, causal=True)
            torch.cuda.synchronize()
            print(f"profiled {shape.name} with vLLM's FlashMLA", flush=True)
        if "ours" not in impls:
            continue
        meta, ns = fb.get_mla_metadata(seqlens, shape.s_q * shape.h_q, 1)
        for kernel in args.kernels.split(","):
            os.environ[device.KERNEL_ENV] = kernel
            for _ in range(2):
                fb.flash_mla_with_kvcache(q, cache, table, seqlens, 512, meta, ns, causal=True)
            torch.cuda.synchronize()
            print(f"profiled {shape.name} with {kernel}", flush=True)


if __name__ == "__main__":
    main()
