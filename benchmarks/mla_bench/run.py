"""Running one shape: inputs, the correctness guard, timing of each implementation, the rows of the results.

Each row is a dict with the columns of results.csv (report.CSV_FIELDS); one row per (shape, implementation,
mode), mode "plain" (the Python call as a user makes it) or "graph" (CUDA-graph replays).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .check import AGREE_ROW_REL_TOL, Check, check_indices, compare_outputs, dequantized_reference, rel_norm_error, visible_rows
from .impls import (ADAPTERS, ALL_IMPLS, FP8_IMPLS, FP8_Q_IMPLS, METADATA_IMPL, PEERS, ImplUnavailable, ShapeContext,
                    Variant, baseline_of, metadata_call)
from .power import describe_power
from .shapes import (D_QK, D_V, DEFAULT_L2_BYTES, DTYPES, Shape, Work, bytes_per_copy, count_work,
                     fp8_bytes_per_copy, make_fp8_inputs, make_inputs, make_seqlens, rotation_copies_for)
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
    kv_dtypes: list[str] = dataclasses.field(default_factory=lambda: ["bf16"])   # 16-bit (= dtype_name), fp8
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
        "varlen": shape.varlen, "causal": cfg.causal, "dtype": cfg.dtype_name, "kv_dtype": kv_dtype_of(impl, cfg),
        "q_dtype": q_dtype_of(impl, cfg), "impl": impl, "mode": mode,
        "status": "ok", "reason": "", "variant": "", "us": None, "us_p20": None, "us_p80": None,
        "timer": "", "tflops": None, "gbs": None, "frac_flops": None, "frac_bw": None, "bound": None,
        "frac_ceiling": None, "roofline_us": None, "check": "unchecked", "check_detail": "",
        "max_row_err": None, "max_lse_err": None, "vs_ours_max_row_err": None, "err_vs_bf16q": None,
        "err_vs_fp8q": None, "speedup_vs_flashmla": None,
        "flops": work.flops, "bytes": work.bytes, "intensity": work.intensity,
        "visible_keys": work.visible_keys, "sum_seqlen": work.sum_seqlen, "copies": copies, "note": "", "tried": "",
        "watts": None, "sm_mhz": None, "sm_mhz_min": None, "clock_capped": None,
    }


def kv_dtype_of(impl: str, cfg: Config) -> str:
    return "fp8_e4m3" if impl in FP8_IMPLS else cfg.dtype_name


def q_dtype_of(impl: str, cfg: Config) -> str:
    return "fp8_e4m3" if impl in FP8_Q_IMPLS else cfg.dtype_name


def work_of(impl: str, seqlens: list[int], shape: Shape, causal: bool, elem: int) -> Work:
    """The byte count of an implementation's inputs: an e4m3 cache is 1 byte per element, and so is an e4m3 q;
    out stays 16-bit (bf16 in the fast mode), lse fp32."""
    return count_work(seqlens, shape.h_q, shape.s_q, causal, elem,
                      kv_elem_size=1 if impl in FP8_IMPLS else None, q_elem_size=1 if impl in FP8_Q_IMPLS else None)


def _reason(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def _guard(variant: Variant, ctx: ShapeContext, ref: Optional[tuple], ours_full: Optional[tuple],
           peer: str = "ours") -> tuple[Check, Optional[float], tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """Run the variant once on copy 0; compare with the reference slice, then with its peer (whole batch)."""
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
        agree = compare_outputs(out, None, ours_full[0], None, rows_all, row_tol=AGREE_ROW_REL_TOL)
        vs_ours = agree.max_row_err
        if not agree.ok and check.ok:
            check = Check(False, check.max_row_err, check.max_lse_err,
                          f"DISAGREES with {peer} on the full batch ({agree.detail}); vs reference: {check.detail}")
    # A copy: adapters may return views of buffers that their later (timed) calls overwrite, and this result is
    # what the accuracy figures and the next peer comparisons read after the timing.
    return check, vs_ours, (out.clone(), lse.clone() if lse is not None else None)


def _check_label(check: Check, have_ref: bool) -> str:
    """WRONG: failed against the reference or disagrees with ours; unchecked: no reference."""
    if not check.ok:
        return "WRONG"
    return "ok" if have_ref else "unchecked"


def fill_timing(row: dict, timing: Timing, work: Work, ceilings: Optional[Ceilings]) -> None:
    """Put a timing and the metrics derived from it (TFLOP/s, GB/s, fractions of the ceilings) in a row."""
    row.update(us=timing.median_us, us_p20=timing.p20_us, us_p80=timing.p80_us, timer=timing.method)
    row.update(derive_metrics(work, timing.median_us, ceilings))
    if timing.power:  # --power: the timing window's average power, SM clock and share of clock-lowered samples
        row.update(watts=timing.power["watts"], sm_mhz=timing.power["sm_mhz_mean"],
                   sm_mhz_min=timing.power["sm_mhz_min"], clock_capped=timing.power["capped_fraction"])


def _sci(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.1e}"


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
    if row.get("err_vs_bf16q") is not None or row.get("err_vs_fp8q") is not None:
        text += f"  err vs fp64 ref: {_sci(row.get('err_vs_bf16q'))} (16-bit q), {_sci(row.get('err_vs_fp8q'))} (e4m3 q)"
    if row.get("watts") is not None or row.get("sm_mhz") is not None:
        text += "  " + describe_power(row["watts"], row["sm_mhz"], row["sm_mhz_min"], row["clock_capped"])
    if row["variant"]:
        text += f"  [{row['variant']}]"
    if row["tried"]:
        text += f"\n        tried: {row['tried']}"
    return text


def run_impl(impl: str, ctx: ShapeContext, cfg: Config, work: Work, ceilings: Optional[Ceilings],
             timer: Timer, ref: Optional[tuple], ours_full: Optional[tuple], copies: int,
             errs: Optional[dict] = None) -> tuple[list[dict], Optional[tuple]]:
    """Rows (one per mode) for one implementation, and its full output (to compare others with).

    ref: (indices, out, lse) the guard compares with; ours_full: the peer's full output (PEERS).
    errs: {row field: full-batch reference out}; each field gets rel_norm_error of the chosen variant's out."""
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
            check, vs_ours, result = _guard(v, ctx, ref, ours_full, PEERS.get(impl, "ours"))
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
    rows_all = visible_rows(ctx.cache_seqlens, ctx.shape.s_q, ctx.causal)
    err_values = {field: rel_norm_error(result[0], full, rows_all) for field, full in (errs or {}).items()}
    for mode, row in rows.items():
        row.update(err_values)
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


