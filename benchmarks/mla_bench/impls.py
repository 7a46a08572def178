"""The implementations the benchmark times, one adapter each.

  ours      flashmla_backend.get_mla_metadata (once per shape) + flash_mla_with_kvcache
  flashmla  vLLM's bundled FlashMLA: vllm.third_party.flashmla.flash_mla_interface (vllm._flashmla_C)
  triton    vLLM's Triton MLA decode: vllm.v1.attention.ops.triton_decode_attention.decode_attention_fwd,
            best of several num_kv_splits
  fa3       vLLM's FlashAttention-3 MLA decode: vllm.vllm_flash_attn.flash_attn_varlen_func with
            q = rope part, q_v = latent part, k = rope columns, v = latent columns of the cache
  naive     batched PyTorch: gather pages, matmul, fp32 softmax, matmul (flashmla_backend.reference)

An adapter turns a ShapeContext into Variants (zero-argument calls, one per rotated input copy) or raises
ImplUnavailable. The vLLM ones are optional: a missing import or an unsupported call is reported, not fatal.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from flashmla_backend.reference import naive_mla_decode

from .shapes import D_QK, D_V, PAGE_SIZE, DecodeInputs, Shape

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


def standard(result: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
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
    return [Variant("", [make(i) for i in ctx.inputs], standard, "metadata computed once per shape")]


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
    return [Variant("", [make(i) for i in ctx.inputs], standard, "sched meta filled by the first call, reused")]


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
    return [Variant("", [make(i) for i in ctx.inputs], standard, "padded to the longest request")]


ADAPTERS: dict[str, Callable[[ShapeContext], list[Variant]]] = {
    "ours": prepare_ours,
    "flashmla": prepare_flashmla,
    "triton": prepare_triton,
    "fa3": prepare_fa3,
    "naive": prepare_naive,
}

