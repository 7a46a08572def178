"""Time the sparse (DeepSeek-V3.2) decode on fp8_ds_mla caches (GPU only): vLLM's bundled FlashMLA and, once our
API runs sparse decode on CUDA tensors, flashmla_backend, on the same bytes, in one process.

    PYTHONPATH=.peers/flashmla python benchmarks/sparse_bench.py --shapes b128-sq1-h128-topk2048,b64-sq1-h128-topk2048

A shape is b<batch>-sq<q tokens>-h<heads>-topk<k>[-pool<tokens per request>] (--pool, default 8192, for shapes
without the suffix). The inputs come from benchmarks/mla_bench/sparse.py: a bf16 q, an fp8_ds_mla cache of
b * pool tokens in 64-token pages (group gains spread by --spread, log2), and int32 indices naming topk distinct
tokens of each request's own pool as page * 64 + offset, with softmax_scale 576 ** -0.5. Each implementation is
called once (ours is reported as having no sparse kernel for these inputs when it refuses them: a GPU other than
sm_90), then captured in a CUDA graph whose replays triton.testing.do_bench times (median). Per shape:
µs, TFLOP/s (2 * b * s_q * h_q * topk * (576 + 512) FLOPs), the gathered bytes (b * s_q * topk * 656) and the time
they take at the device-copy rate measured at the start (bytes read plus written per second, as benchmarks/bench.py
measures its ceiling), and each output's relative error against an fp64 reference of the first --check-requests
requests (flashmla_backend's sparse reference on the exactly dequantized tokens, on the CPU); then one JSON line per
shape.

`--debug 0,1,16` times ours once per value of FLASHMLA_BACKEND_SPARSE_DEBUG (the kernel's measurement
switches, read by its launcher at every launch: README's environment table; the kernel reads them itself, so values
other than 0 need a build configured with FLASHMLA_BACKEND_MEASURE=1, docs/build.md), in the same process, on the same inputs
and beside the same FlashMLA time: the lines and JSON keys are then ours[<value>] and ours_d<value>_*.

`--kernel-times` also prints, for each implementation, the device time a call spends in each kernel (the decode,
the combine, ...; a kernel launched twice a call counted twice; torch.profiler over 20 plain calls, not graph
replays; with programmatic dependent launch a kernel's time includes its wait for the one before it), so that a
call's fixed cost can be told apart from its blocks' (JSON: <impl>_kernels_us).

`--cache bf16` runs the same values, indices and q with a 16-bit cache ([pages, 64, 1, 576] bf16): ours is then
flashmla_backend's sparse decode of a 16-bit cache (its tokens gathered for the dense kernel), FlashMLA its sparse
prefill kernel, flash_mla_sparse_fwd(q [b * s_q, h_q, 576], kv [tokens, 1, 576], indices [b * s_q, 1, topk],
softmax_scale, 512), which vLLM's FLASHMLA_SPARSE runs for decode on a bf16 cache (its lse is not compared: only
its output).

FlashMLA is vllm.third_party.flashmla.flash_mla_interface: an importable vLLM 0.26, or a package of vLLM's
FlashMLA alone (a vllm/ folder with _flashmla_C and third_party/flashmla, e.g. .peers/flashmla) on PYTHONPATH.
Its call: sched_meta, _ = get_mla_metadata(), then flash_mla_with_kvcache(q, k_cache, None, None, 512, sched_meta,
None, softmax_scale=, causal=False, is_fp8_kvcache=True, indices=); the first call fills sched_meta, before capture.
"""
import argparse
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mla_bench.cli import _arg_positive_float, _arg_seed  # noqa: E402  (the main benchmark's argument types)
from mla_bench.sparse import (CACHES, DEFAULT_POOL, DEFAULT_SPARSE_SHAPES, SPARSE_SHAPE_SYNTAX,  # noqa: E402
                              check_pool, parse_sparse_shapes)

PROG = "python benchmarks/sparse_bench.py"
IMPLS = ("flashmla", "ours")
PEER_MODULE = "vllm.third_party.flashmla.flash_mla_interface"
NO_KERNEL = "no sparse kernel for these inputs"
DEBUG_ENV = "FLASHMLA_BACKEND_SPARSE_DEBUG"