def _times(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.3f}x"


def _pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


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


def _usable(r: Optional[dict]) -> bool:
    return r is not None and r["status"] == "ok" and r["check"] != "WRONG" and bool(r["us"])


def add_speedups(rows: list[dict]) -> None:
    """speedup_vs_flashmla = FlashMLA's median / this median, same shape and mode, both checked ok.
    For the FP8 rows the baseline is vLLM's FlashMLA-FP8 (impls.baseline_of)."""
    base = {(r["shape"], r["mode"], r["impl"]): r["us"] for r in rows if _usable(r)}
    for r in rows:
        if r["impl"] not in ALL_IMPLS or not _usable(r):
            continue
        t = base.get((r["shape"], r["mode"], baseline_of(r["impl"])))
        if t is not None:
            r["speedup_vs_flashmla"] = t / r["us"]


def fp8_summary(rows: list[dict], shape: str, mode: str) -> dict:
    """The FP8 comparisons of one shape and mode, None where a row is missing, failed or WRONG:
      fp8q_vs_flashmla_fp8  FlashMLA-FP8's time / ours-fp8q's (throughput ratio, > 1: ours faster)
      fp8_over_fp8q         ours-fp8's time / ours-fp8q's (what the accurate mode costs, > 1: slower)
      fp8_vs_16bit          ours' (16-bit cache) time / ours-fp8's (speed-up of the e4m3 cache)
      fp8_frac_copy, fp8q_frac_copy  the fraction of the copy ceiling, with the e4m3 byte count"""
    by = {r["impl"]: r for r in rows if r["shape"] == shape and r["mode"] == mode}

    def ratio(num: str, den: str) -> Optional[float]:
        a, b = by.get(num), by.get(den)
        return a["us"] / b["us"] if _usable(a) and _usable(b) else None

    def frac(impl: str) -> Optional[float]:
        r = by.get(impl)
        return r["frac_bw"] if _usable(r) else None
    return {"fp8q_vs_flashmla_fp8": ratio("flashmla-fp8", "ours-fp8q"), "fp8_over_fp8q": ratio("ours-fp8", "ours-fp8q"),
            "fp8_vs_16bit": ratio("ours", "ours-fp8"), "fp8_frac_copy": frac("ours-fp8"),
            "fp8q_frac_copy": frac("ours-fp8q")}


