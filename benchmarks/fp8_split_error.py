"""Error of the FP8-cache decode against fp64 as a function of how many keys one CTA accumulates (GPU only).

    python benchmarks/fp8_split_error.py --shapes b128-sk8192-h128-sq1,b1-sk8192-h128-sq1 \
        --parts 1,2,4,8 --modes accurate,fast

The scheduler cuts requests into pieces; each CTA accumulates its piece's P V in its output accumulator and the
combine adds the pieces in fp32. `--parts` multiplies the scheduler's part count (get_mla_metadata's, i.e. SMs /
M tiles / KV heads) by each factor, which shortens the pieces (a factor below 1 lengthens them: at b = 1 each CTA
splits a whole 16-bit Q tile for its few blocks, and fewer parts spread that cost over more blocks). If an error falls as the pieces shorten, it comes
from the accumulation over a piece (benchmarks/fp8_accumulation_model.py models the e4m3 wgmma accumulator that
way); if it stays, it comes from elsewhere (the operands' rounding, the output's 16-bit rounding). Every line
prints the longest piece in blocks, the relative error against the fp64 decode of the dequantized inputs (with the
16-bit q for the accurate mode, the e4m3 q for the fast mode), the floor that rounding the fp64 output to the
output dtype alone gives, and the time of one call (CUDA-graph replay median, decode + combine).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DEFAULT_SHAPES = "b128-sk8192-h128-sq1,b128-sk8192-h16-sq1,b1-sk8192-h128-sq1"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated shapes (benchmarks/bench.py syntax)")
    p.add_argument("--parts", default="1,2,4,8",
                   help="comma-separated positive factors on the scheduler's part count (default 1,2,4,8; below 1, "
                        "e.g. 0.5,0.25: fewer parts, longer pieces)")
    p.add_argument("--modes", default="accurate", help="comma-separated: accurate (16-bit q), fast (e4m3 q)")
    p.add_argument("--rep", type=int, default=30, help="do_bench rep in ms (default 30)")
    args = p.parse_args(argv)
    try:
        args.parts = [float(x) for x in args.parts.split(",") if x]
    except ValueError:
        p.error(f"--parts: {args.parts!r} is not a comma-separated list of numbers")
    if not args.parts or any(not f > 0 for f in args.parts):
        p.error("--parts: factors must be positive")
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or any(m not in ("accurate", "fast") for m in args.modes):
        p.error(f"--modes: choose from accurate, fast (got {args.modes})")
    return args


def longest_piece_blocks(meta_rows, seqlens, page=64):
    """The most KV blocks one CTA accumulates into one output: over every part's metadata row [begin_req,
    begin_token, end_req (inclusive), end_token (exclusive), ...] and every request piece in it."""
    longest = 0
    for row in meta_rows:
        begin_req, begin_token, end_req, end_token = row[:4]
        for r in range(begin_req, end_req + 1):
            start = begin_token if r == begin_req else 0
            end = end_token if r == end_req else seqlens[r]
            longest = max(longest, -(-end // page) - start // page)
    return longest


def main(argv=None):
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("fp8_split_error: needs a CUDA GPU", file=sys.stderr)
        return 2
    from mla_bench.timing import graph_replay_us

    import flashmla_backend as fb
    from flashmla_backend import ops
    from mla_bench.check import dequantized_reference, rel_norm_error, visible_rows
    from mla_bench.shapes import D_V, one_fp8_case, parse_shapes

    dev = torch.device("cuda")

    def timeit(fn):
        return graph_replay_us(fn, 5, args.rep)

    for shape in parse_shapes(args.shapes):
        seqlens, inp, f8, lens = one_fp8_case(shape, dev)
        scale = 576 ** -0.5
        rows = shape.s_q * shape.h_q
        visible = visible_rows(lens, shape.s_q, True)
        base_meta, _ = fb.get_mla_metadata(lens, rows, 1, is_fp8_kvcache=True)
        base_parts = base_meta.shape[0]
        for mode in args.modes:
            q, dq = (f8.q, f8.descale_q) if mode == "fast" else (inp.q, None)
            ref, _ = dequantized_reference(q, f8.k_cache, inp.block_table, seqlens, scale, True, f8.descale_k,
                                           descale_q=dq)
            out_dtype = torch.bfloat16 if mode == "fast" else q.dtype
            floor = rel_norm_error(ref.to(out_dtype), ref, visible)
            for factor in args.parts:
                parts = max(1, round(base_parts * factor))
                meta, nsplits = ops._metadata_impl(lens, parts)
                pieces = int(nsplits[-1].item())
                longest = longest_piece_blocks(meta.cpu().tolist(), seqlens)
                t, (out, _) = timeit(lambda: fb.flash_mla_with_kvcache(
                    q, f8.k_cache, inp.block_table, lens, D_V, meta, nsplits, softmax_scale=scale,
                    causal=True, is_fp8_kvcache=True, descale_q=dq, descale_k=f8.descale_k))
                err = rel_norm_error(out, ref, visible)
                print(f"{shape.name} {mode}: parts {parts} ({factor:g}x), pieces {pieces}, longest "
                      f"part {longest} blocks: error {err:.2e} (output rounding alone {floor:.2e}), "
                      f"{t:.1f} us", flush=True)
            del ref
        inp = f8 = None  # released before the next shape (not `del`: the lambdas above name them)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