def _positive_int(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return v


def _spread(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0 (log2 of the largest group gain)")
    return v


def _pool(text):
    v = _positive_int(text)
    try:
        check_pool(v, "the pool")
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return v


def _impls(text):
    names = [t for t in re.split(r"[,\s]+", text.strip().lower()) if t]
    if not names:
        raise argparse.ArgumentTypeError("empty implementation list")
    bad = [n for n in names if n not in IMPLS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown implementation(s) {', '.join(map(repr, bad))}; choose from "
                                         f"{', '.join(IMPLS)}")
    return [i for i in IMPLS if i in names]


def _debug_values(text):
    out = []
    for t in re.split(r"[,\s]+", text.strip()):
        if not t:
            continue
        v = _arg_seed(t)   # the main benchmark's non-negative integer
        if v not in out:
            out.append(v)
    if not out:
        raise argparse.ArgumentTypeError("empty list of FLASHMLA_BACKEND_SPARSE_DEBUG values")
    return out


def build_parser():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SPARSE_SHAPES,
                   help=f"comma-separated shapes, each {SPARSE_SHAPE_SYNTAX} (default: {DEFAULT_SPARSE_SHAPES})")
    p.add_argument("--pool", type=_pool, default=DEFAULT_POOL,
                   help=f"cache tokens per request for shapes without -pool<N>, a multiple of 64 (default "
                        f"{DEFAULT_POOL}); the cache holds b * pool tokens")
    p.add_argument("--spread", type=_spread, default=0.0,
                   help="group gains 2^u of the cache's latent values, u uniform in [-spread, spread] (default 0: "
                        "every 128-channel group has the same magnitude)")
    p.add_argument("--impls", type=_impls, default=list(IMPLS),
                   help=f"comma-separated subset of {','.join(IMPLS)} (default both)")
    p.add_argument("--check-requests", type=_positive_int, default=2,
                   help="requests compared with the fp64 reference, the first ones of the batch (default 2)")
    p.add_argument("--seed", type=_arg_seed, default=0, help="random seed of the inputs (default 0)")
    p.add_argument("--warmup", type=_arg_positive_float, default=10.0, help="do_bench warm-up in ms (default 10)")
    p.add_argument("--rep", type=_arg_positive_float, default=50.0, help="do_bench rep in ms (default 50)")
    p.add_argument("--kernel-times", action="store_true",
                   help="also print each kernel's device time of one call per implementation (torch.profiler)")
    p.add_argument("--cache", choices=tuple(CACHES), default="fp8_ds_mla",
                   help="the KV cache: fp8_ds_mla (656 bytes a token, default) or bf16 (576 values a token; FlashMLA "
                        "then runs its sparse prefill kernel, as vLLM's FLASHMLA_SPARSE does on a bf16 cache)")
    p.add_argument("--debug", type=_debug_values, default=None,
                   help="comma-separated values of FLASHMLA_BACKEND_SPARSE_DEBUG: ours is timed once per value "
                        "(default: once, with the environment as it is)")
    return p


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.shapes = parse_sparse_shapes(args.shapes, args.pool)
    except ValueError as e:
        parser.error(f"argument --shapes: {e}")
    return args


def _first_line(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def load_flashmla():
    """(FlashMLA's interface module, None) or (None, why it cannot be imported)."""
    import importlib
    try:
        return importlib.import_module(PEER_MODULE), None
    except Exception as e:   # ImportError, or the extension failing to load (wrong torch, no GPU code)
        return None, (f"cannot import {PEER_MODULE} ({_first_line(e)}); put vLLM 0.26, or a package of its FlashMLA "
                      "alone such as .peers/flashmla, on PYTHONPATH")


def sparse_call(module, inp, prefill_kernel=False):
    """One sparse decode through a FlashMLA-style API (FlashMLA's interface, or flashmla_backend), with a
    FlashMLASchedMeta of its own that the first call fills. prefill_kernel: FlashMLA's flash_mla_sparse_fwd instead
    (a bf16 cache), returning (out [b, s_q, h_q, 512], None): its lse is not compared."""
    from mla_bench.shapes import D_V
    if prefill_kernel:
        b, s_q, h_q, d = inp.q.shape
        q = inp.q.view(b * s_q, h_q, d)
        kv = inp.k_cache.view(-1, 1, d)
        indices = inp.indices.view(b * s_q, 1, -1)

        def call():
            out = module.flash_mla_sparse_fwd(q, kv, indices, inp.softmax_scale, D_V)[0]
            return out.view(b, s_q, h_q, D_V), None
        return call
    sched_meta, _ = module.get_mla_metadata()
    return lambda: module.flash_mla_with_kvcache(inp.q, inp.k_cache, None, None, D_V, sched_meta, None,
                                                 softmax_scale=inp.softmax_scale, causal=False, is_fp8_kvcache=inp.ds,
                                                 indices=inp.indices)


def run_impl(name, module, inp, ref, args, work, timer=None, sync=None):
    """One implementation on one shape: a dict with status ('ok', NO_KERNEL, 'unavailable' or 'failed'), and
    with 'ok' the time, TFLOP/s, gather GB/s and the errors against the reference. timer(fn, warmup_ms, rep_ms)
    -> (µs, what fn returned) and sync() default to CUDA-graph replays and torch.cuda.synchronize."""
    import torch
    from mla_bench.sparse import relative_error
    from mla_bench.timing import graph_replay_us

    timer = graph_replay_us if timer is None else timer
    sync = torch.cuda.synchronize if sync is None else sync
    fn = sparse_call(module, inp, prefill_kernel=name == "flashmla" and not inp.ds)
    try:
        fn()                          # tried once: a refusal says the implementation cannot run these inputs
        sync()
    except NotImplementedError as e:
        status = NO_KERNEL if name == "ours" else "unavailable"
        return {"status": status, "reason": _first_line(e)}
    except Exception as e:
        return {"status": "unavailable", "reason": _first_line(e)}
    try:
        us, (out, lse) = timer(fn, args.warmup, args.rep)
    except Exception as e:
        return {"status": "failed", "reason": f"while timing CUDA-graph replays: {_first_line(e)}"}
    ref_out, ref_lse = ref
    n = ref_out.shape[0]
    err = relative_error(out, ref_out)
    lse_err = None if lse is None else float((lse[:n].detach().cpu().double() - ref_lse.double()).abs().max())
    res = {"status": "ok", "us": us, "tflops": work["flops"] / (us * 1e-6) / 1e12,
           "gather_gbs": work["gathered_bytes"] / (us * 1e-6) / 1e9, "err": err, "lse_err": lse_err}
    if getattr(args, "kernel_times", False):
        from mla_bench.timing import kernel_times
        res["kernels_us"] = {k: round(v, 2) for k, v in kernel_times(fn).items()}
    return res


def run_shape(shape, device, modules, reasons, args, copy_gbs, timer=None, sync=None):
    """Inputs, reference and every implementation of --impls for one shape; prints a line per implementation and
    returns the shape's JSON object. modules: name -> API module, or None with reasons[name] saying why."""
    from mla_bench.sparse import gathered_bytes, make_sparse_inputs, sparse_flops, sparse_reference

    cache = args.cache
    inp = make_sparse_inputs(shape, device, args.seed, args.spread, cache=cache)
    ref = sparse_reference(inp, args.check_requests)
    work = {"flops": sparse_flops(shape), "gathered_bytes": gathered_bytes(shape, cache)}
    floor_us = work["gathered_bytes"] / (copy_gbs * 1e9) * 1e6
    cache_mb = inp.k_cache.numel() * inp.k_cache.element_size() / 1e6
    print(f"{shape.name}: {cache} cache {cache_mb:.0f} MB, gathered {work['gathered_bytes'] / 1e6:.1f} MB "
          f"({floor_us:.1f} us at the copy rate), {work['flops'] / 1e9:.1f} GFLOP; reference: first "
          f"{ref[0].shape[0]} request(s) in fp64", flush=True)
    line = {"shape": shape.name, "b": shape.b, "s_q": shape.s_q, "h_q": shape.h_q, "topk": shape.topk,
            "pool": shape.pool, "cache": cache, "spread": args.spread, "flops": work["flops"],
            "gathered_bytes": work["gathered_bytes"], "copy_gbs": round(copy_gbs, 1),
            "gather_floor_us": round(floor_us, 2), "check_requests": ref[0].shape[0]}
    # The runs: (implementation, its label in the output, its JSON key prefix, the debug value to set or None).
    runs = []
    for name in args.impls:
        if name == "ours" and args.debug:
            runs += [(name, f"ours[{d}]", f"ours_d{d}", d) for d in args.debug]
        else:
            runs.append((name, name, name, None))
    results = {}
    saved = os.environ.get(DEBUG_ENV)
    try:
        for name, label, key, debug in runs:
            if debug is not None:
                os.environ[DEBUG_ENV] = str(debug)
            if modules.get(name) is None:
                res = {"status": "unavailable", "reason": reasons[name]}
            else:
                res = run_impl(name, modules[name], inp, ref, args, work, timer, sync)
            results[key] = res
            _report(label, key, res, floor_us, line)
    finally:
        if saved is None:
            os.environ.pop(DEBUG_ENV, None)
        else:
            os.environ[DEBUG_ENV] = saved
    peer = results.get("flashmla", {})
    for name, label, key, _ in runs:
        if name == "ours" and peer.get("status") == "ok" and results[key]["status"] == "ok":
            speedup = peer["us"] / results[key]["us"]
            print(f"  {label} vs FlashMLA: {speedup:.2f}x (above 1: ours faster)", flush=True)
            line["speedup_vs_flashmla" + key[len("ours"):]] = round(speedup, 3)
    return line


def _report(label, key, res, floor_us, line):
    """One implementation's line of output, and its fields of the shape's JSON object."""
    from mla_bench.check import OUT_ROW_REL_TOL

    if res["status"] == "ok":
        flag = "" if res["err"] <= OUT_ROW_REL_TOL else f" (WRONG: above {OUT_ROW_REL_TOL:g})"
        lse = "n/a" if res["lse_err"] is None else f"{res['lse_err']:.1e}"
        print(f"  {label}: {res['us']:.1f} us, {res['tflops']:.1f} TFLOP/s, gather {res['gather_gbs']:.0f} GB/s "
              f"({floor_us / res['us']:.0%} of the copy rate), error {res['err']:.1e} vs fp64{flag}, max lse "
              f"error {lse}", flush=True)
        line.update({f"{key}_us": round(res["us"], 2), f"{key}_tflops": round(res["tflops"], 2),
                     f"{key}_err": float(f"{res['err']:.2e}"),
                     f"{key}_lse_err": None if res["lse_err"] is None else float(f"{res['lse_err']:.2e}")})
        if "kernels_us" in res:
            print(f"    {label} kernels: " + ", ".join(f"{k} {v:.1f} us" for k, v in res["kernels_us"].items()),
                  flush=True)
            line[f"{key}_kernels_us"] = res["kernels_us"]
    else:
        note = "" if res["status"] == NO_KERNEL else f": {res['reason']}"
        print(f"  {label}: {res['status']}{note}", flush=True)
        line[f"{key}_status"] = res["status"]
        line[f"{key}_reason"] = res["reason"]


def main(argv=None):
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("sparse_bench: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    import flashmla_backend as fb
    from mla_bench.timing import COPY_CEILING_BYTES, copy_ceiling_gbs, pick_timer

    dev = torch.device("cuda", torch.cuda.current_device())
    modules, reasons = {"ours": fb}, {}
    if "flashmla" in args.impls:
        modules["flashmla"], reasons["flashmla"] = load_flashmla()
    props = torch.cuda.get_device_properties(dev)
    where = modules["flashmla"].__file__ if modules.get("flashmla") is not None else "not loaded"
    print(f"{props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, CUDA "
          f"{torch.version.cuda}; FlashMLA: {where}; flashmla_backend: {fb.__file__}", flush=True)
    copy_gbs = copy_ceiling_gbs(dev, pick_timer(), args.warmup, args.rep, COPY_CEILING_BYTES)
    print(f"device copy {copy_gbs:.0f} GB/s (bytes read + written, {COPY_CEILING_BYTES >> 20} MiB); spread "
          f"{args.spread:g}, seed {args.seed}", flush=True)
    torch.cuda.empty_cache()
    for shape in args.shapes:
        print(json.dumps(run_shape(shape, dev, modules, reasons, args, copy_gbs)), flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
