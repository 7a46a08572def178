"""Pure-PyTorch MLA decode: the CPU implementation of the public API and the oracle of every test.

Computes, per request i and query token s (0-based) of s_q:
    O = softmax(scale * Q K^T) V,  lse = logsumexp(scale * Q K^T)   (natural log, fp32)
over the keys the token sees: all cache_seqlens[i] keys, or with causal=True keys 0 .. n - s_q + s (dense
decode), or the cache tokens that indices[i, s] names (sparse decode: sparse_mla_decode_reference).
A query row that sees no key gets out = 0 and lse = +inf (FlashMLA's convention); a row that sees keys
but whose scores are NaN (NaN in q or in a key it reads) gets NaN in out and lse, never the empty-row
answer.
"""
from __future__ import annotations

import math

import torch

from . import fp8_ds_mla, kv_format, validate
from .geometry import HEAD_DIM_V


def mla_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int = HEAD_DIM_V,
    softmax_scale: float | None = None,
    causal: bool = False,
    compute_dtype: torch.dtype = torch.float32,
    *,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference decode with the shapes of ``flash_mla_with_kvcache``, its arguments checked like it.

    q [b, s_q, h_q, HEAD_DIM_K], k_cache [num_pages, PAGE_SIZE, h_kv, HEAD_DIM_K] in q's dtype (bf16, fp16,
    and here also fp32 or fp64), block_table [b, max_pages] int32, cache_seqlens [b] int32 (values >= 0,
    every page a request reads in [0, num_pages)). Returns out [b, s_q, h_q, head_dim_v] in q's dtype and
    lse [b, h_q, s_q] float32. Arithmetic in ``compute_dtype`` (fp32 by default). The argument checks are
    those of the public API (flashmla_backend.validate: the REFERENCE, VALUES and DESCALES tables); the
    value checks copy the index tensors (and the descales) to the host.
    FP8: a float8_e4m3fn k_cache with descale_k (and a float8_e4m3fn q with descale_q) is dequantized first
    (stored value x descale, in compute_dtype); the output is then in q's dtype, or bf16 for an FP8 q. A descale
    is one float32 value (any one-element tensor) or [b, h_kv] (request i's keys of KV head j, and its query
    heads of that KV head, are scaled by descale[i, j]; any strides).
    """
    validate.validate_reference_args(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal,
                                     descale_q, descale_k)
    validate.check_values(k_cache, block_table, cache_seqlens)
    validate.check_descales(descale_q, descale_k)
    return reference_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, compute_dtype,
                            descale_q=descale_q, descale_k=descale_k)


def descale_table(descale: torch.Tensor | None, b: int, h_kv: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A descale as a [b, h_kv] tensor in `dtype` (a one-element descale repeated; None stays None)."""
    if descale is None:
        return None
    if descale.numel() == 1:
        return descale.to(dtype).reshape(1, 1).expand(b, h_kv)
    return descale.to(dtype)


def reference_decode(q, k_cache, block_table, cache_seqlens, head_dim_v=HEAD_DIM_V, softmax_scale=None,
                     causal=False, compute_dtype=torch.float32, *, descale_q=None, descale_k=None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """mla_decode_reference without the argument checks (the public API calls it after its own)."""
    fp8 = kv_format.E4M3
    b, s_q, h_q, d = q.shape
    page_size, h_kv = k_cache.shape[1], k_cache.shape[2]
    ngroups = h_q // h_kv
    # The descales of an FP8 cache / q per (request, KV head), on q's device; None for 16-bit (or fp32 / fp64) inputs.
    k_scales = descale_table(descale_k, b, h_kv, compute_dtype).to(q.device) if k_cache.dtype == fp8 else None
    q_scales = descale_table(descale_q, b, h_kv, compute_dtype).to(q.device) if q.dtype == fp8 else None
    out_dtype = torch.bfloat16 if q.dtype == fp8 else q.dtype
    scale = float(softmax_scale) if softmax_scale is not None else d ** -0.5
    out = torch.zeros(b, s_q, h_q, head_dim_v, dtype=compute_dtype, device=q.device)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float32, device=q.device)
    lengths = cache_seqlens.tolist()
    tokens = torch.arange(s_q, device=q.device)
    for i, n in enumerate(lengths):
        if n <= 0:
            continue
        pages = block_table[i, : (n + page_size - 1) // page_size].long()
        kv = k_cache[pages].reshape(-1, h_kv, d)[:n].to(compute_dtype)  # [n, h_kv, d]
        if k_scales is not None:
            kv = kv * k_scales[i][None, :, None]  # true value = stored value x descale_k[i, kv head]
        qg = q[i].to(compute_dtype).reshape(s_q, h_kv, ngroups, d)
        if q_scales is not None:
            qg = qg * q_scales[i][None, :, None, None]
        scores = torch.einsum("sjgd,njd->jgsn", qg, kv) * scale  # [h_kv, ngroups, s_q, n]
        # Whether a row sees a key follows from the mask alone, not from the scores (NaN in q gives NaN
        # scores: that row's out and lse are NaN, not the empty row's 0 and +inf).
        visible = n - s_q + 1 + tokens if causal else torch.full_like(tokens, n)  # keys per query token
        if causal:
            hidden = torch.arange(n, device=q.device)[None, :] >= visible[:, None]  # [s_q, n]
            scores = scores.masked_fill(hidden, -math.inf)
        seen = (visible > 0).expand(h_kv, ngroups, s_q)
        row_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - row_lse.masked_fill(~seen, 0.0)[..., None])
        probs = probs.masked_fill(~seen[..., None], 0.0)
        o = torch.einsum("jgsn,njd->sjgd", probs, kv[..., :head_dim_v])  # [s_q, h_kv, ngroups, dv]
        out[i] = o.reshape(s_q, h_q, head_dim_v)
        lse[i] = row_lse.masked_fill(~seen, math.inf).reshape(h_q, s_q).float()
    return out.to(out_dtype), lse


