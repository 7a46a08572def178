"""Command line of the MLA decode benchmark: `python benchmarks/bench.py [options]` (benchmarks/README.md).

Measures the copy and matmul ceilings, then every shape x implementation, and writes results.json,
results.csv, results.md and roofline.png under --out-dir; prints the markdown table at the end.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import sys
from typing import Optional, Sequence

import torch

from . import flashinfer_peer
from .impls import ALL_IMPLS, FP8_IMPLS, kv_kind
from .report import collect_environment, markdown_report, write_outputs
from .run import Config, log, run_shape
from .shapes import DEFAULT_L2_BYTES, DEFAULT_SHAPES, DTYPES, QUICK_SHAPES, SHAPE_SYNTAX, Shape, parse_shapes
from .power import PowerUnavailable, open_monitor
from .timing import TIMER_NAMES, measure_ceilings, pick_timer, with_power

PROG = "python benchmarks/bench.py"


def command_line(argv: Optional[Sequence[str]]) -> str:
    if argv is None:
        return shlex.join(getattr(sys, "orig_argv", sys.argv))
    return shlex.join([*PROG.split(), *argv])


def _arg_shapes(text: str) -> list[Shape]:
    try:
        return parse_shapes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


ALL = "all"


def _arg_impls(text: str) -> list[str]:
    """The implementations named, in run order; ['all'] for 'all' (resolved with --kv-dtype in parse_args)."""
    names = [t for t in re.split(r"[,\s]+", text.strip().lower()) if t]
    if not names:
        raise argparse.ArgumentTypeError("empty implementation list")
    if names == [ALL]:
        return [ALL]
    bad = [n for n in names if n not in ALL_IMPLS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown implementation(s) {', '.join(map(repr, bad))}; "
                                         f"choose from {', '.join(ALL_IMPLS)} or 'all'")
    return [i for i in ALL_IMPLS if i in names]     # run order: ours first (others are compared with it)


KV_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
             "fp8": "fp8", "e4m3": "fp8", "fp8_e4m3": "fp8", "float8_e4m3fn": "fp8"}


def _arg_kv_dtypes(text: str) -> list[str]:
    items = [t for t in re.split(r"[,\s]+", text.strip().lower()) if t]
    if not items:
        raise argparse.ArgumentTypeError("empty KV dtype list")
    bad = [t for t in items if t not in KV_DTYPES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown KV dtype(s) {', '.join(map(repr, bad))}; choose from bf16, fp16 "
                                         "(the --dtype cache) and fp8 (e4m3)")
    names = [KV_DTYPES[t] for t in items]
    return [d for d in ("bf16", "fp16", "fp8") if d in names]


def resolve_impls(impls: Optional[list[str]], kv_dtypes: Optional[list[str]], dtype16: str
                  ) -> tuple[list[str], list[str]]:
    """(implementations to run, KV dtypes) from --impls, --kv-dtype and the 16-bit --dtype; ValueError names
    the conflict. Without --kv-dtype: the KV dtypes of the implementations named, or the 16-bit cache alone for
    'all' / the default. 'all' means every implementation of the KV dtypes chosen."""
    explicit = impls is not None and impls != [ALL]
    for d in kv_dtypes or []:
        if d not in ("fp8", dtype16):
            raise ValueError(f"argument --kv-dtype: a {d} cache needs --dtype {d} (the 16-bit cache, q and out "
                             f"are in --dtype, now {dtype16})")
    if kv_dtypes is None:
        kinds = {kv_kind(i) for i in impls} if explicit else {"16bit"}
        kv_dtypes = [d for d, k in ((dtype16, "16bit"), ("fp8", "fp8")) if k in kinds]
    kinds = {"fp8" if d == "fp8" else "16bit" for d in kv_dtypes}
    if explicit:
        off = [i for i in impls if kv_kind(i) not in kinds]
        if off:
            raise ValueError(f"argument --impls: {', '.join(off)} need(s) a "
                             f"{'fp8' if kv_kind(off[0]) == 'fp8' else dtype16} cache, not in --kv-dtype "
                             f"{','.join(kv_dtypes)}")
        return list(impls), kv_dtypes
    return [i for i in ALL_IMPLS if kv_kind(i) in kinds], kv_dtypes


def _arg_positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return v


def _arg_seed(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return v


def _arg_splits(text: str) -> list[int]:
    items = [t for t in re.split(r"[,\s]+", text.strip()) if t]
    try:
        values = [int(t) for t in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 4,8,16") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: split counts must be >= 1")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Benchmark MLA decode: flashmla_backend against vLLM's FlashMLA, Triton MLA, FA3 MLA, "
                    "FlashInfer's Hopper MLA (when present) and a naive PyTorch decode, with measured "
                    "copy-bandwidth and matmul ceilings.")
    p.add_argument("--shapes", type=_arg_shapes, default=None,
                   help=f"comma-separated shapes, each {SHAPE_SYNTAX} (default: the main serving shapes "
                        "and a few more sizes; with --quick: three small shapes)")
    p.add_argument("--impls", type=_arg_impls, default=None,
                   help=f"comma-separated subset of {','.join(ALL_IMPLS)}, or 'all' (default: all of the KV "
                        f"dtypes chosen; {','.join(FP8_IMPLS)} read the e4m3 cache)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="q/out dtype, and that of the 16-bit KV cache (default bf16)")
    p.add_argument("--kv-dtype", type=_arg_kv_dtypes, default=None,
                   help="comma-separated KV cache dtypes: the 16-bit one (= --dtype) and/or fp8 (e4m3, quantized "
                        "from the same data); default: those of the --impls named, else the 16-bit one")
    p.add_argument("--no-causal", dest="causal", action="store_false", help="non-causal (default causal)")
    p.add_argument("--warmup", type=_arg_positive_float, default=None,
                   help="warm-up per measurement in ms, as do_bench's warmup (default 25; 5 with --quick)")
    p.add_argument("--rep", type=_arg_positive_float, default=None,
                   help="timed duration per measurement in ms, as do_bench's rep (default 100; 20 with --quick)")
    p.add_argument("--graph", action="store_true",
                   help="also time CUDA-graph replays of one captured call (rows with mode=graph)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: small shapes, short warm-up/rep, Triton with vLLM's split count only")
    p.add_argument("--out-dir", default="bench-results", help="output folder (default ./bench-results)")
    p.add_argument("--seed", type=_arg_seed, default=0, help="random seed for lengths and data (default 0)")
    p.add_argument("--triton-splits", type=_arg_splits, default=None,
                   help="num_kv_splits values tried for vLLM's Triton kernel, best kept; vLLM's own choice is "
                        "always added (default 4,8,16,32; none with --quick)")
    p.add_argument("--flashinfer-dir", default=None,
                   help="folder of a prebuilt FlashInfer bundle (site.tar.xz) for the flashinfer rows when "
                        "flashinfer is not importable (default: $FLASHMLA_BENCH_FLASHINFER_DIR, else "
                        ".peers/flashinfer in this checkout); without either, those rows say unavailable")
    p.add_argument("--max-rotation-gib", type=_arg_positive_float, default=4.0,
                   help="cap on the memory of the rotated input copies, GiB (default 4)")
    p.add_argument("--power", action="store_true",
                   help="record each timing window's average power, SM clock and share of samples with the clock "
                        "lowered by power or heat (NVML: needs nvidia-ml-py); columns watts, sm_mhz, sm_mhz_min, "
                        "clock_capped. The board's energy counter moves in steps: windows under a few hundred ms "
                        "(--rep) may get no power reading")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        parser.error(f"--out-dir {args.out_dir!r} exists and is not a folder")
    if args.flashinfer_dir is not None:
        if not os.path.isfile(os.path.join(args.flashinfer_dir, "site.tar.xz")):
            parser.error(f"--flashinfer-dir {args.flashinfer_dir!r} holds no site.tar.xz")
        os.environ[flashinfer_peer.ENV_DIR] = os.path.abspath(args.flashinfer_dir)
    dtype16 = "bf16" if DTYPES[args.dtype] == torch.bfloat16 else "fp16"
    try:
        args.impls, args.kv_dtype = resolve_impls(args.impls, args.kv_dtype, dtype16)
    except ValueError as e:
        parser.error(str(e))
    return args


def config_from_args(args: argparse.Namespace) -> Config:
    quick = args.quick
    return Config(
        shapes=args.shapes if args.shapes is not None else (QUICK_SHAPES if quick else DEFAULT_SHAPES),
        impls=args.impls,
        dtype_name="bf16" if DTYPES[args.dtype] == torch.bfloat16 else "fp16",
        causal=args.causal,
        warmup_ms=args.warmup if args.warmup is not None else (5.0 if quick else 25.0),
        rep_ms=args.rep if args.rep is not None else (20.0 if quick else 100.0),
        graph=args.graph,
        seed=args.seed,
        triton_splits=args.triton_splits if args.triton_splits is not None else ([] if quick else [4, 8, 16, 32]),
        max_rotation_bytes=int(args.max_rotation_gib * 2 ** 30),
        kv_dtypes=list(args.kv_dtype),
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the benchmark needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    cfg = config_from_args(args)
    device = torch.device("cuda", torch.cuda.current_device())
    env = collect_environment(device, command_line(argv))
    cfg.l2_bytes = env.get("l2_bytes") or DEFAULT_L2_BYTES
    cfg.sm_count = env["sm_count"]
    timer = pick_timer()
    if args.power:
        try:
            timer = with_power(timer, open_monitor(device))
        except PowerUnavailable as e:
            print(f"error: --power: {e}", file=sys.stderr)
            return 2
    log(f"{env['gpu']} (sm {env['capability']}, {env['sm_count']} SMs, L2 {cfg.l2_bytes / 2 ** 20:.0f} MiB), "
        f"driver {env['driver']}, torch {env['torch']}, CUDA {env['cuda']}, triton {env['triton']}, "
        f"vLLM {env['vllm']}; timer: {TIMER_NAMES.get(timer.__name__, timer.__name__)}")
    log(f"{len(cfg.shapes)} shapes x {', '.join(cfg.impls)}; {cfg.dtype_name}, KV {','.join(cfg.kv_dtypes)}, "
        f"{'causal' if cfg.causal else 'non-causal'}, modes {', '.join(cfg.modes)}")
    ceilings = measure_ceilings(device, cfg.dtype, cfg.dtype_name, timer, cfg.warmup_ms, cfg.rep_ms)
    log(f"ceilings: device copy {ceilings.copy_gbs:.0f} GB/s (read + write of {ceilings.copy_bytes >> 20} MiB), "
        f"{cfg.dtype_name} matmul {ceilings.matmul_n}^3 {ceilings.matmul_tflops:.0f} TFLOP/s "
        f"(ridge {ceilings.ridge:.0f} FLOP/byte)")
    rows: list[dict] = []
    for i, shape in enumerate(cfg.shapes, 1):
        rows += run_shape(shape, cfg, ceilings, timer, device, i, len(cfg.shapes))
    if env["vllm"] is None and "vllm" in sys.modules:     # staged without its dist-info
        env["vllm"] = getattr(sys.modules["vllm"], "__version__", None)
    paths = write_outputs(args.out_dir, env, cfg, ceilings, rows)
    log()
    log(markdown_report(env, cfg, ceilings, rows))
    log("wrote " + ", ".join(paths.values()))
    wrong = [r for r in rows if r["check"] == "WRONG"]
    if wrong:
        log(f"warning: {len(wrong)} result(s) failed the correctness guard (marked WRONG)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
