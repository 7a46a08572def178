"""Shared test kit: input generators, a brute-force fp64 oracle, comparators and named tolerances.

The generators follow the habits that catch real kernel bugs: pages in shuffled
order, NaN in every cache slot a request does not use (past its length and in unused pages), a huge
page id in every unused block-table entry, random data (never zeros).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from flashmla_backend.geometry import HEAD_DIM_K, HEAD_DIM_V, PAGE_SIZE

PAGE, D_K, D_V = PAGE_SIZE, HEAD_DIM_K, HEAD_DIM_V   # short names for the geometry in tests
HUGE_PAGE_ID = 2**31 - 1 - 12345  # in unused block-table entries: any read of one is out of bounds

# Named tolerances (kernel vs reference; both see the same bf16/fp16 inputs).
OUT_REL_NORM = 5e-3       # ||out - ref|| / ||ref|| over all written rows (bf16 rounding of P and out: ~2e-3)
OUT_MAX_REL = 2e-2        # max |out - ref| / max |ref| per request
LSE_ATOL = 2e-5           # |lse - ref| <= LSE_ATOL + LSE_RTOL * |ref| (fp32 softmax statistics)
LSE_RTOL = 2e-5


@dataclasses.dataclass
class Case:
    lengths: list[int]
    s_q: int = 1
    h_q: int = 16
    h_kv: int = 1
    causal: bool = True
    dtype: torch.dtype = torch.bfloat16
    extra_pages: int = 3          # free pages never referenced (NaN-filled)
    extra_table_cols: int = 2     # unused block-table columns (huge ids)
    seed: int = 0

    @property
    def b(self) -> int:
        return len(self.lengths)

    def __str__(self) -> str:
        lens = self.lengths if len(self.lengths) <= 4 else f"{len(self.lengths)}x[{min(self.lengths)}..{max(self.lengths)}]"
        return (f"b{self.b}-sq{self.s_q}-hq{self.h_q}-hkv{self.h_kv}-{'causal' if self.causal else 'full'}-"
                f"{str(self.dtype).split('.')[-1]}-lens{lens}")


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor
    k_cache: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    scale: float


def make_inputs(case: Case, device: str | torch.device = "cpu") -> Inputs:
    g = torch.Generator(device="cpu").manual_seed(case.seed)
    pages_per_req = [-(-n // PAGE) for n in case.lengths]
    max_pages = max(max(pages_per_req, default=0), 1) + case.extra_table_cols
    total_pages = sum(pages_per_req) + case.extra_pages
    perm = torch.randperm(total_pages, generator=g)
    k_cache = torch.full((total_pages, PAGE, case.h_kv, D_K), float("nan"), dtype=torch.float32)
    block_table = torch.full((case.b, max_pages), HUGE_PAGE_ID, dtype=torch.int32)
    next_page = 0
    for i, n in enumerate(case.lengths):
        for j in range(pages_per_req[i]):
            page = int(perm[next_page])
            next_page += 1
            block_table[i, j] = page
            valid = min(PAGE, n - j * PAGE)
            k_cache[page, :valid] = torch.randn((valid, case.h_kv, D_K), generator=g)
    q = torch.randn((case.b, case.s_q, case.h_q, D_K), generator=g)
    scale = D_K ** -0.5 * (1.0 + 0.5 * float(torch.rand((), generator=g)))  # not the default on purpose
    return Inputs(
        q=q.to(case.dtype).to(device),
        k_cache=k_cache.to(case.dtype).to(device),
        block_table=block_table.to(device),
        cache_seqlens=torch.tensor(case.lengths, dtype=torch.int32).to(device),
        scale=scale,
    )


def brute_force_fp64(inp: Inputs, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention written out per request, KV head and query token in float64: an oracle independent of
    flashmla_backend.reference (explicit loops, each request's keys gathered per token through its block table, no
    einsum). Only the request's first n tokens are read, so NaN in unused slots and any id in unused block-table
    entries stay out of it. Runs on the inputs' device (float64 on a GPU: the oracle of a large GPU test in a
    fraction of a second instead of up to a minute of CPU time)."""
    dev = inp.q.device
    q = inp.q.double()
    cache = inp.k_cache.double()
    b, s_q, h_q, _ = q.shape
    h_kv = cache.shape[2]
    group = h_q // h_kv
    out = torch.zeros((b, s_q, h_q, D_V), dtype=torch.float64, device=dev)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float64, device=dev)
    block_table = inp.block_table.to(dev)
    for i, n in enumerate(inp.cache_seqlens.tolist()):
        if n == 0:
            continue
        t = torch.arange(n, device=dev)
        rows = cache[block_table[i, t // PAGE].long(), t % PAGE]  # [n, h_kv, D_K]: token t of request i
        for s in range(s_q):
            visible = n if not causal else max(0, min(n, n - s_q + s + 1))
            if visible == 0:
                continue
            for j in range(h_kv):
                keys = rows[:visible, j]  # [visible, D_K]
                heads = slice(j * group, (j + 1) * group)
                scores = (q[i, s, heads] @ keys.T) * inp.scale  # [group, visible]
                m = scores.max(dim=1, keepdim=True).values
                w = torch.exp(scores - m)
                total = w.sum(dim=1, keepdim=True)
                lse[i, heads, s] = (m + torch.log(total)).squeeze(1)
                out[i, s, heads] = (w / total) @ keys[:, :D_V]
    return out, lse


def compare(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor,
            lengths: list[int], s_q: int, causal: bool, *, out_rel_norm: float = OUT_REL_NORM,
            out_max_rel: float = OUT_MAX_REL, lse_atol: float = LSE_ATOL, lse_rtol: float = LSE_RTOL) -> dict:
    """Checks kernel output against the reference; returns the error figures. Raises AssertionError.
    The bounds default to the dense kernels' (the constants above)."""
    out, lse = out.detach().cpu().double(), lse.detach().cpu().double()
    ref_out, ref_lse = ref_out.detach().cpu().double(), ref_lse.detach().cpu().double()
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape, (out.shape, ref_out.shape, lse.shape, ref_lse.shape)
    assert not torch.isnan(out).any(), f"NaN in out at {torch.nonzero(torch.isnan(out))[:8].tolist()}"
    assert not torch.isnan(lse).any(), f"NaN in lse at {torch.nonzero(torch.isnan(lse))[:8].tolist()}"
    # rows that see no key: out exactly 0, lse exactly +inf
    no_key = torch.isinf(ref_lse) & (ref_lse > 0)  # [b, h_q, s_q]
    assert torch.equal(torch.isinf(lse) & (lse > 0), no_key), "lse = +inf exactly where a row sees no key"
    empty_rows = no_key.permute(0, 2, 1)  # [b, s_q, h_q]
    assert (out[empty_rows] == 0).all(), "out must be 0 for rows that see no key"
    seen = ~no_key
    lse_err = (lse[seen] - ref_lse[seen]).abs()
    lse_bound = lse_atol + lse_rtol * ref_lse[seen].abs()
    worst_lse = float((lse_err / ref_lse[seen].abs().clamp_min(1.0)).max()) if lse_err.numel() else 0.0
    assert (lse_err <= lse_bound).all(), (
        f"lse mismatch: max abs err {float(lse_err.max()):.3e} at {torch.nonzero(~(lse_err <= lse_bound))[:4].tolist()}")
    diff = (out - ref_out)
    rel_norm = float(diff.norm() / ref_out.norm().clamp_min(1e-30)) if ref_out.numel() else 0.0
    assert rel_norm <= out_rel_norm, f"out relative norm error {rel_norm:.3e} > {out_rel_norm}"
    worst_max_rel = 0.0
    for i in range(out.shape[0]):
        scale = float(ref_out[i].abs().max())
        if scale == 0:
            assert float(out[i].abs().max()) == 0.0
            continue
        r = float(diff[i].abs().max()) / scale
        worst_max_rel = max(worst_max_rel, r)
        assert r <= out_max_rel, f"request {i}: max |out - ref| / max |ref| = {r:.3e} > {out_max_rel}"
    return {"out_rel_norm": rel_norm, "out_max_rel": worst_max_rel, "lse_rel": worst_lse}


def pieces_from_metadata(meta: torch.Tensor, lengths: list[int]) -> list[list[tuple[int, int, int, int]]]:
    """Walks the metadata the way the decode kernels do: per part, the (request, start token, stop
    token, split index) pieces it computes."""
    parts = []
    for row in meta.tolist():
        begin_req, begin_token, end_req, end_token, begin_split = row[:5]
        assert row[5:] == [0, 0, 0], row
        pieces = []
        for req in range(begin_req, end_req + 1):
            n = max(lengths[req], 0)
            start = begin_token if req == begin_req else 0
            stop = end_token if req == end_req else n
            pieces.append((req, start, stop, begin_split if req == begin_req else 0))
        parts.append(pieces)
    return parts
