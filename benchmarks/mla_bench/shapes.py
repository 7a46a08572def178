"""Shapes, sequence lengths, inputs and the FLOP/byte accounting of the MLA decode benchmark.

A shape is written `b<batch>-sk<keys>-h<heads>[-sq<q tokens>]` (every request has <keys> keys) or
`b<batch>-varlen<mean keys>-h<heads>[-sq<q tokens>]` (lengths drawn around the mean). One latent KV head,
the geometry of flashmla_backend.geometry (576-column rows, V = the first 512 columns, 64-token pages).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import torch

from flashmla_backend.geometry import HEAD_DIM_K, HEAD_DIM_V, PAGE_SIZE

D_QK = HEAD_DIM_K   # 576: latent (512) + RoPE (64) columns of a cache row and of a query row
D_V = HEAD_DIM_V    # 512: V = the first 512 columns of the same cache row
LSE_BYTES = 4       # lse is fp32
DEFAULT_L2_BYTES = 50 * 1024 * 1024   # H100 SXM L2; the device's own size is used when torch knows it
ROTATE_L2_FACTOR = 4                  # rotated copies together hold >= 4x L2 (if memory allows)
MAX_COPIES = 64

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}

__all__ = ["D_QK", "D_V", "PAGE_SIZE", "DTYPES", "Shape", "SHAPE_SYNTAX", "parse_shape", "parse_shapes",
           "DEFAULT_SHAPES", "QUICK_SHAPES", "make_seqlens", "visible_keys", "Work", "count_work",
           "DecodeInputs", "make_block_table", "make_inputs", "bytes_per_copy", "rotation_copies"]


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

