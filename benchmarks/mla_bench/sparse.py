"""Sparse (DeepSeek-V3.2) decode: shapes, fp8_ds_mla inputs, the work count and an fp64 reference of a few requests.

A shape is written `b<batch>-sq<q tokens>-h<heads>-topk<k>[-pool<tokens>]`: <batch> requests with <q tokens> query
tokens each, <heads> query heads, and each query token attends to <k> distinct tokens of its own request's pool of
<tokens> cache tokens (DEFAULT_POOL when the suffix is left out). benchmarks/sparse_bench.py times it.

The inputs (make_sparse_inputs), on any device:
  - k_cache [b * pool / 64, 64, 1, 656] uint8, fp8_ds_mla tokens (flashmla_backend.fp8_ds_mla) encoding random
    values: latent ~ N(0, 1) times a gain 2^u per token and 128-channel group, u uniform in [-spread, spread]
    (spread 0: every gain 1), rope ~ N(0, 1); or, with cache="bf16", [b * pool / 64, 64, 1, 576] bf16 holding the
    same values rounded to bf16. Request i owns pool / 64 pages, a random subset of the cache's pages
    (`pages`, in the manner of a shuffled block table), so one request's tokens lie all over the cache.
  - indices [b, s_q, topk] int32: for each query token, topk distinct random positions of its request's pool, in
    random order, each written as FlashMLA's sparse decode reads it: page * 64 + offset into the whole cache.
  - q [b, s_q, h_q, 576] bf16 ~ N(0, sigma^2), sigma chosen so that a score q . k * softmax_scale has unit
    variance over these keys (q_std), with softmax_scale = 576 ** -0.5.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

import torch

from flashmla_backend import fp8_ds_mla
from flashmla_backend.geometry import HEAD_DIM_K, HEAD_DIM_V, PAGE_SIZE

from .check import rel_norm_error

TOKEN_BYTES = fp8_ds_mla.TOKEN_BYTES     # 656 bytes a cache token
CACHES = {"fp8_ds_mla": TOKEN_BYTES, "bf16": 2 * HEAD_DIM_K}   # the caches of the inputs, and their bytes a token
DEFAULT_POOL = 8192                      # cache tokens per request when a shape names none
INT32_MAX = 2 ** 31 - 1

__all__ = ["TOKEN_BYTES", "CACHES", "DEFAULT_POOL", "SparseShape", "SPARSE_SHAPE_SYNTAX", "parse_sparse_shape",
           "parse_sparse_shapes", "DEFAULT_SPARSE_SHAPES", "sparse_flops", "gathered_bytes", "q_std",
           "SparseInputs", "make_sparse_inputs", "sparse_reference", "relative_error"]


@dataclasses.dataclass(frozen=True)
class SparseShape:
    b: int       # requests
    s_q: int     # query tokens per request
    h_q: int     # query heads (one latent KV head)
    topk: int    # cache tokens each query token attends to, distinct, all inside its request's pool
    pool: int    # cache tokens per request (a multiple of 64: whole pages)

    @property
    def name(self) -> str:
        return f"b{self.b}-sq{self.s_q}-h{self.h_q}-topk{self.topk}-pool{self.pool}"

    @property
    def num_tokens(self) -> int:
        return self.b * self.pool

    @property
    def num_pages(self) -> int:
        return self.num_tokens // PAGE_SIZE


SPARSE_SHAPE_SYNTAX = "b<batch>-sq<q tokens>-h<heads>-topk<k>[-pool<tokens per request>]"
_SPARSE_RE = re.compile(r"b(\d+)-sq(\d+)-h(\d+)-topk(\d+)(?:-pool(\d+))?")


def check_pool(pool: int, what: str = "pool") -> None:
    """ValueError unless pool is a positive multiple of the 64-token page."""
    if pool < 1 or pool % PAGE_SIZE:
        raise ValueError(f"{what} must be a positive multiple of {PAGE_SIZE} (whole {PAGE_SIZE}-token pages), "
                         f"got {pool}")


def parse_sparse_shape(text: str, default_pool: int = DEFAULT_POOL) -> SparseShape:
    """`b128-sq1-h128-topk2048` or `b128-sq1-h128-topk2048-pool16384` (case and surrounding spaces ignored);
    default_pool for a shape without -pool. ValueError naming the shape and what is wrong."""
    m = _SPARSE_RE.fullmatch(text.strip().lower())
    if m is None:
        raise ValueError(f"bad sparse shape {text!r}: expected {SPARSE_SHAPE_SYNTAX}, e.g. b128-sq1-h128-topk2048")
    b, s_q, h_q, topk, pool = m.groups()
    shape = SparseShape(int(b), int(s_q), int(h_q), int(topk), int(pool) if pool is not None else default_pool)
    for field in ("b", "s_q", "h_q", "topk"):
        if getattr(shape, field) < 1:
            raise ValueError(f"bad sparse shape {text!r}: {field} must be >= 1")
    try:
        check_pool(shape.pool)
    except ValueError as e:
        raise ValueError(f"bad sparse shape {text!r}: {e}") from None
    if shape.topk > shape.pool:
        raise ValueError(f"bad sparse shape {text!r}: topk {shape.topk} distinct tokens do not fit in a pool of "
                         f"{shape.pool} tokens per request")
    if shape.num_tokens > INT32_MAX:
        raise ValueError(f"bad sparse shape {text!r}: b * pool = {shape.num_tokens} cache tokens cannot be named "
                         "by int32 indices")
    return shape


def parse_sparse_shapes(text: str, default_pool: int = DEFAULT_POOL) -> list[SparseShape]:
    """Shapes separated by commas or spaces, duplicates dropped (first kept)."""
    items = [t for t in re.split(r"[,\s]+", text.strip()) if t]
    if not items:
        raise ValueError("empty sparse shape list")
    shapes: list[SparseShape] = []
    for item in items:
        shape = parse_sparse_shape(item, default_pool)
        if shape not in shapes:
            shapes.append(shape)
    return shapes


# DeepSeek-V3.2's top-k of 2048 at h_q 128 (one GPU holds all heads) and 64: the serving batch, MTP (s_q 2), a
# half batch, b = 1 latency, and a 4x larger pool (the same gather, spread over more memory).
DEFAULT_SPARSE_SHAPES = ("b128-sq1-h128-topk2048,b128-sq2-h128-topk2048,b64-sq1-h128-topk2048,"
                         "b128-sq1-h64-topk2048,b1-sq1-h128-topk2048,b128-sq1-h128-topk2048-pool32768")


def sparse_flops(shape: SparseShape) -> int:
    """2 * b * s_q * h_q * topk * (576 + 512): Q K^T over 576 columns and P V over 512, for every gathered key."""
    return 2 * shape.b * shape.s_q * shape.h_q * shape.topk * (HEAD_DIM_K + HEAD_DIM_V)


def gathered_bytes(shape: SparseShape, cache: str = "fp8_ds_mla") -> int:
    """b * s_q * topk * 656 (1152 with the bf16 cache): every query token's keys read once, as a gather per query
    token reads them."""
    return shape.b * shape.s_q * shape.topk * CACHES[cache]


def mean_square_gain(spread: float) -> float:
    """E[4^u] for u uniform in [-spread, spread]: the mean of a group gain 2^u squared."""
    if spread == 0:
        return 1.0
    return (4.0 ** spread - 4.0 ** -spread) / (2 * spread * math.log(4.0))


def q_std(spread: float, softmax_scale: float = HEAD_DIM_K ** -0.5) -> float:
    """The standard deviation of q's entries that gives the scores q . k * softmax_scale unit variance, when the
    keys' latent channels are N(0, 1) times gains 2^u (u uniform in [-spread, spread]) and their rope N(0, 1)."""
    key_power = HEAD_DIM_V * mean_square_gain(spread) + (HEAD_DIM_K - HEAD_DIM_V)
    return 1.0 / (softmax_scale * math.sqrt(key_power))


