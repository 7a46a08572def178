"""Nsight Compute profile of the decode kernels on the main benchmark shapes (what limits each).

    ncu --target-processes all -k regex:"decode_kernel|combine_kernel" --section SpeedOfLight \
        --section WarpStateStats --section Occupancy --csv python benchmarks/profile_ncu.py [shapes...]

Runs each shape once per kernel (FLASHMLA_BACKEND_KERNEL=sm90 and portable unless --kernels says
otherwise) after a warm-up outside the profiled range (ncu profiles every matching launch, so the
script launches each configuration exactly twice: warm-up, then the profiled run; use
--launch-skip/--launch-count or look at the second row per shape). Shapes use the benchmark's syntax.
With --impls ours,flashmla it also runs vLLM's bundled FlashMLA on the same inputs (its kernels are
named flash_fwd_splitkv_mla_kernel / flash_fwd_mla_combine_kernel: add them to ncu's -k regex).

--kv-dtype fp8: the same shapes on the e4m3 cache (per-tensor descales, the benchmark's quantization), ours in each
mode of --fp8-modes (accurate: the bf16 q; fast: the e4m3 q), one configuration after the other, and with
--impls flashmla vLLM's FlashMLA-FP8 (flash_mla_with_kvcache_fp8, from vLLM 0.26 or a package of its FlashMLA alone
on PYTHONPATH). Our FP8 kernel is sm90_fp8_decode_kernel (`-k regex:"fp8_decode|combine"`); a source-level profile
of one mode reads best with `--fp8-modes accurate` alone and `ncu --set full --import-source no`, then
benchmarks/ncu_source_summary.py on the CSV of `--page source`.
"""
import argparse
import os

import torch
from mla_bench import make_inputs, make_seqlens, parse_shapes

import flashmla_backend as fb
from flashmla_backend import device

FP8_MODES = ("accurate", "fast")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="*", default=["b128-sk8192-h128-sq1", "b128-sk8192-h16-sq1", "b1-sk8192-h128-sq1"])
    ap.add_argument("--kernels", default="sm90", help="16-bit cache: comma-separated sm90, portable (default sm90)")
    ap.add_argument("--impls", default="ours", help="ours, flashmla (vLLM's bundled FlashMLA) or both")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16",
                    help="bf16 (default) or fp8: the e4m3 cache, ours in --fp8-modes and FlashMLA-FP8")
    ap.add_argument("--fp8-modes", default="accurate,fast",
                    help="with --kv-dtype fp8: comma-separated accurate (bf16 q), fast (e4m3 q); default both")
    args = ap.parse_args(argv)
    args.impls = [x for x in args.impls.split(",") if x]
    if not args.impls or any(x not in ("ours", "flashmla") for x in args.impls):
        ap.error(f"--impls: choose from ours, flashmla (got {args.impls})")
    args.fp8_modes = [x for x in args.fp8_modes.split(",") if x]
    if not args.fp8_modes or any(x not in FP8_MODES for x in args.fp8_modes):
        ap.error(f"--fp8-modes: choose from {', '.join(FP8_MODES)} (got {args.fp8_modes})")
    return args


def profile_bf16(shape, args) -> None:
    lens = make_seqlens(shape, 0)
    inp = make_inputs(shape, lens, torch.bfloat16, torch.device("cuda"), seed=0, copies=1)[0]
    q, cache, table = inp.q, inp.k_cache, inp.block_table
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    if "flashmla" in args.impls:
        from vllm.third_party.flashmla import flash_mla_interface as fmi

        sched, _ = fmi.get_mla_metadata()
        for _ in range(2):
            fmi.flash_mla_with_kvcache(q, cache, table, seqlens, 512, sched, None, causal=True)
        torch.cuda.synchronize()
        print(f"profiled {shape.name} with vLLM's FlashMLA", flush=True)
    if "ours" not in args.impls:
        return
    meta, ns = fb.get_mla_metadata(seqlens, shape.s_q * shape.h_q, 1)
    for kernel in args.kernels.split(","):
        os.environ[device.KERNEL_ENV] = kernel
        for _ in range(2):
            fb.flash_mla_with_kvcache(q, cache, table, seqlens, 512, meta, ns, causal=True)
        torch.cuda.synchronize()
        print(f"profiled {shape.name} with {kernel}", flush=True)


def profile_fp8(shape, args) -> None:
    from mla_bench.impls import find_vllm_fp8_module
    from mla_bench.shapes import D_V, one_fp8_case

    _, inp, f8, lens = one_fp8_case(shape, torch.device("cuda"))
    rows = shape.s_q * shape.h_q
    if "flashmla" in args.impls:
        mod = find_vllm_fp8_module()
        sched, splits = mod.get_mla_metadata_dense_fp8(lens, rows, 1)
        for _ in range(2):
            mod.flash_mla_with_kvcache_fp8(f8.q, f8.k_cache, inp.block_table, lens, D_V, sched, splits, causal=True,
                                           descale_q=f8.descale_q, descale_k=f8.descale_k)
        torch.cuda.synchronize()
        print(f"profiled {shape.name} with vLLM's FlashMLA-FP8", flush=True)
    if "ours" not in args.impls:
        return
    for mode in args.fp8_modes:
        q, dq = (f8.q, f8.descale_q) if mode == "fast" else (inp.q, None)
        meta, ns = fb.get_mla_metadata(lens, rows, 1, is_fp8_kvcache=True)
        for _ in range(2):
            fb.flash_mla_with_kvcache(q, f8.k_cache, inp.block_table, lens, D_V, meta, ns, causal=True,
                                      is_fp8_kvcache=True, descale_q=dq, descale_k=f8.descale_k)
        torch.cuda.synchronize()
        print(f"profiled {shape.name} with our FP8 kernel, {mode} mode", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    for shape in parse_shapes(",".join(args.shapes)):
        (profile_fp8 if args.kv_dtype == "fp8" else profile_bf16)(shape, args)


if __name__ == "__main__":
    main()