def naive_mla_decode(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                     cache_seqlens: torch.Tensor, head_dim_v: int, max_seqlen: int,
                     softmax_scale: float | None = None, causal: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """A second, independent implementation (the demo checks the reference against it): the decode a
    PyTorch user writes. Gathers every request's pages (padded to max_seqlen), scores = Q K^T in the
    input dtype, masked fp32 softmax, out = P V; batched, no per-request loop.

    q [b, s_q, h_q, d], k_cache [num_pages, page_size, 1, d], block_table [b, >= ceil(max_seqlen /
    page_size)] with every entry a valid page id, cache_seqlens [b] (<= max_seqlen, a host int so
    the call needs no sync). Returns out [b, s_q, h_q, head_dim_v] (q's dtype) and lse [b, h_q, s_q]
    fp32; a row that sees no key gets out = 0 and lse = +inf. Assumes finite cache contents, also
    in the padding (0 * NaN would leak into P V)."""
    b, s_q, h_q, d = q.shape
    if k_cache.shape[2] != 1:
        raise ValueError(f"naive_mla_decode: one KV head expected, k_cache has {k_cache.shape[2]}")
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    if max_seqlen <= 0:
        out = torch.zeros(b, s_q, h_q, head_dim_v, dtype=q.dtype, device=q.device)
        return out, torch.full((b, h_q, s_q), math.inf, dtype=torch.float32, device=q.device)
    page_size = k_cache.shape[1]
    n_pages = -(-max_seqlen // page_size)
    kv = k_cache[block_table[:, :n_pages].long()]                      # [b, n_pages, page, 1, d]
    kv = kv.reshape(b, n_pages * page_size, d)[:, :max_seqlen]          # [b, L, d]
    scores = torch.matmul(q.reshape(b, s_q * h_q, d), kv.transpose(1, 2)).float() * scale
    scores = scores.view(b, s_q, h_q, max_seqlen)
    limit = cache_seqlens.to(torch.long).view(b, 1)                    # keys visible per token
    if causal:
        limit = limit - s_q + 1 + torch.arange(s_q, device=q.device).view(1, s_q)
    keys = torch.arange(max_seqlen, device=q.device)
    hidden = keys.view(1, 1, 1, -1) >= limit.expand(b, s_q).reshape(b, s_q, 1, 1)
    scores = scores.masked_fill(hidden, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)                               # [b, s_q, h_q]
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - torch.where(empty, 0.0, lse).unsqueeze(-1))  # softmax; 0 if empty
    out = torch.matmul(probs.to(q.dtype).view(b, s_q * h_q, max_seqlen), kv[..., :head_dim_v])
    lse = torch.where(empty, math.inf, lse)
    return out.view(b, s_q, h_q, head_dim_v), lse.transpose(1, 2).contiguous()


# ---- sparse decode (DeepSeek-V3.2's attention over the top-k tokens an indexer picks) ----------------------------

def sparse_mla_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float | None = None,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference sparse decode with the shapes of ``flash_mla_with_kvcache(..., indices=)``, checked like it.

    q [b, s_q, h_q, 576] (bf16 or fp16; here also fp32 or fp64); k_cache [num_pages, page_size, 1, width] of one
    format (flashmla_backend.kv_format): fp8_ds_mla, 656 bytes a token (uint8, int8 or float8_e4m3fn; q bf16, or
    fp32 / fp64 here), or 16-bit in q's dtype, 576 a token; indices [b, s_q, topk] int32, entry v naming cache token
    k_cache[v // page_size, v % page_size, 0]; topk_length [b] int32 in [0, topk] or None (all topk count);
    attn_sink [h_q] float32 or None. For query token s of request i, the keys are the tokens named by
    indices[i, s, j] for j < topk_length[i] whose value lies in [0, num_pages * page_size); other entries (-1, or
    past the cache) are skipped, and a token named twice counts twice. Then
        out = softmax(scale * q K^T) V,  lse = logsumexp(scale * q K^T)   (natural log; V = K's first 512 channels)
    and with attn_sink, out is multiplied by exp(lse) / (exp(lse) + exp(attn_sink[h])) (lse stays as it is).
    A row with no key gets out = 0 and lse = +inf; NaN in a row's scores gives NaN, as in dense decode.
    Returns out [b, s_q, h_q, 512] in q's dtype and lse [b, h_q, s_q] float32; arithmetic in compute_dtype, the
    fp8_ds_mla tokens dequantized exactly (flashmla_backend.fp8_ds_mla) first. The argument checks are those of the
    public API (flashmla_backend.validate: SPARSE_REFERENCE and SPARSE_VALUES; the values read on the host).
    """
    validate.validate_sparse_reference_args(q, k_cache, indices, softmax_scale, topk_length, attn_sink)
    validate.check_sparse_values(indices, topk_length, attn_sink)
    return reference_sparse_decode(q, k_cache, indices, softmax_scale, topk_length, attn_sink, compute_dtype)


def reference_sparse_decode(q, k_cache, indices, softmax_scale=None, topk_length=None, attn_sink=None,
                            compute_dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """sparse_mla_decode_reference without the argument checks (the public API calls it after its own)."""
    b, s_q, h_q, d = q.shape
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    topk = indices.shape[2]
    ds = kv_format.FP8_DS_MLA.holds(k_cache)
    scale = float(softmax_scale) if softmax_scale is not None else d ** -0.5
    out = torch.zeros(b, s_q, h_q, HEAD_DIM_V, dtype=compute_dtype, device=q.device)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float32, device=q.device)
    counted = topk_length.tolist() if topk_length is not None else [topk] * b
    sink = attn_sink.to(compute_dtype) if attn_sink is not None else None
    position = torch.arange(topk, device=q.device)
    for i in range(b):
        idx = indices[i].long()                                              # [s_q, topk]
        keep = (idx >= 0) & (idx < num_pages * page_size) & (position < counted[i])[None, :]
        if not bool(keep.any()):
            continue                                                         # every row: out 0, lse +inf
        # A skipped entry is gathered as token 0 and zeroed before any arithmetic: its bytes (NaN or anything)
        # never reach a score or the output.
        safe = torch.where(keep, idx, 0)
        rows = k_cache[safe // page_size, safe % page_size, 0]               # [s_q, topk, width]
        kv = fp8_ds_mla.dequantize(rows, compute_dtype) if ds else rows.to(compute_dtype)   # [s_q, topk, 576]
        kv = torch.where(keep[..., None], kv, 0.0)
        scores = torch.einsum("shd,std->sht", q[i].to(compute_dtype), kv) * scale            # [s_q, h_q, topk]
        scores = scores.masked_fill(~keep[:, None, :], -math.inf)
        # Whether a row sees a key follows from the indices alone, not from the scores (NaN in q gives NaN).
        seen = keep.any(dim=-1)[:, None].expand(s_q, h_q)                    # [s_q, h_q]
        row_lse = torch.logsumexp(scores, dim=-1)                            # [s_q, h_q]; -inf where unseen
        probs = torch.exp(scores - row_lse.masked_fill(~seen, 0.0)[..., None]).masked_fill(~seen[..., None], 0.0)
        o = torch.einsum("sht,std->shd", probs, kv[..., :HEAD_DIM_V])        # [s_q, h_q, 512]
        if sink is not None:  # exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink); rows with no key stay 0
            o = o * torch.where(seen, torch.sigmoid(row_lse - sink[None, :]), 0.0)[..., None]
        out[i] = o
        lse[i] = row_lse.masked_fill(~seen, math.inf).t().float()
    return out.to(q.dtype), lse
