"""What a run writes: the environment, results.json, results.csv, the markdown table and the roofline chart.

The chart needs matplotlib; without it write_outputs warns and writes the other three files.
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import warnings
from typing import Any, Optional

import torch

from .impls import ALL_IMPLS, FP8_IMPLS, IMPL_LABELS, IMPLS, METADATA_IMPL
from .run import Config, base_row, fp8_summary
from .shapes import PAGE_SIZE, Shape, Work
from .timing import Ceilings


def _package_version(name: str) -> Optional[str]:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _driver_version() -> str:
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return res.stdout.strip().splitlines()[0] if res.returncode == 0 and res.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _git_commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        res = subprocess.run(["git", "-C", here, "describe", "--always", "--dirty", "--abbrev=12"],
                             capture_output=True, text=True, timeout=20)
        return res.stdout.strip() if res.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def collect_environment(device: torch.device, command: str) -> dict:
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "python": platform.python_version(),
        "host": platform.node(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _package_version("triton"),
        "vllm": _package_version("vllm"),
        "flashmla_backend_git": _git_commit(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2 ** 30, 1),
                   l2_bytes=getattr(props, "L2_cache_size", None), driver=_driver_version())
    return env


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def config_dict(cfg: Config) -> dict:
    d = dataclasses.asdict(cfg)
    d["shapes"] = [s.name for s in cfg.shapes]
    return d


def write_json(path: str, env: dict, cfg: Config, ceilings: Optional[Ceilings], rows: list[dict]) -> None:
    doc = {"environment": env, "config": config_dict(cfg),
           "ceilings": dataclasses.asdict(ceilings) if ceilings else None, "results": rows}
    with open(path, "w") as f:
        json.dump(_clean(doc), f, indent=1, allow_nan=False)
        f.write("\n")


CSV_FIELDS = list(base_row(Shape(1, 1, 1), Config([], []), Work(0, 1, 0, 0, 0), 1, "", "").keys()) + [
    "copy_gbs", "matmul_tflops"]


def write_csv(path: str, ceilings: Optional[Ceilings], rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, restval="")
        w.writeheader()
        for r in rows:
            extra = {"copy_gbs": ceilings.copy_gbs, "matmul_tflops": ceilings.matmul_tflops} if ceilings else {}
            w.writerow({k: ("" if v is None else v) for k, v in _clean({**r, **extra}).items()})


def _cell_us(r: Optional[dict]) -> str:
    if r is None or r["status"] != "ok" or r["us"] is None:
        return "n/a"
    text = f"{r['us']:.1f}"
    if r["check"] == "WRONG":
        return text + " (WRONG)"
    if r["check"] == "unchecked":
        return text + " (unchecked)"
    return text


def _ratio_cell(x: Optional[float]) -> str:
    return f"{x:.2f}x" if x is not None else "n/a"


def _pct_cell(x: Optional[float]) -> str:
    return f"{100 * x:.0f}%" if x is not None else "n/a"


def _err_cell(r: Optional[dict], field: str) -> str:
    if r is None or r.get(field) is None:
        return "n/a"
    return f"{r[field]:.1e}" + (" (WRONG)" if r["check"] == "WRONG" else "")


def fp8_tables(cfg: Config, rows: list[dict]) -> list[str]:
    """Markdown lines of the FP8 tables (one per mode, then the accuracy table); [] without FP8 rows."""
    if not any(r["impl"] in FP8_IMPLS for r in rows):
        return []
    by = {(r["shape"], r["impl"], r["mode"]): r for r in rows}
    shapes = list(dict.fromkeys(r["shape"] for r in rows if r["impl"] in FP8_IMPLS))
    d16 = cfg.dtype_name
    # FlashInfer's column only where it was asked for (its rows exist, timed or unavailable).
    fi = any(r["impl"] == "flashinfer-fp8" for r in rows)
    fi_head = "FlashInfer-FP8 (16-bit q) µs | " if fi else ""
    lines = []
    for mode in cfg.modes:
        lines += ["", f"FP8 (e4m3) KV cache, {mode} calls" + (" (CUDA graph replays)" if mode == "graph" else
                                                                 " (includes Python launch overhead)") +
                  f": ours-fp8 = {d16} q (accurate mode), ours-fp8q = e4m3 q + descale_q (fast mode), "
                  "FlashMLA-FP8 = vLLM's flash_mla_with_kvcache_fp8 (e4m3 q); all on the same e4m3 cache. "
                  "% of copy = GB/s with the e4m3 byte count / device copy GB/s.", "",
                  f"| shape | ours-fp8 µs | ours-fp8q µs | FlashMLA-FP8 µs | " + fi_head + f"ours {d16} µs "
                  f"| ours-fp8q vs FlashMLA-FP8 | ours-fp8 / ours-fp8q time | ours-fp8 vs ours {d16} "
                  f"| ours-fp8 % of copy | ours-fp8q % of copy |",
                  "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if fi else "")]
        for s in shapes:
            sm = fp8_summary(rows, s, mode)
            cells = [s, _cell_us(by.get((s, "ours-fp8", mode))), _cell_us(by.get((s, "ours-fp8q", mode))),
                     _cell_us(by.get((s, "flashmla-fp8", mode)))]
            cells += [_cell_us(by.get((s, "flashinfer-fp8", mode)))] if fi else []
            cells += [_cell_us(by.get((s, "ours", mode))),
                      _ratio_cell(sm["fp8q_vs_flashmla_fp8"]), _ratio_cell(sm["fp8_over_fp8q"]),
                      _ratio_cell(sm["fp8_vs_16bit"]), _pct_cell(sm["fp8_frac_copy"]), _pct_cell(sm["fp8q_frac_copy"])]
            lines.append("| " + " | ".join(cells) + " |")
    mode = cfg.modes[0]
    lines += ["", f"FP8 accuracy: ||out - ref|| / ||ref|| over every row that sees a key, ref = fp64 decode of the "
                  f"dequantized e4m3 cache with (a) the original {d16} q, (b) the dequantized e4m3 q.", "",
              "| shape | ours-fp8 (a) | ours-fp8 (b) | ours-fp8q (a) | ours-fp8q (b) | FlashMLA-FP8 (a) "
              "| FlashMLA-FP8 (b) |" + (" FlashInfer-FP8 (a) | FlashInfer-FP8 (b) |" if fi else ""),
              "|---|---|---|---|---|---|---|" + ("---|---|" if fi else "")]
    for s in shapes:
        cells = [s]
        for impl in FP8_IMPLS if fi else [i for i in FP8_IMPLS if i != "flashinfer-fp8"]:
            r = by.get((s, impl, mode))
            cells += [_err_cell(r, "err_vs_bf16q"), _err_cell(r, "err_vs_fp8q")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def power_table(rows: list[dict]) -> list[str]:
    """With --power: each timed row's window, its average power and SM clock (a kernel at the board's power limit runs
    at a lower clock over a long window; benchmarks/README.md)."""
    timed = [r for r in rows if r.get("watts") is not None or r.get("sm_mhz") is not None]
    if not timed:
        return []
    lines = ["", "Power and SM clock over each timing window (NVML):", "",
             "| shape | impl | mode | µs | W | SM MHz (mean / min) | clock lowered by power or heat |",
             "|---|---|---|---|---|---|---|"]

    def num(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    for r in timed:
        clock = "n/a" if r["sm_mhz"] is None else f"{r['sm_mhz']:.0f} / {r['sm_mhz_min']:.0f}"
        capped = "n/a" if r["clock_capped"] is None else f"{100 * r['clock_capped']:.0f}% of samples"
        lines.append(f"| {r['shape']} | {r['impl']} | {r['mode']} | {num(r['us'], '.1f')} | {num(r['watts'], '.0f')} | "
                     f"{clock} | {capped} |")
    return lines


def markdown_report(env: dict, cfg: Config, ceilings: Optional[Ceilings], rows: list[dict]) -> str:
    lines = [
        f"Date: {env.get('date_utc')}; GPU: {env.get('gpu', 'n/a')} (driver {env.get('driver', 'n/a')}); "
        f"torch {env.get('torch')} (CUDA {env.get('cuda')}); triton {env.get('triton')}; vLLM {env.get('vllm')}; "
        f"flashmla_backend {env.get('flashmla_backend_git')}",
        f"Command: `{env.get('command')}`",
    ]
    if ceilings:
        lines.append(f"Ceilings (same run): device copy {ceilings.copy_gbs:.0f} GB/s (read + write); "
                     f"{ceilings.dtype} matmul {ceilings.matmul_n}^3 {ceilings.matmul_tflops:.0f} TFLOP/s")
    lines.append(f"{cfg.dtype_name}, KV cache {','.join(cfg.kv_dtypes)}, {'causal' if cfg.causal else 'non-causal'}, "
                 f"random data, page size {PAGE_SIZE}, shuffled block table; medians; speed-up = vLLM FlashMLA "
                 "time / ours (FP8 rows: vLLM FlashMLA-FP8 time / theirs).")
    by = {(r["shape"], r["impl"], r["mode"]): r for r in rows}
    shapes = list(dict.fromkeys(r["shape"] for r in rows if r["impl"] not in FP8_IMPLS))
    fi16 = any(r["impl"] == "flashinfer" for r in rows)     # its column only where it was asked for
    for mode in (cfg.modes if shapes else []):
        lines += ["", f"Timing: {mode} calls" + (" (CUDA graph replays)" if mode == "graph" else
                                                  " (includes Python launch overhead)"), "",
                  "| shape | ours µs | ours TFLOP/s | ours GB/s | ours % of ceiling | FlashMLA µs | Triton µs "
                  "| FA3 µs | " + ("FlashInfer µs | " if fi16 else "") + "naive µs | ours vs FlashMLA "
                  "| get_mla_metadata µs |",
                  "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if fi16 else "")]
        for s in shapes:
            ours = by.get((s, "ours", mode))
            ok = ours is not None and ours["status"] == "ok"
            frac = (f"{100 * ours['frac_ceiling']:.0f}% {'matmul' if ours['bound'] == 'compute' else 'copy'}"
                    if ok and ours["frac_ceiling"] is not None else "n/a")
            speed = ours.get("speedup_vs_flashmla") if ours else None
            meta = by.get((s, METADATA_IMPL, mode))
            cells = [s, _cell_us(ours), f"{ours['tflops']:.1f}" if ok else "n/a",
                     f"{ours['gbs']:.0f}" if ok else "n/a", frac,
                     _cell_us(by.get((s, "flashmla", mode))), _cell_us(by.get((s, "triton", mode))),
                     _cell_us(by.get((s, "fa3", mode)))]
            cells += [_cell_us(by.get((s, "flashinfer", mode)))] if fi16 else []
            cells += [_cell_us(by.get((s, "naive", mode))),
                     f"{speed:.2f}x" if speed else "n/a",
                     f"{meta['us']:.1f}" if meta and meta["status"] == "ok" else "n/a"]
            lines.append("| " + " | ".join(cells) + " |")
    lines += fp8_tables(cfg, rows)
    lines += power_table(rows)
    problems = [r for r in rows if r["status"] != "ok" or r["check"] == "WRONG"]
    if problems:
        lines += ["", "Notes:"]
        seen = set()
        for r in problems:
            text = (f"- {r['shape']} {r['impl']} ({r['mode']}): " +
                    (f"{r['status']}: {r['reason']}" if r["status"] != "ok" else f"WRONG: {r['check_detail']}"))
            if text not in seen:
                seen.add(text)
                lines.append(text)
    return "\n".join(lines) + "\n"


# FP8 rows: their own colours, non-circle markers and hatched bars; their intensity uses the e4m3 byte count.
CHART_COLORS = {"ours": "tab:red", "flashmla": "tab:blue", "triton": "tab:green", "fa3": "tab:purple",
                "flashinfer": "tab:olive", "naive": "tab:gray", "ours-fp8": "darkred", "ours-fp8q": "tab:orange",
                "flashmla-fp8": "tab:cyan", "flashinfer-fp8": "goldenrod"}
CHART_MARKERS = dict(zip(ALL_IMPLS, ("o",) * len(IMPLS) + ("D", "^", "s", "v")))
assert set(CHART_COLORS) == set(ALL_IMPLS) == set(CHART_MARKERS), "a colour and a marker for every implementation"


def write_chart(path: str, rows: list[dict], ceilings: Optional[Ceilings]) -> bool:
    """Roofline (intensity vs TFLOP/s with both ceilings) and grouped bars of µs per shape; FP8 rows, when
    present, with distinct markers and hatched bars."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        warnings.warn(f"matplotlib unavailable, no chart written ({e})")
        return False
    mode = "plain"
    data = [r for r in rows if r["impl"] in ALL_IMPLS and r["mode"] == mode and r["status"] == "ok"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(17, 6.5))
    colors, markers = CHART_COLORS, CHART_MARKERS
    if ceilings and data:
        xs = [r["intensity"] for r in data]
        lo, hi = min(xs + [ceilings.ridge]) / 3, max(xs + [ceilings.ridge]) * 3
        grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        ax1.plot(grid, [min(ceilings.matmul_tflops, x * ceilings.copy_gbs / 1e3) for x in grid], "k-",
                 label=f"ceilings: copy {ceilings.copy_gbs:.0f} GB/s, matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
    for impl in ALL_IMPLS:
        pts = [r for r in data if r["impl"] == impl]
        if not pts:
            continue
        good = [r for r in pts if r["check"] != "WRONG"]
        bad = [r for r in pts if r["check"] == "WRONG"]
        ax1.scatter([r["intensity"] for r in good], [r["tflops"] for r in good], color=colors[impl],
                    marker=markers[impl], label=IMPL_LABELS[impl], s=36, zorder=3)
        if bad:
            ax1.scatter([r["intensity"] for r in bad], [r["tflops"] for r in bad], color=colors[impl],
                        marker="x", s=60, zorder=3, label=f"{IMPL_LABELS[impl]} (WRONG output)")
        if impl == "ours":
            for r in pts:
                ax1.annotate(r["shape"], (r["intensity"], r["tflops"]), fontsize=6, xytext=(3, 3),
                             textcoords="offset points")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax1.set_ylabel("achieved TFLOP/s")
    ax1.set_title("Roofline (measured ceilings)")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7, loc="lower right")
    shapes = list(dict.fromkeys(r["shape"] for r in data))
    present = [i for i in ALL_IMPLS if any(r["impl"] == i for r in data)]
    width = 0.8 / max(1, len(present))
    for k, impl in enumerate(present):
        xs, ys = [], []
        for j, s in enumerate(shapes):
            r = next((r for r in data if r["shape"] == s and r["impl"] == impl), None)
            if r is not None:
                xs.append(j + (k - (len(present) - 1) / 2) * width)
                ys.append(r["us"])
        ax2.bar(xs, ys, width=width, color=colors[impl], label=IMPL_LABELS[impl],
                hatch="//" if impl in FP8_IMPLS else None, edgecolor="white" if impl in FP8_IMPLS else None)
    ax2.set_xticks(range(len(shapes)))
    ax2.set_xticklabels(shapes, rotation=45, ha="right", fontsize=7)
    ax2.set_yscale("log")
    ax2.set_ylabel("µs (median, lower is better)")
    ax2.set_title("Time per decode call")
    ax2.grid(True, axis="y", which="both", alpha=0.3)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


def write_outputs(out_dir: str, env: dict, cfg: Config, ceilings: Optional[Ceilings],
                  rows: list[dict]) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f) for k, f in
             (("json", "results.json"), ("csv", "results.csv"), ("md", "results.md"), ("png", "roofline.png"))}
    write_json(paths["json"], env, cfg, ceilings, rows)
    write_csv(paths["csv"], ceilings, rows)
    with open(paths["md"], "w") as f:
        f.write(markdown_report(env, cfg, ceilings, rows))
    if not write_chart(paths["png"], rows, ceilings):
        del paths["png"]
    return paths