@dataclasses.dataclass
class SparseInputs:
    shape: SparseShape
    q: torch.Tensor          # [b, s_q, h_q, 576] bf16
    k_cache: torch.Tensor    # [num_pages, 64, 1, 656] uint8, fp8_ds_mla tokens (or [num_pages, 64, 1, 576] bf16)
    indices: torch.Tensor    # [b, s_q, topk] int32, page * 64 + offset into the whole cache
    pages: torch.Tensor      # [b, pool / 64] int32: the cache pages of each request's pool
    softmax_scale: float
    spread: float
    values: Optional[torch.Tensor] = None   # [num_tokens, 576] float32, what was encoded (keep_values=True only)
    cache: str = "fp8_ds_mla"                # or "bf16" (CACHES)

    @property
    def ds(self) -> bool:
        return self.cache == "fp8_ds_mla"

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.k_cache, self.indices, self.pages))


def _token_values(n: int, spread: float, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """n tokens [n, 576] float32: latent N(0, 1) x 2^u per 128-channel group (u uniform in [-spread, spread]),
    rope N(0, 1)."""
    x = torch.randn(n, HEAD_DIM_K, generator=gen, device=device)
    if spread:
        u = (torch.rand(n, fp8_ds_mla.GROUPS, generator=gen, device=device) * 2 - 1) * spread
        gains = torch.exp2(u).repeat_interleave(fp8_ds_mla.GROUP, dim=1)
        x[:, :HEAD_DIM_V] *= gains
    return x


def make_sparse_inputs(shape: SparseShape, device: torch.device, seed: int = 0, spread: float = 0.0,
                       keep_values: bool = False, chunk_tokens: int = 1 << 16, cache: str = "fp8_ds_mla"
                       ) -> SparseInputs:
    """The inputs of one sparse decode (module docstring), made on `device` from `seed`; the cache is encoded in
    chunks of chunk_tokens tokens so that the float32 temporaries stay small. keep_values: also return the float32
    values that were encoded (as much memory as the cache times 3.5). cache: "fp8_ds_mla" or "bf16" (the same
    values, the same indices and q for a seed)."""
    if not (spread >= 0 and math.isfinite(spread)):
        raise ValueError(f"spread must be a finite number >= 0 (log2 of the largest group gain), got {spread!r}")
    if cache not in CACHES:
        raise ValueError(f"cache must be one of {', '.join(CACHES)}, got {cache!r}")
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    per_request = shape.pool // PAGE_SIZE
    pages = torch.randperm(shape.num_pages, generator=cpu_gen).to(torch.int32).view(shape.b, per_request)
    pages = pages.to(device)

    ds = cache == "fp8_ds_mla"
    tokens = (torch.empty(shape.num_tokens, TOKEN_BYTES, dtype=torch.uint8, device=device) if ds else
              torch.empty(shape.num_tokens, HEAD_DIM_K, dtype=torch.bfloat16, device=device))
    values = torch.empty(shape.num_tokens, HEAD_DIM_K, dtype=torch.float32, device=device) if keep_values else None
    for start in range(0, shape.num_tokens, chunk_tokens):
        n = min(chunk_tokens, shape.num_tokens - start)
        x = _token_values(n, spread, gen, device)
        tokens[start:start + n] = fp8_ds_mla.quantize(x) if ds else x.to(torch.bfloat16)
        if values is not None:
            values[start:start + n] = x
    k_cache = tokens.view(shape.num_pages, PAGE_SIZE, 1, tokens.shape[-1])

    # topk distinct positions of the pool per query token, in random order (the order of random keys' ranks).
    keys = torch.rand(shape.b, shape.s_q, shape.pool, generator=gen, device=device)
    positions = keys.argsort(dim=-1)[..., :shape.topk]                                   # [b, s_q, topk] int64
    page = torch.gather(pages.long()[:, None, :].expand(shape.b, shape.s_q, per_request), 2,
                        positions // PAGE_SIZE)
    indices = (page * PAGE_SIZE + positions % PAGE_SIZE).to(torch.int32)

    scale = HEAD_DIM_K ** -0.5
    q = (torch.randn(shape.b, shape.s_q, shape.h_q, HEAD_DIM_K, generator=gen, device=device)
         * q_std(spread, scale)).to(torch.bfloat16)
    return SparseInputs(shape, q, k_cache, indices, pages, scale, spread, values, cache)


def sparse_reference(inp: SparseInputs, requests: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 sparse decode of the first `requests` requests on the CPU: flashmla_backend's sparse reference on the
    exactly dequantized tokens (the bf16 tokens' values with the bf16 cache), with q's bf16 values taken as fp64.
    Only the tokens those requests' indices name are copied to the host (a compact cache of one token a page, indices
    renumbered). Returns out [n, s_q, h_q, 512] float64 and lse [n, h_q, s_q] float32 (natural log)."""
    from flashmla_backend.reference import sparse_mla_decode_reference

    n = min(max(1, int(requests)), inp.shape.b)
    idx = inp.indices[:n].long()
    named, local = torch.unique(idx.flatten(), return_inverse=True)
    width = inp.k_cache.shape[-1]
    tokens = inp.k_cache.view(-1, width)[named].cpu()
    if not inp.ds:
        tokens = tokens.double()   # the reference reads a 16-bit-valued cache in q's dtype
    compact = tokens.view(-1, 1, 1, width)
    local = local.view(idx.shape).to(torch.int32).cpu()
    q = inp.q[:n].cpu().double()
    return sparse_mla_decode_reference(q, compact, local, softmax_scale=inp.softmax_scale,
                                       compute_dtype=torch.float64)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_2 / ||ref||_2 over all of ref's elements (out sliced to ref's leading size), in fp64 on the CPU.
    NaN or inf in out gives NaN or inf."""
    o = out[:ref.shape[0]].detach().cpu()
    if tuple(o.shape) != tuple(ref.shape):
        raise ValueError(f"output {tuple(out.shape)} does not match the reference {tuple(ref.shape)}")
    return rel_norm_error(o, ref, torch.ones(ref.shape[:2], dtype=torch.bool))  # every (request, query token) row
