"""Benchmark harness for MLA decode (DeepSeek-V3 absorbed form, page size 64) on Hopper.

One run measures:
  * ceilings: device-to-device copy bandwidth and dense matmul rate (n^3, the benchmark dtype);
  * per shape and implementation: median time, TFLOP/s, GB/s, fraction of the binding ceiling,
    and the speed-up against vLLM's bundled FlashMLA;
then writes results.json, results.csv, results.md and roofline.png under --out-dir and prints a
markdown table for benchmarks/RESULTS.md.

Implementations (--impls):
  ours      flashmla_backend.get_mla_metadata (once per shape) + flash_mla_with_kvcache
  flashmla  vLLM's bundled FlashMLA: vllm.third_party.flashmla.flash_mla_interface (vllm._flashmla_C)
  triton    vLLM's Triton MLA decode: vllm.v1.attention.ops.triton_decode_attention.decode_attention_fwd,
            best of several num_kv_splits
  fa3       vLLM's FlashAttention-3 MLA decode: vllm.vllm_flash_attn.flash_attn_varlen_func with
            q = rope part, q_v = latent part, k = rope columns, v = latent columns of the cache
  naive     batched PyTorch: gather pages, matmul, fp32 softmax, matmul
The vLLM ones are optional: a missing import or an unsupported call is reported, not fatal.

Usage: python -m flashmla_backend.bench --help   (every option is described in benchmarks/README.md)
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import itertools
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import warnings
from typing import Any, Callable, Optional, Sequence

import torch

# ----------------------------------------------------------------------------------------------
# Problem constants
# ----------------------------------------------------------------------------------------------

D_QK = 576          # latent (512) + RoPE (64) columns of a cache row and of a query row
D_V = 512           # V = the first 512 columns of the same cache row
PAGE_SIZE = 64      # tokens per KV page (the only page size of flashmla_backend for now)
LSE_BYTES = 4       # lse is fp32
DEFAULT_L2_BYTES = 50 * 1024 * 1024   # H100 SXM L2; the device's own size is used when torch knows it
ROTATE_L2_FACTOR = 4                  # rotated copies together hold >= 4x L2 (if memory allows)
MAX_COPIES = 64
FLUSH_BYTES = 256 * 1024 * 1024       # L2 flush buffer of the CUDA-event timer (as do_bench)
COPY_CEILING_BYTES = 1 << 30          # bytes read by the copy ceiling (the same number is written)
MATMUL_CEILING_N = 8192

IMPLS = ("ours", "flashmla", "triton", "fa3", "naive")    # also the order in which they run
IMPL_LABELS = {
    "ours": "ours",
    "flashmla": "vLLM FlashMLA",
    "triton": "vLLM Triton MLA",
    "fa3": "vLLM FA3 MLA",
    "naive": "naive PyTorch",
}
METADATA_IMPL = "get_mla_metadata"   # rows timing flashmla_backend.get_mla_metadata alone
BASELINE_IMPL = "flashmla"           # speed-ups are relative to this one

# Correctness guard tolerances (against flashmla_backend.reference on a slice of the batch, and
# against ours on the whole batch). A correct bf16 decode is ~3e-3 per row (median) and up to
# ~1e-2 on short, peaked rows (naive vs reference, measured); real bugs give errors of order 1.
OUT_ROW_REL_TOL = 3e-2     # max over query rows of ||out - ref||_2 / ||ref||_2
LSE_ATOL = 1e-2
LSE_RTOL_FP32 = 1e-3       # lse returned in fp32
LSE_RTOL_LOWP = 1.6e-2     # lse returned in bf16/fp16 (vLLM's Triton kernel)

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def log(msg: str = "") -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Shape:
    b: int            # requests
    s_k: int          # keys per request; with varlen, the mean of N(s_k, (s_k/2)^2) clipped to >= 1
    h_q: int          # query heads (one latent KV head)
    s_q: int = 1      # query tokens per request
    varlen: bool = False

    @property
    def name(self) -> str:
        keys = f"varlen{self.s_k}" if self.varlen else f"sk{self.s_k}"
        return f"b{self.b}-{keys}-h{self.h_q}-sq{self.s_q}"


SHAPE_SYNTAX = "b<batch>-sk<keys>-h<heads>[-sq<q tokens>] or b<batch>-varlen<mean keys>-h<heads>[-sq<q tokens>]"
_SHAPE_RE = re.compile(r"b(\d+)-(sk|varlen)(\d+)-h(\d+)(?:-sq(\d+))?")


def parse_shape(text: str) -> Shape:
    m = _SHAPE_RE.fullmatch(text.strip().lower())
    if m is None:
        raise ValueError(f"bad shape {text!r}: expected {SHAPE_SYNTAX}, e.g. b128-sk8192-h128-sq1")
    b, kind, s_k, h_q, s_q = m.groups()
    shape = Shape(int(b), int(s_k), int(h_q), int(s_q) if s_q is not None else 1, kind == "varlen")
    for field in ("b", "s_k", "h_q", "s_q"):
        if getattr(shape, field) < 1:
            raise ValueError(f"bad shape {text!r}: {field} must be >= 1")
    return shape


def parse_shapes(text: str) -> list[Shape]:
    items = [t for t in re.split(r"[,\s]+", text.strip()) if t]
    if not items:
        raise ValueError("empty shape list")
    shapes: list[Shape] = []
    for item in items:
        shape = parse_shape(item)
        if shape not in shapes:
            shapes.append(shape)
    return shapes


# Issue 3's targets first, then the other rows of the design brief's section 5 table.
DEFAULT_SHAPES = parse_shapes(
    "b128-sk8192-h128-sq1, b128-sk8192-h128-sq2, b128-sk8192-h16-sq1, b64-sk8192-h32-sq1,"
    "b1-sk8192-h128-sq1, b128-varlen4096-h128-sq1, b128-varlen4096-h16-sq1,"
    "b128-sk4096-h16-sq1, b128-sk4096-h128-sq1, b128-sk8192-h64-sq2, b16-sk32768-h128-sq1,"
    "b8-sk2048-h16-sq1"
)
QUICK_SHAPES = parse_shapes("b4-sk1000-h16-sq1, b3-varlen300-h128-sq2, b1-sk64-h128-sq1")


def make_seqlens(shape: Shape, seed: int) -> list[int]:
    """Key counts per request. Fixed: all s_k. Varlen: round(N(s_k, (s_k/2)^2)) clipped to >= 1.

    Depends only on (seed, b, s_k), so shapes differing only in h_q or s_q get the same lengths."""
    if not shape.varlen:
        return [shape.s_k] * shape.b
    gen = torch.Generator().manual_seed(seed)
    lens = torch.normal(float(shape.s_k), shape.s_k / 2.0, size=(shape.b,), generator=gen)
    return [int(x) for x in lens.round().clamp(min=1).tolist()]


# ----------------------------------------------------------------------------------------------
# FLOP and byte accounting (the only place where work is counted)
# ----------------------------------------------------------------------------------------------

def visible_keys(seqlens: Sequence[int], s_q: int, causal: bool) -> int:
    """Sum over requests and query tokens of the keys each token sees.

    causal: token j (0-based) of a request with n keys sees keys 0 .. n - s_q + j."""
    total = 0
    for n in seqlens:
        if causal:
            total += sum(max(0, n - s_q + j + 1) for j in range(s_q))
        else:
            total += n * s_q
    return total


@dataclasses.dataclass(frozen=True)
class Work:
    flops: int        # 2 * h_q * (576 + 512) * visible keys (QK^T over 576 columns, PV over 512)
    bytes: int        # KV rows touched once (sum(len) * 576 * elem) + q + out + lse
    kv_bytes: int
    visible_keys: int
    sum_seqlen: int

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def count_work(seqlens: Sequence[int], h_q: int, s_q: int, causal: bool, elem_size: int) -> Work:
    b = len(seqlens)
    keys = visible_keys(seqlens, s_q, causal)
    kv = sum(seqlens) * D_QK * elem_size
    q = b * s_q * h_q * D_QK * elem_size
    out = b * s_q * h_q * D_V * elem_size
    lse = b * h_q * s_q * LSE_BYTES
    return Work(2 * h_q * (D_QK + D_V) * keys, kv + q + out + lse, kv, keys, sum(seqlens))


@dataclasses.dataclass(frozen=True)
class Ceilings:
    copy_gbs: float        # device copy, (bytes read + bytes written) / s / 1e9
    matmul_tflops: float   # n^3 matmul in the benchmark dtype
    copy_bytes: int
    matmul_n: int
    dtype: str

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) where the two ceilings meet."""
        return self.matmul_tflops * 1e12 / (self.copy_gbs * 1e9)


def derive_metrics(work: Work, median_us: float, ceilings: Optional[Ceilings]) -> dict:
    s = median_us * 1e-6
    tflops = work.flops / s / 1e12
    gbs = work.bytes / s / 1e9
    m = {"tflops": tflops, "gbs": gbs, "frac_flops": None, "frac_bw": None,
         "bound": None, "frac_ceiling": None, "roofline_us": None}
    if ceilings is not None:
        m["frac_flops"] = tflops / ceilings.matmul_tflops
        m["frac_bw"] = gbs / ceilings.copy_gbs
        m["bound"] = "compute" if work.intensity >= ceilings.ridge else "memory"
        m["frac_ceiling"] = m["frac_flops"] if m["bound"] == "compute" else m["frac_bw"]
        floor_s = max(work.flops / (ceilings.matmul_tflops * 1e12), work.bytes / (ceilings.copy_gbs * 1e9))
        m["roofline_us"] = floor_s * 1e6
    return m


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class DecodeInputs:
    q: torch.Tensor            # [b, s_q, h_q, 576]
    k_cache: torch.Tensor      # [num_pages, 64, 1, 576]
    block_table: torch.Tensor  # [b, max_pages] int32, shuffled pages; unused entries = page 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.k_cache, self.block_table))


def make_block_table(seqlens: Sequence[int], gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Shuffled page assignment: request i's pages are a random subset of range(num_pages)."""
    pages = [-(-n // PAGE_SIZE) for n in seqlens]
    num_pages = max(1, sum(pages))
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    table = torch.zeros(len(seqlens), max(1, max(pages, default=0)), dtype=torch.int32)
    start = 0
    for i, p in enumerate(pages):
        table[i, :p] = perm[start:start + p]
        start += p
    return table, num_pages


def make_inputs(shape: Shape, seqlens: Sequence[int], dtype: torch.dtype, device: torch.device,
                seed: int, copies: int) -> list[DecodeInputs]:
    """`copies` independent sets of random (never zero) q, paged cache and block table."""
    out = []
    for c in range(copies):
        cpu_gen = torch.Generator().manual_seed(seed * 1000 + c + 1)
        dev_gen = torch.Generator(device=device).manual_seed(seed * 1000 + c + 1)
        table, num_pages = make_block_table(seqlens, cpu_gen)
        q = torch.randn(shape.b, shape.s_q, shape.h_q, D_QK, generator=dev_gen, device=device, dtype=dtype)
        k = torch.randn(num_pages, PAGE_SIZE, 1, D_QK, generator=dev_gen, device=device, dtype=dtype)
        out.append(DecodeInputs(q, k, table.to(device)))
    return out


def bytes_per_copy(shape: Shape, seqlens: Sequence[int], elem_size: int) -> int:
    pages = max(1, sum(-(-n // PAGE_SIZE) for n in seqlens))
    max_pages = max(1, max(-(-n // PAGE_SIZE) for n in seqlens))
    return (pages * PAGE_SIZE * D_QK * elem_size + shape.b * shape.s_q * shape.h_q * D_QK * elem_size
            + shape.b * max_pages * 4)


def rotation_copies(copy_bytes: int, l2_bytes: int, max_total_bytes: int) -> int:
    """How many input copies to rotate so that one copy is out of L2 when it comes back."""
    want = -(-ROTATE_L2_FACTOR * l2_bytes // max(1, copy_bytes))
    cap = max(1, max_total_bytes // max(1, copy_bytes))
    return max(1, min(want, cap, MAX_COPIES))


# ----------------------------------------------------------------------------------------------
# The naive baseline
# ----------------------------------------------------------------------------------------------

from flashmla_backend.reference import naive_mla_decode  # noqa: E402  (re-exported for the harness)


# ----------------------------------------------------------------------------------------------
# Correctness guard
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Check:
    ok: bool
    max_row_err: Optional[float]
    max_lse_err: Optional[float]
    detail: str


def visible_rows(cache_seqlens: torch.Tensor, s_q: int, causal: bool) -> torch.Tensor:
    """[b, s_q] bool: query tokens that see at least one key."""
    n = cache_seqlens.to(torch.long).view(-1, 1)
    if causal:
        return (n - s_q + 1 + torch.arange(s_q, device=n.device).view(1, s_q)) > 0
    return (n > 0).expand(-1, s_q)


def compare_outputs(out: torch.Tensor, lse: Optional[torch.Tensor], ref_out: torch.Tensor,
                    ref_lse: Optional[torch.Tensor], rows: torch.Tensor) -> Check:
    """out/ref_out [n, s_q, h_q, dv], lse/ref_lse [n, h_q, s_q] or None, rows [n, s_q] bool.
    Only rows that see a key are compared (rows without keys are convention, checked by tests)."""
    if tuple(out.shape) != tuple(ref_out.shape):
        return Check(False, None, None, f"output shape {tuple(out.shape)} != {tuple(ref_out.shape)}")
    mask = rows.to(out.device).unsqueeze(-1).expand(out.shape[:3])    # [n, s_q, h_q]
    if not bool(mask.any()):
        return Check(True, None, None, "no row sees a key")
    o = out.float()[mask]
    r = ref_out.float().to(out.device)[mask]
    if not bool(torch.isfinite(o).all()):
        return Check(False, None, None, "non-finite values in the output")
    row_err = float(((o - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)).max())
    ok = row_err <= OUT_ROW_REL_TOL
    detail = f"max row err {row_err:.1e}"
    lse_err = None
    if lse is not None and ref_lse is not None:
        lmask = mask.transpose(1, 2)                                     # [n, h_q, s_q]
        got = lse.float()[lmask]
        want = ref_lse.float().to(lse.device)[lmask]
        rtol = LSE_RTOL_FP32 if lse.dtype == torch.float32 else LSE_RTOL_LOWP
        if not bool(torch.isfinite(got).all()):
            return Check(False, row_err, None, detail + ", non-finite lse")
        diff = (got - want).abs()
        lse_err = float(diff.max())
        ok = ok and bool((diff <= LSE_ATOL + rtol * want.abs()).all())
        detail += f", max lse err {lse_err:.1e}"
    return Check(ok, row_err, lse_err, detail)


def check_indices(seqlens: Sequence[int]) -> list[int]:
    """Requests compared with the reference: first, last, longest, shortest."""
    b = len(seqlens)
    longest = max(range(b), key=lambda i: seqlens[i])
    shortest = min(range(b), key=lambda i: seqlens[i])
    return sorted({0, b - 1, longest, shortest})


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Timing:
    median_us: float
    p20_us: float
    p80_us: float
    method: str


Timer = Callable[[Callable[[], Any], float, float], Timing]


def _time_with_do_bench(fn: Callable[[], Any], warmup_ms: float, rep_ms: float) -> Timing:
    import triton.testing
    q = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    med, p20, p80 = (float(x) * 1e3 for x in q)
    return Timing(med, p20, p80, "triton.testing.do_bench")


def _time_with_events(fn: Callable[[], Any], warmup_ms: float, rep_ms: float) -> Timing:
    """Like do_bench: flush L2 before each timed call, one event pair per call, quantiles."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        fn()
    n = max(1, int(rep_ms / estimate_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = torch.tensor([s.elapsed_time(e) for s, e in zip(starts, ends)], dtype=torch.float64)
    med, p20, p80 = (float(torch.quantile(times, q)) * 1e3 for q in (0.5, 0.2, 0.8))
    return Timing(med, p20, p80, "cuda events")


TIMER_NAMES = {"_time_with_do_bench": "triton.testing.do_bench median", "_time_with_events": "CUDA events median"}


def pick_timer() -> Timer:
    try:
        import triton.testing
    except ImportError:
        return _time_with_events
    return _time_with_do_bench if hasattr(triton.testing, "do_bench") else _time_with_events


def rotating(calls: Sequence[Callable[[], Any]]) -> Callable[[], Any]:
    """One call per invocation, cycling through the input copies."""
    it = itertools.cycle(calls)
    return lambda: next(it)()


def capture_graphs(calls: Sequence[Callable[[], Any]]) -> list[Callable[[], Any]]:
    """Capture each call in its own CUDA graph; returns the replay functions."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:          # warm up (JIT compiles, lazy allocations) outside the capture
            c()
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = []
    for c in calls:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            c()
        graphs.append(g)
    torch.cuda.synchronize()
    return [g.replay for g in graphs]


def copy_ceiling_gbs(device: torch.device, timer: Timer, warmup_ms: float, rep_ms: float, nbytes: int) -> float:
    """Device-to-device copy of nbytes: (bytes read + bytes written) / median time, GB/s."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src), warmup_ms, rep_ms)
    return 2 * nbytes / (t.median_us * 1e-6) / 1e9


def matmul_ceiling_tflops(device: torch.device, dtype: torch.dtype, timer: Timer, warmup_ms: float,
                          rep_ms: float, n: int) -> float:
    """n x n x n matmul in dtype: 2 n^3 / median time, TFLOP/s."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    t = timer(lambda: torch.matmul(a, b, out=c), warmup_ms, rep_ms)
    return 2 * n ** 3 / (t.median_us * 1e-6) / 1e12


def measure_ceilings(device: torch.device, dtype: torch.dtype, dtype_name: str, timer: Timer,
                     warmup_ms: float, rep_ms: float, copy_bytes: int = COPY_CEILING_BYTES,
                     matmul_n: int = MATMUL_CEILING_N) -> Ceilings:
    gbs = copy_ceiling_gbs(device, timer, warmup_ms, rep_ms, copy_bytes)
    tflops = matmul_ceiling_tflops(device, dtype, timer, warmup_ms, rep_ms, matmul_n)
    torch.cuda.empty_cache()
    return Ceilings(copy_gbs=gbs, matmul_tflops=tflops, copy_bytes=copy_bytes, matmul_n=matmul_n, dtype=dtype_name)


# ----------------------------------------------------------------------------------------------
# Implementations: each adapter turns a ShapeContext into Variants (or raises ImplUnavailable)
# ----------------------------------------------------------------------------------------------

class ImplUnavailable(Exception):
    """The implementation cannot run here (import failed, unsupported GPU or inputs)."""


@dataclasses.dataclass
class ShapeContext:
    shape: Shape
    seqlens: list[int]
    inputs: list[DecodeInputs]     # rotated copies; all share cache_seqlens
    cache_seqlens: torch.Tensor    # [b] int32 on the device
    max_seqlen: int
    scale: float
    causal: bool
    dtype: torch.dtype
    device: torch.device
    triton_splits: list[int]
    sm_count: int


@dataclasses.dataclass
class Variant:
    label: str                                   # e.g. "num_kv_splits=16"; "" if only one
    calls: list[Callable[[], Any]]               # one zero-argument call per input copy
    normalize: Callable[[Any], tuple[torch.Tensor, Optional[torch.Tensor]]]  # -> out [b,s_q,h,512], lse [b,h,s_q]
    note: str = ""


def _standard(result: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    out, lse = result
    return out, lse


def prepare_ours(ctx: ShapeContext) -> list[Variant]:
    try:
        from flashmla_backend import flash_mla_with_kvcache, get_mla_metadata
    except ImportError as e:
        raise ImplUnavailable(f"flashmla_backend import failed: {e}") from e
    shape = ctx.shape
    sched, splits = get_mla_metadata(ctx.cache_seqlens, shape.s_q * shape.h_q, 1)

    def make(inp: DecodeInputs) -> Callable[[], Any]:
        return lambda: flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, ctx.cache_seqlens, D_V,
                                              sched, splits, softmax_scale=ctx.scale, causal=ctx.causal)
    return [Variant("", [make(i) for i in ctx.inputs], _standard, "metadata computed once per shape")]


def metadata_call(ctx: ShapeContext) -> Callable[[], Any]:
    from flashmla_backend import get_mla_metadata
    n = ctx.shape.s_q * ctx.shape.h_q
    return lambda: get_mla_metadata(ctx.cache_seqlens, n, 1)


def prepare_flashmla(ctx: ShapeContext) -> list[Variant]:
    """vLLM 0.26: get_mla_metadata() returns an empty FlashMLASchedMeta that the first
    flash_mla_with_kvcache call fills (dense_decode_fwd); later calls reuse it."""
    try:
        from vllm.third_party.flashmla import flash_mla_interface as fmi
    except Exception as e:  # ImportError, or the extension failing to load
        raise ImplUnavailable(f"vllm.third_party.flashmla import failed: {type(e).__name__}: {e}") from e
    sched, _ = fmi.get_mla_metadata()

    def make(inp: DecodeInputs) -> Callable[[], Any]:
        return lambda: fmi.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, ctx.cache_seqlens, D_V,
                                                  sched, None, softmax_scale=ctx.scale, causal=ctx.causal)
    return [Variant("", [make(i) for i in ctx.inputs], _standard, "sched meta filled by the first call, reused")]


def vllm_triton_default_splits(max_seqlen: int, sm_count: int) -> int:
    """vLLM 0.26 triton_mla.py's choice: next_pow2(max_seqlen // 512) capped at 2 * SMs."""
    ideal = 1 << max(0, (max(1, max_seqlen // 512) - 1).bit_length())
    return min(ideal, 2 * sm_count)


def prepare_triton(ctx: ShapeContext) -> list[Variant]:
    """s_q > 1 is flattened: token j of request i becomes a request whose length is the number of
    keys the token sees (vLLM's Triton backend itself only decodes s_q = 1)."""
    try:
        from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd
    except Exception as e:
        raise ImplUnavailable(f"vllm triton_decode_attention import failed: {type(e).__name__}: {e}") from e
    shape, dev = ctx.shape, ctx.device
    rows = shape.b * shape.s_q
    lens = ctx.cache_seqlens.to(torch.int32)
    if shape.s_q > 1:
        per_token = lens.view(-1, 1).expand(-1, shape.s_q)
        if ctx.causal:
            per_token = per_token - shape.s_q + 1 + torch.arange(shape.s_q, device=dev, dtype=torch.int32)
        lens = per_token.clamp(min=0).reshape(rows).to(torch.int32).contiguous()
    tables = [i.block_table.repeat_interleave(shape.s_q, dim=0).contiguous() for i in ctx.inputs]
    qs = [i.q.reshape(rows, shape.h_q, D_QK) for i in ctx.inputs]
    caches = [i.k_cache for i in ctx.inputs]
    latents = [c[..., :D_V] for c in caches]      # V = first 512 columns of the same rows (a view)
    o = torch.empty(rows, shape.h_q, D_V, dtype=ctx.dtype, device=dev)
    lse = torch.empty(rows, shape.h_q, dtype=ctx.dtype, device=dev)
    one = torch.ones((), dtype=torch.float32, device=dev)
    splits = sorted(set(ctx.triton_splits) | {vllm_triton_default_splits(ctx.max_seqlen, ctx.sm_count)})

    def normalize(res: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        out, l = res
        return (out.view(shape.b, shape.s_q, shape.h_q, D_V),
                l.view(shape.b, shape.s_q, shape.h_q).permute(0, 2, 1))

    variants = []
    for n in splits:
        logits = torch.empty(rows, shape.h_q, n, D_V + 1, dtype=torch.float32, device=dev)

        def make(c: int, n: int = n, logits: torch.Tensor = logits) -> Callable[[], Any]:
            def call() -> Any:
                decode_attention_fwd(qs[c], caches[c], latents[c], o, lse, tables[c], lens,
                                     logits, n, ctx.scale, PAGE_SIZE, k_scale=one, v_scale=one, is_mla=True)
                return o, lse
            return call
        note = "s_q flattened into the batch" if shape.s_q > 1 else ""
        variants.append(Variant(f"num_kv_splits={n}", [make(c) for c in range(len(ctx.inputs))], normalize, note))
    return variants


def prepare_fa3(ctx: ShapeContext) -> list[Variant]:
    """As vLLM 0.26's FlashAttnMLAImpl.forward_mqa: q = rope part [T, h, 64], q_v = latent part
    [T, h, 512], k = cache[..., 512:], v = cache[..., :512], scheduler metadata computed once."""
    try:
        from vllm.vllm_flash_attn import (flash_attn_varlen_func, get_scheduler_metadata,
                                          fa_version_unsupported_reason, is_fa_version_supported)
    except Exception as e:
        raise ImplUnavailable(f"vllm.vllm_flash_attn import failed: {type(e).__name__}: {e}") from e
    if not is_fa_version_supported(3):
        raise ImplUnavailable(f"FA3 not supported: {fa_version_unsupported_reason(3)}")
    shape, dev = ctx.shape, ctx.device
    rows = shape.b * shape.s_q
    cu_q = torch.arange(0, shape.b + 1, dtype=torch.int32, device=dev) * shape.s_q
    sched = get_scheduler_metadata(
        batch_size=shape.b, max_seqlen_q=shape.s_q, max_seqlen_k=ctx.max_seqlen, num_heads_q=shape.h_q,
        num_heads_kv=1, headdim=D_QK - D_V, cache_seqlens=ctx.cache_seqlens, qkv_dtype=ctx.dtype,
        headdim_v=D_V, page_size=PAGE_SIZE, cu_seqlens_q=cu_q, causal=ctx.causal, num_splits=0)

    def make(inp: DecodeInputs) -> Callable[[], Any]:
        q = inp.q.reshape(rows, shape.h_q, D_QK)
        q_nope, q_pe = q[..., :D_V].contiguous(), q[..., D_V:].contiguous()
        k_pe, kv_c = inp.k_cache[..., D_V:], inp.k_cache[..., :D_V]
        return lambda: flash_attn_varlen_func(
            q=q_pe, k=k_pe, v=kv_c, q_v=q_nope, max_seqlen_q=shape.s_q, cu_seqlens_q=cu_q,
            max_seqlen_k=ctx.max_seqlen, seqused_k=ctx.cache_seqlens, block_table=inp.block_table,
            softmax_scale=ctx.scale, causal=ctx.causal, return_softmax_lse=True, fa_version=3,
            scheduler_metadata=sched, num_splits=0)

    def normalize(res: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        out, lse = res                                   # [T, h, 512], [h, T]
        return (out.view(shape.b, shape.s_q, shape.h_q, D_V),
                lse.view(shape.h_q, shape.b, shape.s_q).permute(1, 0, 2))
    return [Variant("", [make(i) for i in ctx.inputs], normalize, "scheduler metadata computed once")]


def prepare_naive(ctx: ShapeContext) -> list[Variant]:
    def make(inp: DecodeInputs) -> Callable[[], Any]:
        return lambda: naive_mla_decode(inp.q, inp.k_cache, inp.block_table, ctx.cache_seqlens, D_V,
                                        ctx.max_seqlen, softmax_scale=ctx.scale, causal=ctx.causal)
    return [Variant("", [make(i) for i in ctx.inputs], _standard, "padded to the longest request")]


ADAPTERS: dict[str, Callable[[ShapeContext], list[Variant]]] = {
    "ours": prepare_ours,
    "flashmla": prepare_flashmla,
    "triton": prepare_triton,
    "fa3": prepare_fa3,
    "naive": prepare_naive,
}


# ----------------------------------------------------------------------------------------------
# Running one shape
# ----------------------------------------------------------------------------------------------

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


def _base_row(shape: Shape, cfg: Config, work: Work, copies: int, impl: str, mode: str) -> dict:
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


def _fill(row: dict, timing: Timing, work: Work, ceilings: Optional[Ceilings]) -> None:
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
    rows = {m: _base_row(ctx.shape, cfg, work, copies, impl, m) for m in cfg.modes}

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
            _fill(row, t, work, ceilings)
        except Exception as e:
            row.update(status="unavailable", reason=f"{mode} timing failed: {_reason(e)}")
    return list(rows.values()), result


def run_metadata(ctx: ShapeContext, cfg: Config, work: Work, timer: Timer, copies: int) -> list[dict]:
    rows = []
    for mode in cfg.modes:
        row = _base_row(ctx.shape, cfg, work, copies, METADATA_IMPL, mode)
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


# ----------------------------------------------------------------------------------------------
# Environment and outputs
# ----------------------------------------------------------------------------------------------

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


def command_line(argv: Optional[Sequence[str]]) -> str:
    if argv is None:
        return shlex.join(getattr(sys, "orig_argv", sys.argv))
    return shlex.join(["python", "-m", "flashmla_backend.bench", *argv])


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


CSV_FIELDS = list(_base_row(Shape(1, 1, 1), Config([], []), Work(0, 1, 0, 0, 0), 1, "", "").keys()) + [
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
    lines.append(f"{cfg.dtype_name}, {'causal' if cfg.causal else 'non-causal'}, random data, page size "
                 f"{PAGE_SIZE}, shuffled block table; medians; speed-up = vLLM FlashMLA time / ours.")
    by = {(r["shape"], r["impl"], r["mode"]): r for r in rows}
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    for mode in cfg.modes:
        lines += ["", f"Timing: {mode} calls" + (" (CUDA graph replays)" if mode == "graph" else
                                                  " (includes Python launch overhead)"), "",
                  "| shape | ours µs | ours TFLOP/s | ours GB/s | ours % of ceiling | FlashMLA µs | Triton µs "
                  "| FA3 µs | naive µs | ours vs FlashMLA | get_mla_metadata µs |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
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
                     _cell_us(by.get((s, "fa3", mode))), _cell_us(by.get((s, "naive", mode))),
                     f"{speed:.2f}x" if speed else "n/a",
                     f"{meta['us']:.1f}" if meta and meta["status"] == "ok" else "n/a"]
            lines.append("| " + " | ".join(cells) + " |")
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


def write_chart(path: str, rows: list[dict], ceilings: Optional[Ceilings]) -> bool:
    """Roofline (intensity vs TFLOP/s with both ceilings) and grouped bars of µs per shape."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        warnings.warn(f"matplotlib unavailable, no chart written ({e})")
        return False
    mode = "plain"
    data = [r for r in rows if r["impl"] in IMPLS and r["mode"] == mode and r["status"] == "ok"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(17, 6.5))
    colors = dict(zip(IMPLS, ("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:gray")))
    if ceilings and data:
        xs = [r["intensity"] for r in data]
        lo, hi = min(xs + [ceilings.ridge]) / 3, max(xs + [ceilings.ridge]) * 3
        grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        ax1.plot(grid, [min(ceilings.matmul_tflops, x * ceilings.copy_gbs / 1e3) for x in grid], "k-",
                 label=f"ceilings: copy {ceilings.copy_gbs:.0f} GB/s, matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
    for impl in IMPLS:
        pts = [r for r in data if r["impl"] == impl]
        if not pts:
            continue
        good = [r for r in pts if r["check"] != "WRONG"]
        bad = [r for r in pts if r["check"] == "WRONG"]
        ax1.scatter([r["intensity"] for r in good], [r["tflops"] for r in good], color=colors[impl],
                    label=IMPL_LABELS[impl], s=36, zorder=3)
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
    present = [i for i in IMPLS if any(r["impl"] == i for r in data)]
    width = 0.8 / max(1, len(present))
    for k, impl in enumerate(present):
        xs, ys = [], []
        for j, s in enumerate(shapes):
            r = next((r for r in data if r["shape"] == s and r["impl"] == impl), None)
            if r is not None:
                xs.append(j + (k - (len(present) - 1) / 2) * width)
                ys.append(r["us"])
        ax2.bar(xs, ys, width=width, color=colors[impl], label=IMPL_LABELS[impl])
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


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

def _arg_shapes(text: str) -> list[Shape]:
    try:
        return parse_shapes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _arg_impls(text: str) -> list[str]:
    names = [t for t in re.split(r"[,\s]+", text.strip().lower()) if t]
    if not names:
        raise argparse.ArgumentTypeError("empty implementation list")
    if names == ["all"]:
        return list(IMPLS)
    bad = [n for n in names if n not in IMPLS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown implementation(s) {', '.join(map(repr, bad))}; "
                                         f"choose from {', '.join(IMPLS)} or 'all'")
    return [i for i in IMPLS if i in names]     # run order: ours first (others are compared with it)


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
        prog="python -m flashmla_backend.bench",
        description="Benchmark MLA decode: flashmla_backend against vLLM's FlashMLA, Triton MLA, FA3 MLA "
                    "and a naive PyTorch decode, with measured copy-bandwidth and matmul ceilings.")
    p.add_argument("--shapes", type=_arg_shapes, default=None,
                   help=f"comma-separated shapes, each {SHAPE_SYNTAX} (default: issue 3's targets and the "
                        "design brief's table; with --quick: a few small shapes)")
    p.add_argument("--impls", type=_arg_impls, default=list(IMPLS),
                   help=f"comma-separated subset of {','.join(IMPLS)}, or 'all' (default: all)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="q/KV/out dtype (default bf16)")
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
    p.add_argument("--max-rotation-gib", type=_arg_positive_float, default=4.0,
                   help="cap on the memory of the rotated input copies, GiB (default 4)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        parser.error(f"--out-dir {args.out_dir!r} exists and is not a folder")
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
    log(f"{env['gpu']} (sm {env['capability']}, {env['sm_count']} SMs, L2 {cfg.l2_bytes / 2 ** 20:.0f} MiB), "
        f"driver {env['driver']}, torch {env['torch']}, CUDA {env['cuda']}, triton {env['triton']}, "
        f"vLLM {env['vllm']}; timer: {TIMER_NAMES.get(timer.__name__, timer.__name__)}")
    log(f"{len(cfg.shapes)} shapes x {', '.join(cfg.impls)}; {cfg.dtype_name}, "
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
