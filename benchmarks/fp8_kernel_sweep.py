"""Time the FP8-cache decode kernel (FP8 tensor cores) with its measurement switches (FLASHMLA_BACKEND_FP8_DEBUG)
side by side, against vLLM's FlashMLA-FP8 on the same e4m3 bytes, in one process (GPU only).

    python benchmarks/fp8_kernel_sweep.py --shapes b128-sk8192-h128-sq1,b128-sk8192-h16-sq1 \
        --modes fast,accurate --debug 0,1

--debug lists values of FLASHMLA_BACKEND_FP8_DEBUG: 0 for normal use, else a sum of the bits of DebugFlags in
csrc/sm90/decode_fp8/decode.h (each commented there: other tiles and plans, same results within the mode's error; bit
1 skips the V transposition, or the accurate mode's widening of V, so its results are wrong and only its time means
something; the kernel reads that bit itself, so it needs a build configured with FLASHMLA_BACKEND_MEASURE=1,
docs/build.md). Each call is captured in a CUDA graph and its replays timed with
triton.testing.do_bench (median). One line per (shape, mode, debug value) with the
time, FlashMLA-FP8's time and the relative difference of the outputs from FlashMLA-FP8's (the fast mode reads the
same e4m3 q; the accurate mode reads the 16-bit q, so it differs by q's quantization), then one JSON line per shape.

--rep 25,100 times everything once per window length, in that order: a kernel near the board's power limit runs at
a lower clock over 100 ms than over 25 ms (measured: the fast mode 330 against 348-358 µs at b128-sk8192-h128, while
FlashMLA-FP8 stayed at 421), so a ratio holds for the window it was taken in. --power adds each window's average
power, SM clock and how often the clock was lowered by power or heat (mla_bench/power.py; needs nvidia-ml-py),
and the energy a call (the window's power times the call's time). --sustain 1000 adds, after the --rep windows, one
window of 1000 ms of replays back to back (no L2 clearing between calls, the mean time a call): the load of a
serving engine (measured on an H200: every large shape then ran at the board's 700 W cap, so the time ratio is the
ratio of energy a call), and long enough for the board's energy counter, which moves in steps: a window under a few
hundred ms may get no power reading at all.
FlashMLA-FP8 is vLLM 0.26's flash_mla_with_kvcache_fp8 (importable vllm, or the 2 MB package of its FlashMLA on
PYTHONPATH).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DEFAULT_SHAPES = ("b128-sk8192-h128-sq1,b128-sk8192-h16-sq1,b64-sk8192-h32-sq1,b1-sk8192-h128-sq1,"
                  "b128-varlen4096-h128-sq1")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated shapes (benchmarks/bench.py syntax)")
    p.add_argument("--modes", default="fast", help="comma-separated: fast (e4m3 q), accurate (bf16 q)")
    p.add_argument("--debug", default="0", help="comma-separated values of FLASHMLA_BACKEND_FP8_DEBUG (default 0)")
    p.add_argument("--rep", default="50",
                   help="do_bench rep in ms, or a comma-separated list: each time is then taken once per window, in "
                        "that order (default 50)")
    p.add_argument("--power", action="store_true",
                   help="print each timing window's average power and SM clock (NVML: needs nvidia-ml-py)")
    p.add_argument("--sustain", type=int, default=0, metavar="MS",
                   help="also time MS ms of back-to-back replays per (shape, kernel), after the --rep windows "
                        "(default 0: none)")
    args = p.parse_args(argv)
    if args.sustain < 0:
        p.error(f"--sustain: {args.sustain} is negative; give the milliseconds of back-to-back replays, or 0")
    args.modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in args.modes if m not in ("fast", "accurate")]
    if bad:
        p.error(f"--modes: unknown {bad}; choose from fast, accurate")
    args.debug = _int_list(p, "--debug", args.debug, 0, "integers")
    args.rep = _int_list(p, "--rep", args.rep, 1, "whole milliseconds", " (milliseconds)")
    return args


def _int_list(p, option, text, minimum, kind, unit=""):
    """A comma-separated option value as integers >= minimum, or the parser's error naming the option."""
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        p.error(f"{option}: {text!r} is not a comma-separated list of integers{unit}")
    if not values or any(v < minimum for v in values):
        p.error(f"{option}: give one or more {kind} >= {minimum}")
    return values


def main(argv=None):
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("fp8_kernel_sweep: needs a CUDA GPU", file=sys.stderr)
        return 2
    from mla_bench.timing import graph_replay_us
    from mla_bench.power import PowerUnavailable, open_monitor
    import flashmla_backend as fb
    from mla_bench.shapes import D_V, one_fp8_case, parse_shapes
    from vllm.v1.attention.ops import flashmla as vllm_flashmla

    dev = torch.device("cuda")

    monitor = None
    if args.power:
        try:
            monitor = open_monitor(dev)
        except PowerUnavailable as e:
            print(f"fp8_kernel_sweep: --power: {e}", file=sys.stderr)
            return 2

    # Each window: (do_bench rep in ms, back to back?). The --rep windows, then the --sustain one.
    windows = [(rep, False) for rep in args.rep] + ([(args.sustain, True)] if args.sustain else [])

    def timeit(fn, win):
        rep, b2b = win
        t, res = graph_replay_us(fn, 200 if b2b else 10, rep, power=monitor, back_to_back=b2b)
        if monitor is None:
            return t, res, "", {}
        r = monitor.last
        energy = "" if r.watts is None else f", {r.watts * t * 1e-3:.0f} mJ a call"
        return t, res, f" [{r.describe()}{energy}]", r.as_dict()

    def window(win):  # the line's label of a window when several are timed
        rep, b2b = win
        if b2b:
            return f" back-to-back {rep}ms"
        return f" rep={rep}ms" if len(windows) > 1 else ""

    saved = os.environ.get("FLASHMLA_BACKEND_FP8_DEBUG")
    try:
        for shape in parse_shapes(args.shapes):
            _, inp, f8, lens = one_fp8_case(shape, dev)
            scale = 576 ** -0.5
            rows = shape.s_q * shape.h_q
            sched, splits = vllm_flashmla.get_mla_metadata_dense_fp8(lens, rows, 1)
            line = {"shape": shape.name}
            for win in windows:
                # Per window: the peer first, then ours, each (mode, debug value) in the order given.
                suffix = "" if len(windows) == 1 else f"@{'b2b' if win[1] else ''}{win[0]}ms"
                t_peer, (o_peer, _), p_note, p_peer = timeit(lambda: vllm_flashmla.flash_mla_with_kvcache_fp8(
                    f8.q, f8.k_cache, inp.block_table, lens, D_V, sched, splits, softmax_scale=scale, causal=True,
                    descale_q=f8.descale_q, descale_k=f8.descale_k), win)
                o_peer = o_peer.view(shape.b, shape.s_q, shape.h_q, D_V).float()
                line["flashmla_fp8_us" + suffix] = round(t_peer, 1)
                if monitor is not None:
                    line["flashmla_fp8_power" + suffix] = p_peer
                    print(f"{shape.name} FlashMLA-FP8{window(win)}: {t_peer:.1f} us{p_note}", flush=True)
                for mode in args.modes:
                    q, dq = (f8.q, f8.descale_q) if mode == "fast" else (inp.q, None)
                    for debug in args.debug:
                        os.environ["FLASHMLA_BACKEND_FP8_DEBUG"] = str(debug)
                        meta, nsplits = fb.get_mla_metadata(lens, rows, 1, is_fp8_kvcache=True)
                        t, (out, _), note, p_ours = timeit(lambda: fb.flash_mla_with_kvcache(
                            q, f8.k_cache, inp.block_table, lens, D_V, meta, nsplits, softmax_scale=scale,
                            causal=True, is_fp8_kvcache=True, descale_q=dq, descale_k=f8.descale_k), win)
                        diff = ((out.float() - o_peer).norm() / o_peer.norm()).item()
                        key = f"{mode}-{debug}{suffix}"
                        line[key + "_us"] = round(t, 1)
                        line[key + "_diff"] = float(f"{diff:.1e}")
                        if monitor is not None:
                            line[key + "_power"] = p_ours
                        print(f"{shape.name} {mode} debug={debug}{window(win)}: {t:.1f} us (FlashMLA-FP8 "
                              f"{t_peer:.1f} us, {t_peer / t:.2f}x) output vs FlashMLA-FP8 {diff:.1e}{note}",
                              flush=True)
            print(json.dumps(line), flush=True)
            inp = f8 = None  # released before the next shape (not `del`: the lambdas above name them)
            torch.cuda.empty_cache()
    finally:
        if saved is None:
            os.environ.pop("FLASHMLA_BACKEND_FP8_DEBUG", None)
        else:
            os.environ["FLASHMLA_BACKEND_FP8_DEBUG"] = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
