"""Sparse-decode test kit: inputs that catch out-of-range reads, and an fp64 oracle that shares no code with the package.

The generator (make_sparse_inputs) follows the habits of kit.py: random data with spread-out group scales, pages
in no order, NaN in every cache slot that no counted index names (entries past topk_length name NaN slots too), and
indices with every kind of skipped entry (-1, past the cache, other negatives, INT32_MAX) and duplicates.

The oracle (naive_sparse_fp64) decodes fp8_ds_mla tokens with its own e4m3 table (built from the bit fields) and
reads the scales and the rope part with struct, in little-endian order, from the bytes at the offsets FlashMLA
documents (512 e4m3, 4 float32, 64 bf16): it does not use flashmla_backend.fp8_ds_mla, torch's float8 conversion or
torch dtype views, so a layout mistake in the package shows up as a mismatch.
"""
from __future__ import annotations

import dataclasses
import math
import struct

import torch

from flashmla_backend import fp8_ds_mla
from kit import D_K, D_V

INT32_MAX = 2**31 - 1
INT32_MIN = -2**31
DS_BYTES = 656
GROUP = 128


def e4m3_value(byte: int) -> float:
    """float8_e4m3fn from its bits: 1 sign, 4 exponent (bias 7), 3 mantissa; S.1111.111 is NaN, no infinities."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0 ** -6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


E4M3_TABLE = torch.tensor([e4m3_value(v) for v in range(256)], dtype=torch.float64)


def bf16_bits_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def decode_token_fp64(raw: bytes) -> torch.Tensor:
    """One 656-byte fp8_ds_mla token -> its 576 values in float64 (latent e4m3 x group scale, then rope)."""
    assert len(raw) == DS_BYTES
    latent = E4M3_TABLE[torch.tensor(list(raw[:512]), dtype=torch.long)]
    scales = struct.unpack("<4f", raw[512:528])
    rope = [bf16_bits_value(bits) for bits in struct.unpack("<64H", raw[528:656])]
    scaled = torch.cat([latent[g * GROUP:(g + 1) * GROUP] * scales[g] for g in range(4)])
    return torch.cat([scaled, torch.tensor(rope, dtype=torch.float64)])


@dataclasses.dataclass
class SparseCase:
    b: int = 2
    s_q: int = 1
    h_q: int = 16
    topk: int = 64
    page_size: int = 64
    num_pages: int = 6
    cache: str = "fp8_ds_mla"        # or "bf16", "fp16"
    ds_dtype: torch.dtype = torch.uint8   # the dtype an fp8_ds_mla cache is handed over as
    topk_length: list | None = None  # per request, or None (all topk count)
    sink: bool = False
    skipped: float = 0.25            # share of entries that are skipped (-1, past the cache, ...)
    seed: int = 0

    def __str__(self) -> str:
        dtype = f"-{str(self.ds_dtype).split('.')[-1]}" if self.cache == "fp8_ds_mla" else ""
        return (f"b{self.b}-sq{self.s_q}-hq{self.h_q}-topk{self.topk}-page{self.page_size}x{self.num_pages}-"
                f"{self.cache}{dtype}-len{self.topk_length}{'-sink' if self.sink else ''}")


@dataclasses.dataclass
class SparseInputs:
    q: torch.Tensor              # [b, s_q, h_q, 576]
    k_cache: torch.Tensor        # [num_pages, page_size, 1, 656 or 576]
    indices: torch.Tensor        # [b, s_q, topk] int32
    topk_length: torch.Tensor | None
    attn_sink: torch.Tensor | None
    scale: float
    counted: set                 # the cache tokens that counted entries name (all others hold NaN)

    @property
    def ds(self) -> bool:
        return self.k_cache.shape[-1] == DS_BYTES

    def replace(self, **changes) -> SparseInputs:
        return dataclasses.replace(self, **changes)


def _tokens(n: int, g: torch.Generator) -> torch.Tensor:
    """n random tokens [n, 576] float32 whose four latent groups have magnitudes 2^-3 .. 2^3 apart."""
    x = torch.randn((n, D_K), generator=g)
    spread = torch.exp2(torch.randint(-3, 4, (n, 4), generator=g).float())
    x[:, :D_V] *= spread.repeat_interleave(GROUP, dim=1)
    return x


def _skipped_value(kind: int, total: int) -> int:
    return [-1, total, total + 12345, INT32_MAX, -7, INT32_MIN][kind % 6]


def make_sparse_inputs(case: SparseCase) -> SparseInputs:
    g = torch.Generator().manual_seed(case.seed)
    total = case.num_pages * case.page_size
    b, s_q, topk = case.b, case.s_q, case.topk
    counted_len = case.topk_length if case.topk_length is not None else [topk] * b
    indices = torch.empty((b, s_q, topk), dtype=torch.int64)
    for i in range(b):
        for s in range(s_q):
            row = torch.randperm(total, generator=g)[:topk] if topk <= total else torch.randint(0, total, (topk,),
                                                                                                  generator=g)
            skip = torch.rand(topk, generator=g) < case.skipped
            kinds = torch.randint(0, 6, (topk,), generator=g)
            for j in torch.nonzero(skip).flatten().tolist():
                row[j] = _skipped_value(int(kinds[j]), total)
            if topk >= 4:
                row[topk // 2] = row[0] if 0 <= int(row[0]) < total else row[topk // 2]   # a duplicate
            indices[i, s] = row
    counted = {int(v) for i in range(b) for s in range(s_q) for v in indices[i, s, :counted_len[i]].tolist()
               if 0 <= v < total}
    tokens = _tokens(total, g)
    if case.cache == "fp8_ds_mla":
        cache = torch.full((total, DS_BYTES), 0xFF, dtype=torch.uint8)     # 0xFF: NaN latent, scales and rope
        named = sorted(counted)
        if named:
            cache[named] = fp8_ds_mla.quantize(tokens[named])
        k_cache = cache.view(case.num_pages, case.page_size, 1, DS_BYTES).view(case.ds_dtype)
    else:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[case.cache]
        cache = torch.full((total, D_K), float("nan"), dtype=dtype)
        named = sorted(counted)
        if named:
            cache[named] = tokens[named].to(dtype)
        k_cache = cache.view(case.num_pages, case.page_size, 1, D_K)
    q_dtype = torch.bfloat16 if case.cache == "fp8_ds_mla" else k_cache.dtype
    q = (torch.randn((b, s_q, case.h_q, D_K), generator=g) * 0.5).to(q_dtype)
    sink = None
    if case.sink:   # finite values around the typical lse, and both infinities
        sink = torch.randn(case.h_q, generator=g) * 2 + 3
        sink[0] = -math.inf
        if case.h_q > 2:
            sink[1] = math.inf
    topk_length = torch.tensor(case.topk_length, dtype=torch.int32) if case.topk_length is not None else None
    scale = D_K ** -0.5 * (1.0 + 0.5 * float(torch.rand((), generator=g)))
    return SparseInputs(q=q, k_cache=k_cache, indices=indices.to(torch.int32), topk_length=topk_length,
                        attn_sink=sink, scale=scale, counted=counted)


def unpoisoned(inp: SparseInputs, fill: float = 0.0) -> SparseInputs:
    """The same inputs with every slot that no counted entry names holding `fill` (finite) instead of NaN."""
    total = inp.k_cache.shape[0] * inp.k_cache.shape[1]
    other = sorted(set(range(total)) - inp.counted)
    if inp.ds:
        flat = inp.k_cache.view(torch.uint8).reshape(total, DS_BYTES).clone()
        if other:
            flat[other] = fp8_ds_mla.quantize(torch.full((len(other), D_K), fill))
        cache = flat.view(inp.k_cache.shape).view(inp.k_cache.dtype)
    else:
        flat = inp.k_cache.reshape(total, D_K).clone()
        if other:
            flat[other] = fill
        cache = flat.view(inp.k_cache.shape)
    return inp.replace(k_cache=cache)


def cache_token_fp64(inp: SparseInputs, v: int) -> torch.Tensor:
    page_size = inp.k_cache.shape[1]
    row = inp.k_cache[v // page_size, v % page_size, 0]
    if inp.ds:
        return decode_token_fp64(bytes(row.view(torch.uint8).tolist()))
    return row.double()


def sink_factor(lse: float, sink: float) -> float:
    """exp(lse) / (exp(lse) + exp(sink)), written with the larger exponent taken out (no sigmoid)."""
    if sink == math.inf:
        return 0.0
    if sink == -math.inf:
        return 1.0
    top = max(lse, sink)
    return math.exp(lse - top) / (math.exp(lse - top) + math.exp(sink - top))


def naive_sparse_fp64(inp: SparseInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention written out per request and query token in float64: the counted entries that lie in the
    cache, in order (duplicates included), as the keys; softmax with its maximum taken out; the sink factor per head.
    Returns out [b, s_q, h_q, 512] and lse [b, h_q, s_q] (float64); out 0 and lse +inf for a row without keys."""
    b, s_q, h_q, _ = inp.q.shape
    total = inp.k_cache.shape[0] * inp.k_cache.shape[1]
    topk = inp.indices.shape[2]
    lengths = inp.topk_length.tolist() if inp.topk_length is not None else [topk] * b
    out = torch.zeros((b, s_q, h_q, D_V), dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float64)
    decoded: dict[int, torch.Tensor] = {}
    for i in range(b):
        for s in range(s_q):
            entries = [v for v in inp.indices[i, s, :lengths[i]].tolist() if 0 <= v < total]
            if not entries:
                continue
            keys = torch.stack([decoded.setdefault(v, cache_token_fp64(inp, v)) for v in entries])   # [n, 576]
            q = inp.q[i, s].double()                                                               # [h_q, 576]
            scores = (q @ keys.t()) * inp.scale                                                    # [h_q, n]
            top = scores.max(dim=1, keepdim=True).values
            weights = torch.exp(scores - top)
            total_weight = weights.sum(dim=1)
            row_lse = top.squeeze(1) + torch.log(total_weight)
            row_out = (weights / total_weight[:, None]) @ keys[:, :D_V]
            if inp.attn_sink is not None:
                factors = [sink_factor(float(row_lse[h]), float(inp.attn_sink[h])) for h in range(h_q)]
                row_out = row_out * torch.tensor(factors, dtype=torch.float64)[:, None]
            out[i, s] = row_out
            lse[i, :, s] = row_lse
    return out, lse
