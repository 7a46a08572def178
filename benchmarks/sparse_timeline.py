#!/usr/bin/env python3
"""Where a sparse decode call's time goes inside the kernel: the timeline build's records (GPU, a timeline build).

    FLASHMLA_BACKEND_NVCC_FLAGS=-DFMLA_SPARSE_TIMELINE=1 cmake -S . -B build -G Ninja && cmake --build build
    python benchmarks/sparse_timeline.py [--shapes b1-sq1-h128-topk64,b128-sq1-h128-topk128] [--ctas 0,1] [--events 40]
        [--no-flush]

For each shape (sparse_bench.py's syntax and inputs) one call of flashmla_backend's sparse decode runs after a warm-up
call and a flush of the L2 cache (with --no-flush: right after the warm-up call, as calls back to back run), and the
kernel's records (csrc/sm90/sparse_fp8/timeline.cuh) are read back. Printed:
the spread of the CTAs' start times and of the lead and follower warpgroups' end times (global timer), and for the CTAs
of --ctas (index blockIdx.z * gridDim.x + blockIdx.x) every role's events in time order, in µs from the CTA's start
(the SM clock, converted with the CTA's own cycles-to-ns ratio, lead start to end), the first and last --events of
each role. Event codes: timeline.cuh (TlCode). The records change the kernel's timing a little: read the gaps, not the
total, and time the default build with sparse_bench.py.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROLES = ("lead", "follow", "gather", "transpose")
CODES = {0: "start", 1: "first_q", 2: "full", 3: "qk_done", 4: "p_handed", 5: "vt0_ready", 6: "pv0_done",
         7: "epilogue", 8: "next_q", 9: "q_copied", 10: "p_full", 11: "qk_issued", 12: "block_done", 13: "q_split",
         14: "first_q_loaded", 15: "pair_issued", 16: "softmax", 17: "words", 18: "fold01", 20: "stage_free",
         21: "copies", 30: "t_full", 31: "factors", 32: "half", 99: "end"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="b1-sq1-h128-topk64,b128-sq1-h128-topk128",
                   help="comma-separated sparse shapes (sparse_bench.py's syntax)")
    p.add_argument("--ctas", default="0,1", help="comma-separated CTA indices whose events are printed")
    p.add_argument("--events", type=int, default=40, help="events printed from each end of a role's list")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-flush", action="store_true",
                   help="leave the L2 cache and the code as the warm-up call left them (the state of calls back to "
                        "back, as in CUDA-graph replays) instead of flushing the L2 cache before the recorded call")
    return p.parse_args(argv)


def read(C, dev_index):
    t = C.sparse_timeline(dev_index)
    n_ctas, roles, events = t["max_ctas"], t["roles"], t["events"]
    words, counts, ns = t["words"], t["counts"], t["ns"]
    ctas = {}
    for c in range(n_ctas):
        per_role = []
        for r in range(roles):
            k = counts[c * roles + r]
            base = (c * roles + r) * events
            per_role.append([(w >> 24, w & 0xFFFFFF) for w in words[base:base + k]])
        if any(per_role):
            ctas[c] = (per_role, ns[3 * c:3 * c + 3])
    return ctas


def report(ctas, show, events):
    if not ctas:
        print("  no CTA recorded anything (not a timeline build's kernel, or no work)")
        return
    starts = [ns[0] for _, ns in ctas.values()]
    t0 = min(starts)
    lead_end = [ns[1] - t0 for _, ns in ctas.values() if ns[1]]
    follow_end = [ns[2] - t0 for _, ns in ctas.values() if ns[2]]

    def span(ends):
        return f"{min(ends) / 1e3:.2f}-{max(ends) / 1e3:.2f} µs" if ends else "not recorded"

    print(f"  {len(ctas)} CTAs with records; start spread {(max(starts) - t0) / 1e3:.2f} µs; lead end "
          f"{span(lead_end)}, follower end {span(follow_end)} after the first start")
    for c in show:
        if c not in ctas:
            print(f"  CTA {c}: no records")
            continue
        per_role, ns = ctas[c]
        lead = per_role[0]
        end_cycles = next((t for code, t in reversed(lead) if code == 99), None)
        ghz = end_cycles / (ns[1] - ns[0]) if end_cycles and ns[1] > ns[0] else 1.75
        print(f"  CTA {c}: start +{(ns[0] - t0) / 1e3:.2f} µs, clock {ghz:.3f} GHz (lead's cycles over its ns)")
        merged = []
        for r, evs in enumerate(per_role):
            keep = evs if len(evs) <= 2 * events else evs[:events] + [None] + evs[-events:]
            for i, e in enumerate(keep):
                if e is None:
                    merged.append((keep[i - 1][1] + 0.5, r, None))
                else:
                    merged.append((e[1], r, e[0]))
        merged.sort(key=lambda x: (x[0], x[1]))
        for cyc, r, code in merged:
            if code is None:
                print(f"    {'':>9}  {ROLES[r]:<9} ...")
            else:
                print(f"    {cyc / ghz / 1e3:9.3f}  {ROLES[r]:<9} {CODES.get(code, code)}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    import flashmla_backend as fb
    from flashmla_backend import _ext
    from mla_bench.sparse import make_sparse_inputs, parse_sparse_shapes
    from sparse_bench import sparse_call

    if not torch.cuda.is_available():
        raise SystemExit("sparse_timeline.py needs a CUDA GPU")
    dev = torch.device("cuda")
    idx = torch.cuda.current_device()
    C = _ext.ext()
    show = [int(x) for x in args.ctas.split(",") if x.strip()]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    for shape in parse_sparse_shapes(args.shapes):
        inp = make_sparse_inputs(shape, dev, args.seed, 0.0)
        fn = sparse_call(fb, inp)
        fn()
        torch.cuda.synchronize()
        C.sparse_timeline(idx)  # clears the warm-up's counts
        if not args.no_flush:
            flush.zero_()
        fn()
        torch.cuda.synchronize()
        print(f"{shape.name}:")
        report(read(C, idx), show, args.events)
    return 0


if __name__ == "__main__":
    sys.exit(main())
