"""Summarize Nsight Compute's per-instruction source counters of one kernel (CPU only): where the warps stall, which
loop bodies take the samples, how many instructions a unit of work costs.

    ncu --set full --import-source yes -k regex:sparse_fp8_decode -c 1 -o prof \
        python benchmarks/sparse_bench.py --shapes b128-sq1-h128-topk2048 --impls ours
    ncu -i prof.ncu-rep --page source --csv --print-source sass > prof.csv
    python benchmarks/ncu_source_summary.py prof.csv --units 8192 [--top 20] [--regions lead=0x4f0-0xf000,...]

(`-c 1`: the first launch only, the benchmark's correctness call.) `--units N` divides execution counts by N (a
warp-level count per unit of work: for the sparse kernel at b128-sq1-h128-topk2048, 8,192 blocks of 64 tokens over
all M tiles), so a loop body executed by 4 warps each block shows as 4 a unit. Addresses are printed relative to the kernel's first instruction (ncu's absolute addresses change
from run to run), and `--regions` takes them the same way: name=start-end (hex, end exclusive), comma-separated, e.g.
the address ranges of a kernel's roles read off the loop-body list. Sections of the output:
  stall reasons   each reason's share of all warp-state samples;
  loop bodies     runs of consecutive instructions with one execution count (a loop body or a straight stretch), the
                  heaviest by samples: address range, executions a unit, instructions, samples, the main opcodes;
  waits           the mbarrier waits (SYNCS.PHASECHK), wgmma waits (WARPGROUP.DEPBAR) and named barriers (BAR) that
                  hold samples, with their operands (the barrier's shared-memory offset tells which one);
  instructions    the heaviest single instructions and their top stall reasons;
  regions         per named region: samples, instructions a unit, and its stall reasons.
The journal's profiles of the sparse kernel (docs/perf/journal.md, 2026-11-29) were read this way.
"""
from __future__ import annotations

import argparse
import collections
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def load(path: str) -> tuple[str, list[dict]]:
    """(kernel name, rows): each row has addr (relative), text, samples, executed, stalls {reason: samples}."""
    with open(path, newline="") as f:
        table = list(csv.reader(f))
    if len(table) < 3 or not table[0] or table[0][0] != "Kernel Name":
        raise ValueError(f"{path}: not ncu's source page as CSV (expected a 'Kernel Name' line first; export it with "
                         "ncu -i REPORT --page source --csv --print-source sass)")
    kernel = table[0][1] if len(table[0]) > 1 else "?"
    header = table[1]
    col = {h: i for i, h in enumerate(header)}
    for need in ("Address", "Source", SAMPLES, EXECUTED):
        if need not in col:
            raise ValueError(f"{path}: the CSV has no '{need}' column (profile with --set full and source counters)")
    stall_cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    rows = []
    base = None
    for r in table[2:]:
        if len(r) < len(header) or not r[col["Address"]].strip():
            continue
        addr = int(r[col["Address"]], 16)
        base = addr if base is None else base
        rows.append({"addr": addr - base, "text": r[col["Source"]].strip(), "samples": _num(r[col[SAMPLES]]),
                     "executed": _num(r[col[EXECUTED]]),
                     "stalls": {h[len("stall_"):]: _num(r[col[h]]) for h in stall_cols}})
    if not rows:
        raise ValueError(f"{path}: no instructions")
    return kernel, rows


def opcode(text: str) -> str:
    words = text.split()
    if not words:
        return "?"
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return op.split(".")[0]


def runs(rows: list[dict]) -> list[list[dict]]:
    """Consecutive instructions with one execution count."""
    out: list[list[dict]] = []
    for r in rows:
        if out and out[-1][0]["executed"] == r["executed"]:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def parse_regions(text: str | None) -> list[tuple[str, int, int]]:
    if not text:
        return []
    regions = []
    for item in text.split(","):
        try:
            name, span = item.split("=")
            start, end = (int(x, 16) for x in span.split("-"))
        except ValueError:
            raise ValueError(f"--regions: {item!r} is not name=start-end (hex addresses, e.g. lead=0x4f0-0xf000)")
        if end <= start:
            raise ValueError(f"--regions: {item!r} ends before it starts")
        regions.append((name, start, end))
    return regions


def _share(stalls: dict, total: float, n: int) -> str:
    top = sorted(stalls.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {v / total * 100:.0f}%" for k, v in top if v > 0) if total > 0 else "-"


def summarize(kernel: str, rows: list[dict], units: float, top: int, regions) -> str:
    total = sum(r["samples"] for r in rows)
    out = [f"kernel {kernel}: {len(rows)} instructions, {total:.0f} samples, "
           f"{sum(r['executed'] for r in rows) / units:.0f} warp instructions a unit (--units {units:g})"]
    stalls = collections.Counter()
    for r in rows:
        stalls.update(r["stalls"])
    out.append("stall reasons: " + _share(stalls, sum(stalls.values()), 12))

    out.append("loop bodies (address range, executions a unit, instructions, samples, main opcodes):")
    bodies = sorted(runs(rows), key=lambda b: -sum(r["samples"] for r in b))
    for b in bodies[:top]:
        s = sum(r["samples"] for r in b)
        ops = collections.Counter(opcode(r["text"]) for r in b)
        mix = " ".join(f"{k}x{v}" for k, v in ops.most_common(6))
        out.append(f"  {b[0]['addr']:#07x}-{b[-1]['addr']:#07x}  {b[0]['executed'] / units:8.2f}  {len(b):4d}  "
                   f"{s / total * 100 if total else 0:5.1f}%  {mix}")

    out.append("waits (address, samples, executions a unit, instruction):")
    waits = [r for r in rows if opcode(r["text"]) in ("SYNCS", "WARPGROUP", "BAR") and r["samples"] > 0]
    # An mbarrier wait is a try_wait and a predicated branch on its result (the compiler may schedule other
    # instructions between them): the samples land on the branch. Each such branch is listed with the closest
    # try_wait before it.
    for i, r in enumerate(rows):
        if opcode(r["text"]) != "BRA" or r["samples"] <= 0:
            continue
        for j in range(i - 1, max(i - 16, -1), -1):
            if opcode(rows[j]["text"]) in ("BRA", "BAR", "WARPGROUP"):
                break
            if opcode(rows[j]["text"]) == "SYNCS" and "TRYWAIT" in rows[j]["text"]:
                waits.append({**r, "text": f"{r['text']}  <- {rows[j]['text']}"})
                break
    for r in sorted(waits, key=lambda r: -r["samples"])[:top]:
        out.append(f"  {r['addr']:#07x}  {r['samples'] / total * 100 if total else 0:5.1f}%  "
                   f"{r['executed'] / units:8.2f}  {r['text'][:110]}")

    out.append("instructions (address, samples, executions a unit, top stall reasons, instruction):")
    for r in sorted(rows, key=lambda r: -r["samples"])[:top]:
        out.append(f"  {r['addr']:#07x}  {r['samples'] / total * 100 if total else 0:5.1f}%  "
                   f"{r['executed'] / units:8.2f}  [{_share(r['stalls'], r['samples'], 3)}]  {r['text'][:80]}")

    if regions:
        out.append("regions (name, samples, instructions a unit, stall reasons):")
        for name, start, end in regions:
            part = [r for r in rows if start <= r["addr"] < end]
            if not part:
                out.append(f"  {name}: no instruction in {start:#x}-{end:#x}")
                continue
            rs = collections.Counter()
            for r in part:
                rs.update(r["stalls"])
            s = sum(r["samples"] for r in part)
            out.append(f"  {name}: {s / total * 100 if total else 0:5.1f}%  "
                       f"{sum(r['executed'] for r in part) / units:9.1f}  {_share(rs, sum(rs.values()), 6)}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass > this file")
    ap.add_argument("--units", type=float, default=1.0,
                    help="divide execution counts by this many units of work (default 1: raw warp-level counts)")
    ap.add_argument("--top", type=int, default=20, help="lines per section (default 20)")
    ap.add_argument("--regions", default=None, help="name=start-end,... (hex addresses relative to the kernel start)")
    args = ap.parse_args(argv)
    if args.units <= 0:
        ap.error("--units must be > 0")
    if args.top < 1:
        ap.error("--top must be >= 1")
    try:
        regions = parse_regions(args.regions)
        kernel, rows = load(args.csv)
    except (OSError, ValueError) as e:
        print(f"ncu_source_summary: {e}", file=sys.stderr)
        return 2
    print(summarize(kernel, rows, args.units, args.top, regions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
