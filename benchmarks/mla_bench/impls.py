"""The implementations the benchmark times, one adapter each.

  ours      flashmla_backend.get_mla_metadata (once per shape) + flash_mla_with_kvcache
  flashmla  vLLM's bundled FlashMLA: vllm.third_party.flashmla.flash_mla_interface (vllm._flashmla_C)
  triton    vLLM's Triton MLA decode: vllm.v1.attention.ops.triton_decode_attention.decode_attention_fwd,
            best of several num_kv_splits
  fa3       vLLM's FlashAttention-3 MLA decode: vllm.vllm_flash_attn.flash_attn_varlen_func with
            q = rope part, q_v = latent part, k = rope columns, v = latent columns of the cache
  naive     batched PyTorch: gather pages, matmul, fp32 softmax, matmul (flashmla_backend.reference)
  flashinfer  FlashInfer's Hopper MLA decode (BatchMLAPagedAttentionWrapper, backend fa3), bf16 only, when
            FlashInfer is importable or its prebuilt bundle is present (flashinfer_peer.py)

FP8 (e4m3) KV cache, all three on the same e4m3 cache bytes and descale_k (shapes.make_fp8_inputs):
  ours-fp8      flash_mla_with_kvcache, accurate mode: the 16-bit q against the e4m3 cache (descale_k)
  ours-fp8q     flash_mla_with_kvcache, fast mode: the e4m3 q (descale_q) against the e4m3 cache
  flashmla-fp8  vLLM's flash_mla_with_kvcache_fp8 (e4m3 q and cache), metadata from get_mla_metadata_dense_fp8
  flashinfer-fp8  FlashInfer's Hopper MLA on the e4m3 cache with the 16-bit q (per-tensor scale, like ours-fp8)

An adapter turns a ShapeContext into Variants (zero-argument calls, one per rotated input copy) or raises
ImplUnavailable. The vLLM ones are optional: a missing import or an unsupported call is reported, not fatal.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from flashmla_backend.reference import naive_mla_decode

from .shapes import D_QK, D_V, PAGE_SIZE, DecodeInputs, Fp8Inputs, Shape

IMPLS = ("ours", "flashmla", "triton", "fa3", "flashinfer", "naive")   # 16-bit cache; also the run order
FP8_IMPLS = ("ours-fp8", "ours-fp8q", "flashmla-fp8", "flashinfer-fp8")  # e4m3 cache; run after the 16-bit ones
ALL_IMPLS = IMPLS + FP8_IMPLS
FP8_Q_IMPLS = ("ours-fp8q", "flashmla-fp8")                 # these read the e4m3 q
IMPL_LABELS = {
    "ours": "ours",
    "flashmla": "vLLM FlashMLA",
    "triton": "vLLM Triton MLA",
    "fa3": "vLLM FA3 MLA",
    "flashinfer": "FlashInfer MLA",
    "naive": "naive PyTorch",
    "ours-fp8": "ours FP8 cache (16-bit q)",
    "ours-fp8q": "ours FP8 cache + e4m3 q",
    "flashmla-fp8": "vLLM FlashMLA-FP8",
    "flashinfer-fp8": "FlashInfer MLA FP8 cache (16-bit q)",
}
METADATA_IMPL = "get_mla_metadata"   # rows timing flashmla_backend.get_mla_metadata alone
BASELINE_IMPL = "flashmla"           # speed-ups are relative to this one (FP8 rows: FP8_BASELINE_IMPL)
FP8_BASELINE_IMPL = "flashmla-fp8"
# Each implementation's full-batch output is compared with its peer's (same inputs), if the peer passed.
PEERS = {"flashmla": "ours", "triton": "ours", "fa3": "ours", "flashinfer": "ours", "naive": "ours",
         "flashmla-fp8": "ours-fp8q", "flashinfer-fp8": "ours-fp8"}
# The vLLM modules that have held the FlashMLA-FP8 op, in the order they are tried.
VLLM_FP8_MODULES = ("vllm.attention.ops.flashmla", "vllm.v1.attention.ops.flashmla",
                    "vllm.third_party.flashmla", "vllm.third_party.flashmla.flash_mla_interface")


def kv_kind(impl: str) -> str:
    """'fp8' for the implementations that read the e4m3 cache, '16bit' for the others."""
    return "fp8" if impl in FP8_IMPLS else "16bit"


def baseline_of(impl: str) -> str:
    return FP8_BASELINE_IMPL if impl in FP8_IMPLS else BASELINE_IMPL


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
    fp8: list[Fp8Inputs] = dataclasses.field(default_factory=list)   # e4m3 form of each copy, if FP8 rows run


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


def _need_fp8(ctx: ShapeContext) -> None:
    if len(ctx.fp8) != len(ctx.inputs):
        raise ImplUnavailable("no e4m3 inputs for this shape (FP8 rows run with --kv-dtype fp8)")


def _ours_fp8(ctx: ShapeContext, fast: bool) -> list[Variant]:
    _need_fp8(ctx)
    try:
        from flashmla_backend import flash_mla_with_kvcache, get_mla_metadata
    except ImportError as e:
        raise ImplUnavailable(f"flashmla_backend import failed: {e}") from e
    shape = ctx.shape
    sched, splits = get_mla_metadata(ctx.cache_seqlens, shape.s_q * shape.h_q, 1, is_fp8_kvcache=True)

    def make(inp: DecodeInputs, f8: Fp8Inputs) -> Callable[[], Any]:
        q, descale_q = (f8.q, f8.descale_q) if fast else (inp.q, None)
        return lambda: flash_mla_with_kvcache(q, f8.k_cache, inp.block_table, ctx.cache_seqlens, D_V, sched, splits,
                                              softmax_scale=ctx.scale, causal=ctx.causal, is_fp8_kvcache=True,
                                              descale_q=descale_q, descale_k=f8.descale_k)
    note = ("fast mode: e4m3 q + descale_q, bf16 out" if fast else "accurate mode: 16-bit q") + \
        "; metadata computed once per shape"
    return [Variant("", [make(i, f) for i, f in zip(ctx.inputs, ctx.fp8)], standard, note)]


def prepare_ours_fp8(ctx: ShapeContext) -> list[Variant]:
    return _ours_fp8(ctx, fast=False)


def prepare_ours_fp8q(ctx: ShapeContext) -> list[Variant]:
    return _ours_fp8(ctx, fast=True)


def find_vllm_fp8_module() -> Any:
    """The first of VLLM_FP8_MODULES that imports and has flash_mla_with_kvcache_fp8."""
    import importlib
    try:
        importlib.import_module("vllm")
    except Exception as e:
        raise ImplUnavailable(f"vllm import failed: {type(e).__name__}: {e}") from e
    why = []
    for name in VLLM_FP8_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception as e:   # ImportError, or an extension failing to load
            why.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if hasattr(mod, "flash_mla_with_kvcache_fp8"):
            return mod
        why.append(f"{name}: no flash_mla_with_kvcache_fp8")
    raise ImplUnavailable("vLLM's FlashMLA-FP8 op not found (" + "; ".join(why) + ")")


def prepare_flashmla_fp8(ctx: ShapeContext) -> list[Variant]:
    """vLLM's FLASHMLA backend with an fp8 cache (vLLM 0.26): metadata tensors from
    get_mla_metadata_dense_fp8(seq_lens, s_q * h_q, 1), then flash_mla_with_kvcache_fp8 with e4m3 q and cache,
    descale_q and descale_k. Older layouts without the dense_fp8 metadata call get_mla_metadata(...,
    is_fp8_kvcache=True) when that returns tensors."""
    _need_fp8(ctx)
    mod = find_vllm_fp8_module()
    supported = getattr(mod, "is_flashmla_dense_supported", None)
    if supported is not None:
        ok, why = supported()
        if not ok:
            raise ImplUnavailable(f"FlashMLA dense not supported here: {why}")
    shape = ctx.shape
    n = shape.s_q * shape.h_q
    if hasattr(mod, "get_mla_metadata_dense_fp8"):
        sched, splits = mod.get_mla_metadata_dense_fp8(ctx.cache_seqlens, n, 1)
        how = "get_mla_metadata_dense_fp8"
    elif hasattr(mod, "get_mla_metadata"):
        sched, splits = mod.get_mla_metadata(ctx.cache_seqlens, n, 1, is_fp8_kvcache=True)
        how = "get_mla_metadata(is_fp8_kvcache=True)"
    else:
        raise ImplUnavailable(f"{mod.__name__} has no FP8 metadata function")
    if not (isinstance(sched, torch.Tensor) and isinstance(splits, torch.Tensor)):
        raise ImplUnavailable(f"{mod.__name__}.{how} did not return metadata tensors ({type(sched).__name__})")
    fn = mod.flash_mla_with_kvcache_fp8
    b, s_q, h_q = shape.b, shape.s_q, shape.h_q

    def make(inp: DecodeInputs, f8: Fp8Inputs) -> Callable[[], Any]:
        return lambda: fn(f8.q, f8.k_cache, inp.block_table, ctx.cache_seqlens, D_V, sched, splits,
                          softmax_scale=ctx.scale, causal=ctx.causal, descale_q=f8.descale_q, descale_k=f8.descale_k)

    def normalize(res: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        out, lse = res
        if lse is not None and tuple(lse.shape) != (b, h_q, s_q):
            lse = None          # another layout: compare out only
        return out.view(b, s_q, h_q, D_V), lse
    return [Variant("", [make(i, f) for i, f in zip(ctx.inputs, ctx.fp8)], normalize,
                    f"{mod.__name__}, metadata from {how} once per shape")]


def _flashinfer(ctx: ShapeContext, fp8: bool) -> list[Variant]:
    """One planned wrapper per input copy (a plan holds its copy's pages), q packed [b * s_q, h_q, 576], the cache
    as [pages, 64, 576] (one KV head), natural-log lse; the FP8 variant passes descale_k as FlashInfer's
    per-tensor ckv / kpe scale (a Python float, bf16-representable: shapes.make_fp8_inputs)."""
    if fp8:
        _need_fp8(ctx)
    if ctx.dtype != torch.bfloat16:
        raise ImplUnavailable(f"FlashInfer's prebuilt Hopper MLA modules take a bf16 q, not {ctx.dtype}")
    if ctx.device.type != "cuda":
        raise ImplUnavailable(f"FlashInfer's MLA decode runs on a CUDA device, not {ctx.device}")
    from . import flashinfer_peer
    try:
        mla = flashinfer_peer.load()
    except flashinfer_peer.FlashInferMissing as e:
        raise ImplUnavailable(str(e)) from e
    shape, dev = ctx.shape, ctx.device
    rows = shape.b * shape.s_q
    kv_dtype = torch.float8_e4m3fn if fp8 else ctx.dtype

    def make(c: int) -> Callable[[], Any]:
        inp = ctx.inputs[c]
        # Each copy its own output buffers: a result kept for the accuracy figures must not be overwritten by
        # the timed calls of the other copies.
        out = torch.empty(rows, shape.h_q, D_V, dtype=ctx.dtype, device=dev)
        lse = torch.empty(rows, shape.h_q, dtype=torch.float32, device=dev)
        w = flashinfer_peer.plan(mla, dev, inp.block_table, ctx.cache_seqlens, shape.s_q, shape.h_q, D_V, D_QK - D_V,
                                 PAGE_SIZE, ctx.causal, ctx.scale, ctx.dtype, kv_dtype)
        q = inp.q.reshape(rows, shape.h_q, D_QK)
        cache = (ctx.fp8[c].k_cache if fp8 else inp.k_cache).squeeze(2)
        kw = flashinfer_peer.run_kwargs(float(ctx.fp8[c].descale_k) if fp8 else None)
        return lambda: w.run(query=q, kv_cache=cache, out=out, lse=lse, return_lse=True,
                             return_lse_base_on_e=True, **kw)

    def normalize(res: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        o, l = res                                        # [b * s_q, h, 512], [b * s_q, h]
        return (o.view(shape.b, shape.s_q, shape.h_q, D_V),
                l.view(shape.b, shape.s_q, shape.h_q).permute(0, 2, 1))
    note = ("e4m3 cache, 16-bit q, per-tensor scale; " if fp8 else "") + "one plan per input copy, made once"
    return [Variant("", [make(c) for c in range(len(ctx.inputs))], normalize, note)]


def prepare_flashinfer(ctx: ShapeContext) -> list[Variant]:
    return _flashinfer(ctx, fp8=False)


def prepare_flashinfer_fp8(ctx: ShapeContext) -> list[Variant]:
    return _flashinfer(ctx, fp8=True)


ADAPTERS: dict[str, Callable[[ShapeContext], list[Variant]]] = {
    "ours": prepare_ours,
    "flashmla": prepare_flashmla,
    "triton": prepare_triton,
    "fa3": prepare_fa3,
    "flashinfer": prepare_flashinfer,
    "naive": prepare_naive,
    "ours-fp8": prepare_ours_fp8,
    "ours-fp8q": prepare_ours_fp8q,
    "flashmla-fp8": prepare_flashmla_fp8,
    "flashinfer-fp8": prepare_flashinfer_fp8,
}

