"""Running one shape: inputs, the correctness guard, timing of each implementation, the rows of the results.

Each row is a dict with the columns of results.csv (report.CSV_FIELDS); one row per (shape, implementation,
mode), mode "plain" (the Python call as a user makes it) or "graph" (CUDA-graph replays).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .check import Check, check_indices, compare_outputs, visible_rows
from .impls import ADAPTERS, BASELINE_IMPL, IMPLS, METADATA_IMPL, ImplUnavailable, ShapeContext, Variant, metadata_call
from .shapes import (D_QK, D_V, DEFAULT_L2_BYTES, DTYPES, Shape, Work, bytes_per_copy, count_work, make_inputs,
                     make_seqlens, rotation_copies)
from .timing import Ceilings, Timer, Timing, capture_graphs, derive_metrics, rotating


def log(msg: str = "") -> None:
    print(msg, flush=True)


@dataclasses.dataclass
class Config:
    shapes: list[Shape]
    impls: list[str]
    dtype_name: str = "bf16"
    causal: bool = True
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    graph: bool = False
    seed: int = 0
    triton_splits: list[int] = dataclasses.field(default_factory=lambda: [4, 8, 16, 32])
    max_rotation_bytes: int = 4 << 30
    l2_bytes: int = DEFAULT_L2_BYTES
    sm_count: int = 132

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def modes(self) -> list[str]:
        return ["plain", "graph"] if self.graph else ["plain"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def base_row(shape: Shape, cfg: Config, work: Work, copies: int, impl: str, mode: str) -> dict:
    """A result row with every column of results.csv, before timing (status ok, check unchecked)."""
    return {
        "shape": shape.name, "b": shape.b, "s_k": shape.s_k, "h_q": shape.h_q, "s_q": shape.s_q,
        "varlen": shape.varlen, "causal": cfg.causal, "dtype": cfg.dtype_name, "impl": impl, "mode": mode,
        "status": "ok", "reason": "", "variant": "", "us": None, "us_p20": None, "us_p80": None,
        "timer": "", "tflops": None, "gbs": None, "frac_flops": None, "frac_bw": None, "bound": None,
        "frac_ceiling": None, "roofline_us": None, "check": "unchecked", "check_detail": "",
        "max_row_err": None, "max_lse_err": None, "vs_ours_max_row_err": None, "speedup_vs_flashmla": None,
        "flops": work.flops, "bytes": work.bytes, "intensity": work.intensity,
        "visible_keys": work.visible_keys, "sum_seqlen": work.sum_seqlen, "copies": copies, "note": "", "tried": "",
    }


def _reason(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def _guard(variant: Variant, ctx: ShapeContext, ref: Optional[tuple], ours_full: Optional[tuple]
           ) -> tuple[Check, Optional[float], tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """Run the variant once on copy 0; compare with the reference slice, then with ours (whole batch)."""
    out, lse = variant.normalize(variant.calls[0]())
    _sync(ctx.device)
    rows_all = visible_rows(ctx.cache_seqlens, ctx.shape.s_q, ctx.causal)
    if ref is None:
        check = Check(True, None, None, "no reference")
    else:
        idx, ref_out, ref_lse = ref
        sel = torch.tensor(idx, device=out.device)
        sub_lse = lse.index_select(0, sel) if lse is not None else None
        check = compare_outputs(out.index_select(0, sel), sub_lse, ref_out, ref_lse, rows_all[idx])
    vs_ours = None
    if ours_full is not None:
        agree = compare_outputs(out, None, ours_full[0], None, rows_all)
        vs_ours = agree.max_row_err
        if not agree.ok and check.ok:
            check = Check(False, check.max_row_err, check.max_lse_err,
                          f"DISAGREES with ours on the full batch ({agree.detail}); vs reference: {check.detail}")
    return check, vs_ours, (out, lse)


def _check_label(check: Check, have_ref: bool) -> str:
    """WRONG: failed against the reference or disagrees with ours; unchecked: no reference."""
    if not check.ok:
        return "WRONG"
    return "ok" if have_ref else "unchecked"


def fill_timing(row: dict, timing: Timing, work: Work, ceilings: Optional[Ceilings]) -> None:
    """Put a timing and the metrics derived from it (TFLOP/s, GB/s, fractions of the ceilings) in a row."""
    row.update(us=timing.median_us, us_p20=timing.p20_us, us_p80=timing.p80_us, timer=timing.method)
    row.update(derive_metrics(work, timing.median_us, ceilings))


def progress_line(i: int, n: int, row: dict) -> str:
    head = f"[{i}/{n}] {row['shape']:<26} {row['impl']:<16} {row['mode']:<5}"
    if row["status"] != "ok":
        return f"{head} {row['status']}: {row['reason']}"
    text = f"{head} {row['us']:9.1f} us"
    if row["tflops"] is not None and row["impl"] != METADATA_IMPL:
        text += f"  {row['tflops']:7.1f} TFLOP/s  {row['gbs']:7.1f} GB/s"
        if row["frac_ceiling"] is not None:
            text += f"  {100 * row['frac_ceiling']:5.1f}% of {'matmul' if row['bound'] == 'compute' else 'copy'}"
    if row["impl"] != METADATA_IMPL:
        text += f"  check {row['check']}"
        if row["check_detail"]:
            text += f" ({row['check_detail']})"
    if row["variant"]:
        text += f"  [{row['variant']}]"
    if row["tried"]:
        text += f"\n        tried: {row['tried']}"
    return text


def run_impl(impl: str, ctx: ShapeContext, cfg: Config, work: Work, ceilings: Optional[Ceilings],
             timer: Timer, ref: Optional[tuple], ours_full: Optional[tuple], copies: int
             ) -> tuple[list[dict], Optional[tuple]]:
    """Rows (one per mode) for one implementation, and its full output (to compare others with)."""
    rows = {m: base_row(ctx.shape, cfg, work, copies, impl, m) for m in cfg.modes}

    def fail(status: str, reason: str) -> tuple[list[dict], None]:
        for r in rows.values():
            r.update(status=status, reason=reason)
        return list(rows.values()), None

    try:
        variants = ADAPTERS[impl](ctx)
    except ImplUnavailable as e:
        return fail("unavailable", str(e))
    except Exception as e:
        return fail("unavailable", _reason(e))

    tried = []   # (timing, variant, check, vs_ours, result)
    errors = []
    for v in variants:
        try:
            check, vs_ours, result = _guard(v, ctx, ref, ours_full)
            timing = timer(rotating(v.calls), cfg.warmup_ms, cfg.rep_ms)
            tried.append((timing, v, check, vs_ours, result))
            if len(variants) > 1:
                log(f"        {impl} {v.label}: {timing.median_us:.1f} us, check {'ok' if check.ok else 'WRONG'}")
        except Exception as e:   # an unsupported input, OOM...: this variant is out
            errors.append(f"{v.label or impl}: {_reason(e)}")
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
    if not tried:
        return fail("unavailable", "; ".join(errors))
    good = [t for t in tried if t[2].ok] or tried
    timing, best, check, vs_ours, result = min(good, key=lambda t: t[0].median_us)
    tried_text = ", ".join(f"{t[1].label} {t[0].median_us:.1f} us" + ("" if t[2].ok else " (WRONG)")
                           for t in tried) if len(tried) > 1 else ""
    if errors:
        tried_text = "; ".join(x for x in (tried_text, "failed: " + "; ".join(errors)) if x)
    for mode, row in rows.items():
        row.update(variant=best.label, note=best.note, tried=tried_text, check=_check_label(check, ref is not None),
                   check_detail=check.detail, max_row_err=check.max_row_err,
                   max_lse_err=check.max_lse_err, vs_ours_max_row_err=vs_ours)
        try:
            t = timer(rotating(capture_graphs(best.calls)), cfg.warmup_ms, cfg.rep_ms) if mode == "graph" else timing
            fill_timing(row, t, work, ceilings)
        except Exception as e:
            row.update(status="unavailable", reason=f"{mode} timing failed: {_reason(e)}")
    return list(rows.values()), result


def run_metadata(ctx: ShapeContext, cfg: Config, work: Work, timer: Timer, copies: int) -> list[dict]:
    rows = []
    for mode in cfg.modes:
        row = base_row(ctx.shape, cfg, work, copies, METADATA_IMPL, mode)
        row.update(check="n/a", flops=None, bytes=None, intensity=None)
        try:
            fn = metadata_call(ctx)
            fn_timed = rotating(capture_graphs([fn])) if mode == "graph" else fn
            t = timer(fn_timed, cfg.warmup_ms, cfg.rep_ms)
            row.update(us=t.median_us, us_p20=t.p20_us, us_p80=t.p80_us, timer=t.method)
        except Exception as e:
            row.update(status="unavailable", reason=_reason(e))
        rows.append(row)
    return rows


def reference_slice(ctx: ShapeContext) -> tuple[Optional[tuple], str]:
    """(indices, out, lse) of flashmla_backend.reference on a few requests of copy 0."""
    try:
        from flashmla_backend.reference import mla_decode_reference
    except ImportError as e:
        return None, f"flashmla_backend.reference import failed: {e}"
    idx = check_indices(ctx.seqlens)
    inp = ctx.inputs[0]
    sel = torch.tensor(idx, device=inp.q.device)
    out, lse = mla_decode_reference(inp.q.index_select(0, sel), inp.k_cache, inp.block_table.index_select(0, sel),
                                    ctx.cache_seqlens.index_select(0, sel), D_V, softmax_scale=ctx.scale,
                                    causal=ctx.causal)
    return (idx, out, lse), ""


def add_speedups(rows: list[dict]) -> None:
    """speedup_vs_flashmla = FlashMLA's median / this median, same shape and mode, both checked ok."""
    base = {(r["shape"], r["mode"]): r["us"] for r in rows
            if r["impl"] == BASELINE_IMPL and r["status"] == "ok" and r["check"] != "WRONG"}
    for r in rows:
        t = base.get((r["shape"], r["mode"]))
        if t is not None and r["impl"] in IMPLS and r["status"] == "ok" and r["check"] != "WRONG":
            r["speedup_vs_flashmla"] = t / r["us"]