def fp8_references(ctx: ShapeContext) -> dict:
    """Full-batch fp64 references on the dequantized e4m3 cache of copy 0: with the original 16-bit q
    ('err_vs_bf16q') and with the dequantized e4m3 q ('err_vs_fp8q'); each (out, lse)."""
    inp, f8 = ctx.inputs[0], ctx.fp8[0]
    common = (inp.block_table, ctx.seqlens, ctx.scale, ctx.causal, f8.descale_k)
    return {"err_vs_bf16q": dequantized_reference(inp.q, f8.k_cache, *common),
            "err_vs_fp8q": dequantized_reference(f8.q, f8.k_cache, *common, descale_q=f8.descale_q)}


def run_shape(shape: Shape, cfg: Config, ceilings: Optional[Ceilings], timer: Timer, device: torch.device,
              index: int = 1, total: int = 1) -> list[dict]:
    seqlens = make_seqlens(shape, cfg.seed)
    elem = torch.empty((), dtype=cfg.dtype).element_size()
    work = count_work(seqlens, shape.h_q, shape.s_q, cfg.causal, elem)
    want16 = any(i not in FP8_IMPLS for i in cfg.impls)
    want8 = any(i in FP8_IMPLS for i in cfg.impls)
    size16 = bytes_per_copy(shape, seqlens, elem)
    size8 = fp8_bytes_per_copy(shape, seqlens) if want8 else 0
    timed = ([size16] if want16 else []) + ([size8] if want8 else [])
    copies = rotation_copies_for(timed or [size16], size16 + size8, cfg.l2_bytes, cfg.max_rotation_bytes)
    kv_text = f"{work.kv_bytes / 1e9:.3f} GB KV" + (f" ({work.kv_bytes / elem / 1e9:.3f} GB as e4m3)" if want8 else "")
    log(f"[{index}/{total}] {shape.name}: {shape.b} requests, {work.sum_seqlen} keys "
        f"(min {min(seqlens)}, max {max(seqlens)}), {kv_text}, "
        f"{work.flops / 1e9:.1f} GFLOP, {work.intensity:.1f} FLOP/byte, {copies} input cop"
        f"{'y' if copies == 1 else 'ies'} rotated")
    inputs = make_inputs(shape, seqlens, cfg.dtype, device, cfg.seed, copies)
    ctx = ShapeContext(shape, seqlens, inputs, torch.tensor(seqlens, dtype=torch.int32, device=device),
                       max(seqlens), D_QK ** -0.5, cfg.causal, cfg.dtype, device, cfg.triton_splits,
                       cfg.sm_count)
    ref, why = reference_slice(ctx)
    if ref is None:
        log(f"    warning: no correctness reference ({why})")
    refs8: dict = {}
    if want8:
        ctx.fp8 = make_fp8_inputs(inputs)
        try:
            refs8 = fp8_references(ctx)
        except Exception as e:
            log(f"    warning: no fp64 reference for the FP8 rows ({_reason(e)})")
        f8 = ctx.fp8[0]
        log(f"    e4m3 inputs: descale_k {float(f8.descale_k):.4g}, descale_q {float(f8.descale_q):.4g} "
            f"(amax / 448, copy 0)")
    rows: list[dict] = []
    full: dict[str, tuple] = {}     # outputs of the implementations that passed, for their peers
    for impl in cfg.impls:
        impl_ref, errs = ref, None
        if impl in FP8_IMPLS:
            key = "err_vs_fp8q" if impl in FP8_Q_IMPLS else "err_vs_bf16q"
            idx = check_indices(seqlens)
            impl_ref = ((idx, refs8[key][0][idx], refs8[key][1][idx]) if refs8 else None)
            errs = {k: v[0] for k, v in refs8.items()}
        impl_work = work_of(impl, seqlens, shape, cfg.causal, elem)
        impl_rows, result = run_impl(impl, ctx, cfg, impl_work, ceilings, timer, impl_ref, full.get(PEERS.get(impl)),
                                     copies, errs)
        if result is not None and impl_rows[0]["check"] == "ok":
            full[impl] = result      # the others are compared with their peer only if it passed
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
    if want8:
        for mode in cfg.modes:
            s = fp8_summary(rows, shape.name, mode)
            log(f"[{index}/{total}] {shape.name} FP8 ({mode}): ours-fp8q vs FlashMLA-FP8 {_times(s['fp8q_vs_flashmla_fp8'])}, "
                f"ours-fp8 / ours-fp8q time {_times(s['fp8_over_fp8q'])}, ours-fp8 vs ours {cfg.dtype_name} "
                f"{_times(s['fp8_vs_16bit'])}, ours-fp8 {_pct(s['fp8_frac_copy'])} of copy (e4m3 bytes)")
    del ctx, inputs, full, refs8
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows

