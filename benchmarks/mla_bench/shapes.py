"""Shapes, sequence lengths, inputs and the FLOP/byte accounting of the MLA decode benchmark.

A shape is written `b<batch>-sk<keys>-h<heads>[-sq<q tokens>]` (every request has <keys> keys) or
`b<batch>-varlen<mean keys>-h<heads>[-sq<q tokens>]` (lengths drawn around the mean). One latent KV head,
the geometry of flashmla_backend.geometry (576-column rows, V = the first 512 columns, 64-token pages).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Optional, Sequence

import torch

from flashmla_backend.geometry import HEAD_DIM_K, HEAD_DIM_V, PAGE_SIZE

D_QK = HEAD_DIM_K   # 576: latent (512) + RoPE (64) columns of a cache row and of a query row
D_V = HEAD_DIM_V    # 512: V = the first 512 columns of the same cache row
LSE_BYTES = 4       # lse is fp32
DEFAULT_L2_BYTES = 50 * 1024 * 1024   # H100 SXM L2; the device's own size is used when torch knows it
ROTATE_L2_FACTOR = 4                  # rotated copies together hold >= 4x L2 (if memory allows)
MAX_COPIES = 64

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
FP8 = torch.float8_e4m3fn   # the FP8 KV cache format (and the fast mode's q): e4m3, finite max 448
E4M3_MAX = 448.0

__all__ = ["D_QK", "D_V", "PAGE_SIZE", "DTYPES", "Shape", "SHAPE_SYNTAX", "parse_shape", "parse_shapes",
           "DEFAULT_SHAPES", "QUICK_SHAPES", "make_seqlens", "visible_keys", "Work", "count_work",
           "DecodeInputs", "make_block_table", "make_inputs", "bytes_per_copy", "rotation_copies", "FP8", "E4M3_MAX",
           "Fp8Inputs", "quantize_e4m3", "make_fp8_inputs", "fp8_bytes_per_copy", "rotation_copies_for",
           "one_fp8_case"]


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


# The main serving shapes first (h_q 128 and 16 at 8192 keys, MTP, b=1 latency, varlen), then more sizes.
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
    bytes: int        # KV rows touched once (sum(len) * 576 * kv elem) + q + out + lse
    kv_bytes: int
    visible_keys: int
    sum_seqlen: int

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def count_work(seqlens: Sequence[int], h_q: int, s_q: int, causal: bool, elem_size: int,
               kv_elem_size: Optional[int] = None, q_elem_size: Optional[int] = None) -> Work:
    """elem_size: bytes per element of the output (and, unless given separately, of the cache and q).
    An e4m3 cache: kv_elem_size=1 (q_elem_size=1 too for an e4m3 q); the output stays 16-bit."""
    b = len(seqlens)
    keys = visible_keys(seqlens, s_q, causal)
    kv = sum(seqlens) * D_QK * (elem_size if kv_elem_size is None else kv_elem_size)
    q = b * s_q * h_q * D_QK * (elem_size if q_elem_size is None else q_elem_size)
    out = b * s_q * h_q * D_V * elem_size
    lse = b * h_q * s_q * LSE_BYTES
    return Work(2 * h_q * (D_QK + D_V) * keys, kv + q + out + lse, kv, keys, sum(seqlens))


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
    return rotation_copies_for([copy_bytes], copy_bytes, l2_bytes, max_total_bytes)


def rotation_copies_for(timed_bytes: Sequence[int], held_bytes: int, l2_bytes: int, max_total_bytes: int) -> int:
    """Copies to rotate when each copy holds several input sets (the 16-bit one, the e4m3 one): enough that
    the smallest timed set's copies together hold ROTATE_L2_FACTOR x L2, with held_bytes (all the sets of
    one copy) times the count within max_total_bytes."""
    want = max(-(-ROTATE_L2_FACTOR * l2_bytes // max(1, n)) for n in timed_bytes)
    cap = max(1, max_total_bytes // max(1, held_bytes))
    return max(1, min(want, cap, MAX_COPIES))


# ---- FP8 (e4m3) KV cache ----------------------------------------------------------------------

@dataclasses.dataclass
class Fp8Inputs:
    """The e4m3 form of one DecodeInputs copy (same block table and lengths): true value = stored x descale."""
    k_cache: torch.Tensor      # [num_pages, 64, 1, 576] float8_e4m3fn
    descale_k: torch.Tensor    # [1] float32, amax(|k_cache 16-bit|) / 448, rounded up to bf16 (quantize_e4m3)
    q: torch.Tensor            # [b, s_q, h_q, 576] float8_e4m3fn (the fast mode's q)
    descale_q: torch.Tensor    # [1] float32, amax(|q|) / 448, rounded up to bf16

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_cache, self.descale_k, self.q, self.descale_q))


def bf16_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest bf16-representable fp32 values >= x (x finite and positive, fp32)."""
    bits = x.view(torch.int32).to(torch.int64)
    up = ((bits + 0xFFFF) & ~0xFFFF).to(torch.int32)
    return up.view(torch.float32)


def quantize_e4m3(x: torch.Tensor, chunk_elems: int = 1 << 27) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor e4m3: descale = amax(|x|) / 448 rounded up to a bf16-representable float (one-element fp32),
    stored = x / descale rounded to e4m3. bf16-representable because FlashInfer's FP8 MLA multiplies by
    bf16(scale): so every FP8 peer dequantizes the same bytes to the same values; rounding up keeps
    |x| / descale <= 448. Works in chunks of the first dimension so that the fp32 temporaries stay small."""
    amax = float(x.abs().amax().float()) if x.numel() else 0.0
    descale = bf16_ceil(torch.tensor([max(amax, 1e-12) / E4M3_MAX], dtype=torch.float32)).to(x.device)
    out = torch.empty(x.shape, dtype=FP8, device=x.device)
    rows = max(1, chunk_elems // max(1, x[0].numel())) if x.dim() and x.shape[0] else 1
    for i in range(0, x.shape[0] if x.dim() else 1, rows):
        part = x[i:i + rows] if x.dim() else x
        res = (part.float() / descale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)
        if x.dim():
            out[i:i + rows] = res
        else:
            out.copy_(res)
    return out, descale


def make_fp8_inputs(inputs: Sequence[DecodeInputs]) -> list[Fp8Inputs]:
    """The same data in e4m3: each copy's cache and q quantized once, each with its own per-tensor descale."""
    res = []
    for inp in inputs:
        k8, dk = quantize_e4m3(inp.k_cache)
        q8, dq = quantize_e4m3(inp.q)
        res.append(Fp8Inputs(k8, dk, q8, dq))
    return res


def one_fp8_case(shape: Shape, device: torch.device) -> tuple[list[int], DecodeInputs, Fp8Inputs, torch.Tensor]:
    """One input copy of a shape (seed 0, bf16), its e4m3 twin and the lengths as an int32 device tensor: what the
    FP8 kernel sweep and the split-error script time and check, (seqlens, inputs, e4m3 inputs, lengths)."""
    seqlens = make_seqlens(shape, 0)
    inp = make_inputs(shape, seqlens, torch.bfloat16, device, 0, 1)[0]
    return seqlens, inp, make_fp8_inputs([inp])[0], torch.tensor(seqlens, dtype=torch.int32, device=device)


def fp8_bytes_per_copy(shape: Shape, seqlens: Sequence[int]) -> int:
    """Memory of one Fp8Inputs copy (e4m3 cache pages, e4m3 q, two fp32 descales)."""
    pages = max(1, sum(-(-n // PAGE_SIZE) for n in seqlens))
    return pages * PAGE_SIZE * D_QK + shape.b * shape.s_q * shape.h_q * D_QK + 8