def run_shape(shape: Shape, cfg: Config, ceilings: Optional[Ceilings], timer: Timer, device: torch.device,
              index: int = 1, total: int = 1) -> list[dict]:
    seqlens = make_seqlens(shape, cfg.seed)
    elem = torch.empty((), dtype=cfg.dtype).element_size()
    work = count_work(seqlens, shape.h_q, shape.s_q, cfg.causal, elem)
    copies = rotation_copies(bytes_per_copy(shape, seqlens, elem), cfg.l2_bytes, cfg.max_rotation_bytes)
    log(f"[{index}/{total}] {shape.name}: {shape.b} requests, {work.sum_seqlen} keys "
        f"(min {min(seqlens)}, max {max(seqlens)}), {work.kv_bytes / 1e9:.3f} GB KV, "
        f"{work.flops / 1e9:.1f} GFLOP, {work.intensity:.1f} FLOP/byte, {copies} input cop"
        f"{'y' if copies == 1 else 'ies'} rotated")
    inputs = make_inputs(shape, seqlens, cfg.dtype, device, cfg.seed, copies)
    ctx = ShapeContext(shape, seqlens, inputs, torch.tensor(seqlens, dtype=torch.int32, device=device),
                       max(seqlens), D_QK ** -0.5, cfg.causal, cfg.dtype, device, cfg.triton_splits,
                       cfg.sm_count)
    ref, why = reference_slice(ctx)
    if ref is None:
        log(f"    warning: no correctness reference ({why})")
    rows: list[dict] = []
    ours_full = None
    for impl in cfg.impls:
        impl_rows, result = run_impl(impl, ctx, cfg, work, ceilings, timer, ref, ours_full, copies)
        if impl == "ours" and result is not None and impl_rows[0]["check"] == "ok":
            ours_full = result       # the others are compared with ours only if ours passed
        for r in impl_rows:
            log(progress_line(index, total, r))
        rows += impl_rows
        if impl == "ours" and impl_rows[0]["status"] == "ok":
            for r in run_metadata(ctx, cfg, work, timer, copies):
                log(progress_line(index, total, r))
                rows.append(r)
    add_speedups(rows)
    for r in rows:
        if r["impl"] == "ours" and r["speedup_vs_flashmla"] is not None:
            log(f"[{index}/{total}] {shape.name} ours vs vLLM FlashMLA ({r['mode']}): "
                f"{r['speedup_vs_flashmla']:.3f}x")
    del ctx, inputs, ours_full
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows

