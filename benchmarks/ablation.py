#!/usr/bin/env python3
"""Ablation of the sm90 decode kernel: which stage limits a shape (builds that drop a stage; results are wrong).

    python benchmarks/ablation.py [--variants 0,1,2,4,7] [--shapes b128-sk8192-h128-sq1,b128-sk8192-h16-sq1] \
        [--jobs 16] [--work-dir /tmp/fmla-ablation] [--sustain-s 1.2] [--build-only | --check-edits]

Each variant is the source tree copied to --work-dir/v<mask> with the edits of EDITS applied to the copy's
csrc/ (exact-match replacements of specific source lines; the release sources carry no ablation switch) and
built there (sm_90a only, builds in parallel). The variant is a bit mask:
  1  drop the KV refills: only a request's first two KV blocks are loaded, every later block completes its
     barriers on a plain arrive and computes on the stale tile (what remains: math, softmax, exchanges);
  2  drop 7 of the 9 column pieces of every Q K^T wgmma chain (the waits for all nine stay; dropping all
     nine made ptxas spill);
  4  drop the P V wgmmas;
  0  the unchanged kernel (the reference line of the table).
An edit that no longer matches the sources (the text to replace is missing or not unique) stops the run with
the variant and the file named: update EDITS together with the kernel. --check-edits only applies the edits
in memory (no build, no GPU); --build-only builds the variants and prints the registers and stack of the
sm90 kernels (cuobjdump -res-usage; needs nvcc but no GPU).
For each shape and variant one decode call (metadata of get_mla_metadata, CUDA graph, L2 flushed by a 256 MB
zero_ before each replay) is timed twice: "cool", the median of 60 replays after 2 s idle, and "sustained",
the median of --sustain-s seconds of back-to-back replays, with the SM clock and board power that nvidia-smi
samples every 50 ms meanwhile (shapes near the board's power limit lose clock in the sustained run).
Needs a Hopper GPU, nvcc, cmake, ninja and the in-place build's requirements (docs/build.md); takes about a minute
per variant to build.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import glob
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LABELS = {0: "main", 1: "no KV refills", 2: "Q K^T 2/9", 4: "no P V"}
DEFAULT_SHAPES = "b128-sk8192-h128-sq1,b128-sk8192-h128-sq2,b128-sk8192-h16-sq1,b128-varlen4096-h128-sq1"


def label(mask: int) -> str:
    if mask in LABELS:
        return LABELS[mask]
    return " + ".join(LABELS[bit] for bit in (1, 2, 4) if mask & bit)


@dataclass(frozen=True)
class Edit:
    """Replace the one occurrence of `old` in `path` (relative to the tree root) by `new`."""
    path: str
    old: str
    new: str


COPIES = "csrc/sm90/decode/copies.cuh"
MAINLOOP = "csrc/sm90/decode/mainloop.cuh"
QK_GEMM = "cute::gemm(mma, tSrQ(_, _, j * (kPieceCols / 16) + kb), tSrK(_, _, j * (kPieceCols / 16) + kb), tSrS);"
PV_LOOP = "for (int kb = 0; kb < size<2>(tOrV); ++kb) "
PV_REG = "cute::gemm(mma, tOrP(_, _, kb), tOrV(_, _, kb), tOrO);"
PV_SMEM = "cute::gemm(mma, tOsP(_, _, kb), tOrV(_, _, kb), tOrO);"

# The edits of each bit of the variant mask; a variant applies those of all its bits (they touch different lines).
EDITS: dict[int, list[Edit]] = {
    1: [Edit(COPIES,
             "                                                 int page, int hk) {\n"
             "  issue_kv_pieces<T, kMask>(tmap, full, stage_base, page, hk);\n}\n",
             "                                                 int page, int hk) {\n"
             "  // ablation 1: no refill; the barriers complete on a plain arrive and the stage keeps stale data\n"
             "  CUTLASS_PRAGMA_UNROLL\n"
             "  for (int j = 0; j < kNumPieces; ++j)\n"
             "    if ((kMask >> j) & 1u) full[j].arrive();\n}\n")],
    2: [Edit(MAINLOOP,
             f"      {QK_GEMM}\n",
             f"      if constexpr (j == 0 || j == kRopePiece)  // ablation 2: Q K^T on 2 of 9 pieces\n"
             f"        {QK_GEMM}\n")],
    4: [Edit(MAINLOOP, f"  {PV_LOOP}{PV_REG}\n", f"  {PV_LOOP}if constexpr (false) {PV_REG}  // ablation 4: no P V\n"),
        Edit(MAINLOOP, f"  {PV_LOOP}{PV_SMEM}\n", f"  {PV_LOOP}if constexpr (false) {PV_SMEM}  // ablation 4: no P V\n")],
}


class EditMismatch(Exception):
    """An edit of a variant does not match the sources it is applied to."""


def variant_edits(mask: int) -> list[Edit]:
    return [e for bit in (1, 2, 4) if mask & bit for e in EDITS[bit]]


def edited_sources(root: Path, mask: int) -> dict[str, str]:
    """The files variant `mask` changes under `root`, edited (path relative to root -> new text)."""
    out: dict[str, str] = {}
    for edit in variant_edits(mask):
        if edit.path not in out:
            src = root / edit.path
            if not src.is_file():
                raise EditMismatch(f"ablation variant {mask} ({label(mask)}): {edit.path} does not exist under {root}")
            out[edit.path] = src.read_text()
        count = out[edit.path].count(edit.old)
        if count != 1:
            first = next(line.strip() for line in edit.old.splitlines() if line.strip())
            raise EditMismatch(
                f"ablation variant {mask} ({label(mask)}): an edit of {edit.path} no longer matches the sources "
                f"(its text occurs {count} times, expected once; it starts with `{first}`): update EDITS in "
                f"benchmarks/ablation.py to the kernel")
        out[edit.path] = out[edit.path].replace(edit.old, edit.new)
    return out


def apply_edits(tree: Path, mask: int) -> list[str]:
    """Edits the copy at `tree` into variant `mask` (all edits are checked before a file is written)."""
    files = edited_sources(tree, mask)
    for rel, text in files.items():
        (tree / rel).write_text(text)
    return sorted(files)


def copy_tree(dst: Path) -> None:
    """The source tree without VCS data, build outputs and compiled modules."""
    skip = {".git", "build", ".stage", ".whl", "dist", "__pycache__", ".pytest_cache"}
    if dst.exists():
        shutil.rmtree(dst)

    def ignore(_dir: str, names: list[str]) -> set[str]:
        return {n for n in names if n in skip or n.endswith((".so", ".egg-info"))}

    shutil.copytree(ROOT, dst, ignore=ignore)


def build(mask: int, work_dir: Path, jobs: int) -> tuple[int, float, Path]:
    dst = work_dir / f"v{mask}"
    copy_tree(dst)
    changed = apply_edits(dst, mask)
    env = dict(os.environ, FLASHMLA_BACKEND_CUDA_ARCHS="90a", MAX_JOBS=str(jobs))
    t0 = time.time()
    log = dst / "build.log"
    with open(log, "w") as fh:
        fh.write(f"variant {mask} ({label(mask)}); edited: {', '.join(changed) or 'nothing'}\n")
        fh.flush()
        rc = subprocess.run(["cmake", "-S", ".", "-B", "build", "-G", "Ninja", f"-DPython_EXECUTABLE={sys.executable}"],
                            cwd=dst, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
        if rc == 0:  # in place: the module lands in dst/flashmla_backend/
            fh.flush()
            rc = subprocess.run(["cmake", "--build", "build"], cwd=dst, env=env, stdout=fh,
                                stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"build of variant {mask} ({label(mask)}) failed (rc {rc}); see {log}")
    return mask, time.time() - t0, dst


def find_cuobjdump() -> str | None:
    """cuobjdump from PATH, the CUDA toolkit of nvcc, or a pip-installed CUDA (nvidia/*/bin)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    dirs = [Path(os.environ[v]) / "bin" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    nvcc = shutil.which("nvcc")
    if nvcc:
        dirs.append(Path(nvcc).resolve().parent)
    dirs += [Path(p) for p in glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "nvidia", "*", "bin"))]
    return next((str(d / "cuobjdump") for d in dirs if (d / "cuobjdump").is_file()), None)


def kernel_resources(tree: Path) -> list[str]:
    """`<dtype>: REG:n STACK:n LOCAL:n` of the sm90 decode kernels built in `tree` (a spill shows as STACK > 0)."""
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        return ["registers not read: cuobjdump not found (PATH, CUDA_HOME/bin, next to nvcc)"]
    lines = []
    for obj in sorted(tree.glob("build/CMakeFiles/_C.dir/csrc/sm90/decode/instantiations/*.o")):
        out = subprocess.run([cuobjdump, "-res-usage", str(obj)], capture_output=True, text=True).stdout
        for m in re.finditer(r"Function (\S*sm90_decode_kernel\S*):\s*\n\s*(REG:\d+) (STACK:\d+) \S+ (LOCAL:\d+)", out):
            dtype = "bf16" if "bfloat16" in m.group(1) else "fp16" if "half" in m.group(1) else m.group(1)
            lines.append(f"{dtype}: {m.group(2)} {m.group(3)} {m.group(4)}")
    return lines or [f"no sm90 decode kernel found in the objects under {tree / 'build'}"]


def time_shapes(tag: str, shapes: str, sustain_s: float) -> None:
    """Runs inside a variant's tree (its PYTHONPATH): prints one `RESULT` line per shape."""
    import torch

    import flashmla_backend as fb
    from mla_bench import capture_graphs, make_inputs, make_seqlens, parse_shapes

    dev = torch.device("cuda")
    flush_buf = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=dev)

    def replays(g, n: int) -> list[float]:
        ev = []
        for _ in range(n):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            flush_buf.zero_()
            s.record()
            g()
            e.record()
            ev.append((s, e))
        torch.cuda.synchronize()
        return [a.elapsed_time(b) * 1e3 for a, b in ev]

    for shape in parse_shapes(shapes):
        lens = make_seqlens(shape, 0)
        inp = make_inputs(shape, lens, torch.bfloat16, dev, seed=0, copies=1)[0]
        seqlens = torch.tensor(lens, dtype=torch.int32, device=dev)
        meta, ns = fb.get_mla_metadata(seqlens, shape.s_q * shape.h_q, 1)
        call = lambda: fb.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, seqlens, 512, meta, ns,
                                                 causal=True)
        g = capture_graphs([call])[0]
        replays(g, 10)
        time.sleep(2.0)
        cool = statistics.median(replays(g, 60))
        smi = None
        if shutil.which("nvidia-smi"):
            smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                    "-lms", "50"], stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
        t0, ts = time.time(), []
        while time.time() - t0 < sustain_s:
            ts += replays(g, 50)
        rows = []
        if smi is not None:
            smi.terminate()
            rows = [line.split(",") for line in smi.communicate()[0].strip().splitlines() if "," in line]
        clock = statistics.median(float(r[0]) for r in rows) if rows else float("nan")
        power = max(float(r[1]) for r in rows) if rows else float("nan")
        print(f"RESULT {tag} {shape.name} {cool:.1f} {statistics.median(ts):.1f} {clock:.0f} {power:.0f}", flush=True)
        g = call = inp = None  # free the inputs before the next shape
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="0,1,2,4,7",
                    help="variant masks (1 no KV refills, 2 Q K^T on 2 of 9 pieces, 4 no P V), comma separated "
                         "(default 0,1,2,4,7)")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="benchmark shapes (the syntax of benchmarks/bench.py)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 4, help="compile jobs in total (default: all CPUs)")
    ap.add_argument("--work-dir", default="/tmp/fmla-ablation", help="where the variant trees are built")
    ap.add_argument("--sustain-s", type=float, default=1.2, help="seconds of back-to-back replays per shape")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--build-only", action="store_true",
                      help="build the variants and print the sm90 kernels' registers; no timing (no GPU needed)")
    mode.add_argument("--check-edits", action="store_true",
                      help="only check that every variant's source edits apply to the current sources")
    ap.add_argument("--time-only", metavar="TAG", help=argparse.SUPPRESS)  # internal: time in this tree
    args = ap.parse_args()
    if args.time_only:
        time_shapes(args.time_only, args.shapes, args.sustain_s)
        return

    masks = [int(v) for v in args.variants.split(",")]
    bad = [m for m in masks if not 0 <= m <= 7]
    if bad:
        raise SystemExit(f"--variants: masks are 0..7 (bits 1, 2, 4), got {bad}")
    try:
        for mask in masks:  # fail before any copy or build when an edit no longer matches
            edited_sources(ROOT, mask)
    except EditMismatch as e:
        raise SystemExit(str(e))
    if args.check_edits:
        for mask in masks:
            files = ", ".join(sorted({e.path for e in variant_edits(mask)})) or "no edits"
            print(f"variant {mask} ({label(mask)}): {len(variant_edits(mask))} edits apply ({files})")
        return
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    print(f"building {len(masks)} variants in {work_dir} ({args.jobs} compile jobs in total)", flush=True)
    trees = {}
    with concurrent.futures.ThreadPoolExecutor(len(masks)) as pool:
        for mask, secs, tree in pool.map(lambda m: build(m, work_dir, max(1, args.jobs // len(masks))), masks):
            print(f"  built variant {mask} ({label(mask)}) in {secs:.0f} s", flush=True)
            for line in kernel_resources(tree):
                print(f"    sm90_decode_kernel {line}", flush=True)
            trees[mask] = tree
    if args.build_only:
        return

    results = {}
    for i, mask in enumerate(masks, 1):
        print(f"[{i}/{len(masks)}] timing variant {mask} ({label(mask)})", flush=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(trees[mask]), os.environ.get("PYTHONPATH"))
                                                          if p))
        proc = subprocess.run([sys.executable, str(trees[mask] / "benchmarks" / "ablation.py"), "--time-only",
                               str(mask), "--shapes", args.shapes, "--sustain-s", str(args.sustain_s)],
                              cwd=trees[mask], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"timing variant {mask} failed:\n{proc.stderr[-3000:]}")
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                _, tag, shape, cool, sustained, clock, power = line.split()
                results[(int(tag), shape)] = (float(cool), float(sustained), clock, power)
                print(f"    {shape}: cool {cool} us, sustained {sustained} us, SM clock {clock} MHz, "
                      f"power up to {power} W", flush=True)

    shapes = list(dict.fromkeys(name for _, name in results))  # as the variants printed them (canonical names)
    print("\n| shape | " + " | ".join(f"{label(m)} (`{m}`)" for m in masks) + " |")
    print("|---|" + "---|" * len(masks))
    for shape in shapes:
        cells = []
        for m in masks:
            r = results.get((m, shape))
            cells.append("-" if r is None else f"{r[0]:.1f} / {r[1]:.1f} ({r[2]} MHz)")
        print(f"| {shape} | " + " | ".join(cells) + " |")
    print("\ncells: cool / sustained median µs (median SM clock of the sustained run)")


if __name__ == "__main__":
    main()
