"""The correctness guard: every implementation's output is compared with the reference before it is timed.

Tolerances: a correct bf16 decode is ~3e-3 per row (median) and up to ~1e-2 on short, peaked rows (the naive
decode against the reference, measured); real bugs give errors of order 1.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

OUT_ROW_REL_TOL = 3e-2     # max over query rows of ||out - ref||_2 / ||ref||_2
# Two implementations compared with each other (the whole-batch agreement check): each may be OUT_ROW_REL_TOL from
# the reference, so they may differ by twice that per row (triangle inequality). Two FP8 kernels that round P to
# e4m3 independently (ours in the fast mode and FlashMLA-FP8) differ by up to 3.6e-2 on a row, each within 2.1e-2
# of the reference (H100, varlen batches).
AGREE_ROW_REL_TOL = 2 * OUT_ROW_REL_TOL
LSE_ATOL = 1e-2
LSE_RTOL_FP32 = 1e-3       # lse returned in fp32
LSE_RTOL_LOWP = 1.6e-2     # lse returned in bf16/fp16 (vLLM's Triton kernel)


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
                    ref_lse: Optional[torch.Tensor], rows: torch.Tensor, row_tol: float = OUT_ROW_REL_TOL) -> Check:
    """out/ref_out [n, s_q, h_q, dv], lse/ref_lse [n, h_q, s_q] or None, rows [n, s_q] bool; row_tol bounds each
    row's relative error (AGREE_ROW_REL_TOL when ref_out is another implementation's output).
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
    ok = row_err <= row_tol
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



def rel_norm_error(out: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor) -> Optional[float]:
    """||out - ref|| / ||ref|| (Frobenius, fp64) over the query rows that see a key; None if none does.
    Non-finite output gives NaN."""
    mask = rows.to(out.device).unsqueeze(-1).expand(out.shape[:3])
    if tuple(out.shape) != tuple(ref.shape) or not bool(mask.any()):
        return None
    o = out.double()[mask]
    r = ref.double().to(out.device)[mask]
    return float((o - r).norm() / r.norm().clamp_min(1e-300))


def dequantized_reference(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                          seqlens: Sequence[int], scale: float, causal: bool, descale_k: torch.Tensor,
                          descale_q: Optional[torch.Tensor] = None, chunk_bytes: int = 1 << 28,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 decode of every request on dequantized inputs: the e4m3 cache times descale_k, and q as given
    (16-bit) or, with descale_q, the e4m3 q times descale_q. Returns out [b, s_q, h_q, 512] fp64 and lse
    [b, h_q, s_q] fp32. Requests go in groups whose fp64 pages take about chunk_bytes, each group's pages
    gathered into a compact cache, so that the whole cache is never held in fp64 at once."""
    from flashmla_backend.reference import mla_decode_reference

    page = k_cache.shape[1]
    row_bytes = page * k_cache.shape[2] * k_cache.shape[3] * 8
    dk = descale_k.double().reshape(())
    b, s_q, h_q, _ = q.shape
    out = torch.zeros(b, s_q, h_q, 512, dtype=torch.float64, device=q.device)
    lse = torch.full((b, h_q, s_q), float("inf"), dtype=torch.float32, device=q.device)
    start = 0
    while start < b:
        end, pages = start, 0
        while end < b and (end == start or (pages + -(-seqlens[end] // page)) * row_bytes <= chunk_bytes):
            pages += -(-seqlens[end] // page)
            end += 1
        counts = [-(-n // page) for n in seqlens[start:end]]
        ids = torch.cat([block_table[i, :c].long() for i, c in zip(range(start, end), counts)] +
                        [torch.zeros(1, dtype=torch.long, device=block_table.device)])   # one spare page
        if k_cache.dtype == torch.float8_e4m3fn:    # gather the bytes (indexing of float8 is not everywhere)
            kv = k_cache.view(torch.uint8)[ids].view(k_cache.dtype).double() * dk
        else:
            kv = k_cache[ids].double() * dk
        table = torch.zeros(end - start, max(1, max(counts)), dtype=torch.int32, device=block_table.device)
        offset = 0
        for j, c in enumerate(counts):
            table[j, :c] = torch.arange(offset, offset + c, dtype=torch.int32, device=block_table.device)
            offset += c
        qd = q[start:end].double()
        if descale_q is not None:
            qd = qd * descale_q.double().reshape(())
        lens = torch.tensor(list(seqlens[start:end]), dtype=torch.int32, device=q.device)
        o, l = mla_decode_reference(qd, kv, table, lens, 512, softmax_scale=scale, causal=causal,
                                    compute_dtype=torch.float64)
        out[start:end] = o
        lse[start:end] = l
        start = end
    return out, lse
