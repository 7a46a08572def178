"""The plugin's MLA attention implementation: decode on flashmla_backend's kernel, prefill in vLLM.

vLLM's MLA layer (MLACommonImpl) runs prefill tokens through its MLA prefill backend (forward_mha,
inherited unchanged) and hands the decode tokens, which come first in the batch, to forward_mqa in
the absorbed form: q = (ql_nope [T, N, 512], q_pe [T, N, 64]) against the latent cache
[num_kernel_blocks, 64, 576] (512 latent + 64 rope, K and V share it). The two parts of q live in
separate buffers (ql_nope is the output of vLLM's batched up-projection, q_pe a slice of the projected
query); the kernel reads both in place (flash_mla_with_kvcache's q_pe), so no concatenation is made.

FP8 KV cache (--kv-cache-dtype fp8 / fp8_e4m3; flashmla_backend.engine_support): vLLM's layer writes e4m3
values k / _k_scale through its own cache op and hands forward_mqa the cache viewed as float8_e4m3fn; the
kernel reads it in place with descale_k = the layer's _k_scale (a device tensor: a CUDA-graph replay reads
the current value). The query mode comes from FLASHMLA_BACKEND_FP8_MODE:
  fast (default)      supports_quant_query_input = True: vLLM quantizes q with its fused concat + quant
                      (scale _q_scale) and hands one e4m3 [T, N, 576] tensor; descale_q = _q_scale;
  accurate            supports_quant_query_input = False: vLLM hands the 16-bit (ql_nope, q_pe).

Decode context parallelism (--decode-context-parallel-size N; flashmla_backend.vllm.builder describes the
shard): vLLM's MLA layer gathers the decode queries of the N ranks by head (one [T, N x heads, 576]
tensor, 16-bit or e4m3 as above), forward_mqa attends the rank's shard of the cache, and the layer merges
the N partial outputs by their log-sum-exp (cp_lse_ag_out_rs, or dcp_a2a_lse_reduce with
--dcp-comm-backend a2a) before the V up-projection. The impl says so with can_return_lse_for_decode (vLLM
then sets need_to_return_lse_for_decode when N > 1, and 0.26's start-up check asserts it), supports_dcp
(0.33's backend selection reads it) and lse_base_on_e (the kernel's lse is a natural log). The lse is
returned as [T, N x heads] float32, one row per query token in q's order: the layout the merge reads
([tokens, heads]; the kernel's is [batch, heads, s_q]). A request with no token on this rank gives out 0 and
lse +inf; both releases' merges give such a shard zero weight (+inf and NaN count as -inf there).
"""
from __future__ import annotations

import logging

import torch

from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention.mla_attention import MLACommonImpl
from vllm.v1.attention.backend import AttentionLayer, AttentionType

import flashmla_backend
from flashmla_backend import engine_support

from .._env import DEBUG_VLLM_DECODE_KERNEL_ENV, debug_break_scale_factor, flag
from .builder import FlashMLAPluginMetadata

logger = logging.getLogger("vllm.flashmla_backend")

_FP8 = engine_support.FP8_DTYPE
_announced = False
_default_scale_logged = False
_ablation_logged = False  # the ablation hook's warning, once per process


def lse_for_merge(lse: torch.Tensor) -> torch.Tensor:
    """The kernel's lse [batch, heads, s_q] as vLLM's DCP merge reads it: [batch * s_q, heads], contiguous.

    Row t is query token t of forward_mqa's q (request t // s_q, token t % s_q), as the output's rows are.
    Values are unchanged: natural-log fp32, +inf for a query that saw no key on this rank.
    """
    batch, heads, s_q = lse.shape
    return lse.transpose(1, 2).reshape(batch * s_q, heads).contiguous()


def vllm_flashmla_ops(kv_fp8: bool):
    """vLLM's FlashMLA decode ops (the ablation hook DEBUG_VLLM_DECODE_KERNEL_ENV): the module with its
    flash_mla_with_kvcache and get_mla_metadata, or an error naming the hook and why it cannot run here."""
    if kv_fp8:
        raise NotImplementedError(
            f"flashmla_backend: {DEBUG_VLLM_DECODE_KERNEL_ENV} (the ablation hook) serves the 16-bit KV cache only; "
            "unset it or run with --kv-cache-dtype auto")
    try:
        from vllm.v1.attention.ops import flashmla as ops
        supported = ops.is_flashmla_dense_supported
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"flashmla_backend: {DEBUG_VLLM_DECODE_KERNEL_ENV} is set, but this vLLM has no "
                           f"FlashMLA dense decode ops to call ({e})") from e
    ok, reason = supported()
    if not ok:
        raise RuntimeError(f"flashmla_backend: {DEBUG_VLLM_DECODE_KERNEL_ENV} is set, but vLLM's FlashMLA cannot "
                           f"run here: {reason}")
    return ops


class FlashMLAPluginImpl(MLACommonImpl[FlashMLAPluginMetadata]):
    # Decode context parallelism (see the module docstring): the decode LSE is returned when vLLM asks for it
    # (need_to_return_lse_for_decode, set by vLLM when the DCP size is > 1), natural log.
    can_return_lse_for_decode: bool = True
    supports_dcp: bool = True
    lse_base_on_e: bool = True
    # MTP with --cp-kv-cache-interleave-size > 1: vLLM refuses it at start-up for impls that leave this False.
    supports_mtp_with_cp_non_trivial_interleave_size: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        **mla_args,
    ) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                         kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args)
        if any(x is not None for x in (alibi_slopes, sliding_window, logits_soft_cap)):
            raise NotImplementedError(
                "flashmla_backend: ALiBi slopes, sliding windows and logit soft-capping are not supported")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"flashmla_backend: only decoder self-attention is supported, got attention type {attn_type!r}")
        problem = engine_support.kv_cache_dtype_problem("vllm", kv_cache_dtype)
        if problem is not None:
            raise NotImplementedError(problem)
        self.kv_fp8 = engine_support.is_fp8("vllm", kv_cache_dtype)
        # The FP8 query mode (accurate: 16-bit q; fast: vLLM quantizes q). MLACommonImpl sets
        # supports_quant_query_input True; the layer reads it per forward to choose what it hands forward_mqa.
        self.fp8_mode = engine_support.fp8_mode("vllm") if self.kv_fp8 else None
        self.supports_quant_query_input = self.fp8_mode == "fast"
        # The kernel's output with an e4m3 q is bf16; vLLM's layer multiplies it by its W_UV in the model's dtype,
        # so an fp16 model gets it converted (forward_mqa). A 16-bit q's output is already in q's dtype.
        model_config = get_current_vllm_config().model_config
        self.fast_out_dtype = (model_config.dtype if model_config is not None and model_config.dtype == torch.float16
                               else torch.bfloat16)
        dims = engine_support.mla_dims_problem(self.kv_lora_rank, self.qk_rope_head_dim, "DeepSeek-V2/V3", head_size)
        if dims is not None:
            raise NotImplementedError(f"flashmla_backend: the decode kernel {dims}")
        if torch.cuda.is_available():
            ok, kernel_or_reason = flashmla_backend.is_supported()
            if not ok:
                raise RuntimeError(kernel_or_reason)
            where = f"kernel '{kernel_or_reason}' on {torch.cuda.get_device_name()}"
        else:
            where = "the PyTorch reference (no CUDA device)"

        self.decode_scale = self.scale * debug_break_scale_factor("decode attention", logger)

        # The ablation hook (DEBUG_VLLM_DECODE_KERNEL_ENV): decode on vLLM's FlashMLA kernel instead of ours.
        self.vllm_decode_ops = vllm_flashmla_ops(self.kv_fp8) if flag(DEBUG_VLLM_DECODE_KERNEL_ENV) else None
        global _ablation_logged
        if self.vllm_decode_ops is not None and not _ablation_logged:
            _ablation_logged = True
            logger.warning(
                "flashmla_backend: %s is set: decode attention runs on vLLM's FlashMLA kernel, not on "
                "flashmla_backend's. This is an ablation hook for the tests.", DEBUG_VLLM_DECODE_KERNEL_ENV)

        global _announced
        if not _announced:
            _announced = True
            cache = (f"FP8 KV cache ({kv_cache_dtype}, e4m3), mode {self.fp8_mode} ({engine_support.FP8_MODE_ENV})"
                     if self.kv_fp8 else f"KV cache {kv_cache_dtype}")
            if self.need_to_return_lse_for_decode:  # vLLM sets it for a DCP group of more than one rank
                cache += (f", decode context parallelism (rank {self.dcp_rank} of its DCP group: attends its share "
                          "of the cache with the group's gathered query heads, returns the lse for vLLM's merge)")
            logger.info(
                "flashmla_backend: MLA decode attention runs on flashmla_backend %s (%s), %d heads per rank, "
                "scale %.6g, %s; longer prefills stay with vLLM's MLA prefill backend.",
                flashmla_backend.__version__, where, num_heads, self.decode_scale, cache)

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: FlashMLAPluginMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode attention of the batch's first num_decode_tokens tokens.

        q: (ql_nope [T, N, 512], q_pe [T, N, 64]) or one tensor [T, N, 576] (e4m3 in the fast FP8 mode);
        T = num_decodes * s_q, the s_q tokens of each request consecutive. kv_c_and_k_pe_cache:
        [num_kernel_blocks, 64, 576] (float8_e4m3fn, or uint8 bytes of it, for an FP8 cache). Returns
        (o [T, N, 512], None): token s of a request with n cached tokens (these s_q included) sees the keys
        0 .. n - s_q + s (causal when s_q > 1). With decode context parallelism N counts the heads of the
        whole DCP group, n is this rank's share, and the second value is lse [T, N] (see lse_for_merge).
        """
        decode = attn_metadata.decode
        if decode is None:
            raise RuntimeError("flashmla_backend: forward_mqa called without decode metadata")
        q_pe = None
        if isinstance(q, tuple):
            q, q_pe = q
        num_tokens, num_heads, _ = q.shape
        batch, s_q = decode.seq_lens.shape[0], decode.query_len
        if num_tokens != batch * s_q:
            raise RuntimeError(
                f"flashmla_backend: forward_mqa got {num_tokens} decode tokens, but the metadata describes "
                f"{batch} requests of {s_q} tokens")
        if num_heads != decode.num_q_heads:
            raise RuntimeError(
                f"flashmla_backend: forward_mqa got {num_heads} query heads, but the tile scheduler was planned for "
                f"{decode.num_q_heads} (the rank's heads x the decode-context-parallel size: with DCP the queries "
                "of the group must be gathered before forward_mqa)")
        if self.vllm_decode_ops is not None:
            return self._forward_mqa_vllm_kernel(q, q_pe, kv_c_and_k_pe_cache, decode, batch, s_q), None
        descale_q = descale_k = None
        cache = kv_c_and_k_pe_cache
        if self.kv_fp8:
            if cache.dtype == torch.uint8:  # the bytes of the e4m3 cache (vLLM's layer normally views them)
                cache = cache.view(_FP8)
            descale_k = layer._k_scale.reshape(1)
            if q.dtype == _FP8:
                descale_q = layer._q_scale.reshape(1)
            self._log_default_scale(layer)
        out, lse = flashmla_backend.flash_mla_with_kvcache(
            q.reshape(batch, s_q, num_heads, q.shape[-1]),
            cache.unsqueeze(-2),  # [blocks, 64, 1 latent head, 576]
            decode.block_table,
            decode.seq_lens,
            self.kv_lora_rank,
            decode.tile_scheduler_metadata,
            decode.num_splits,
            softmax_scale=self.decode_scale,
            causal=s_q > 1,
            descale_q=descale_q,
            descale_k=descale_k,
            q_pe=None if q_pe is None else q_pe.reshape(batch, s_q, num_heads, q_pe.shape[-1]),
        )
        out = out.view(num_tokens, num_heads, self.kv_lora_rank)
        if q.dtype == _FP8 and out.dtype != self.fast_out_dtype:  # the fast mode's bf16 output in an fp16 model
            out = out.to(self.fast_out_dtype)
        return out, (lse_for_merge(lse) if self.need_to_return_lse_for_decode else None)

    def _forward_mqa_vllm_kernel(self, q, q_pe, cache, decode, batch: int, s_q: int) -> torch.Tensor:
        """The ablation hook's decode: the same query, cache, block table and lengths through vLLM's FlashMLA
        (its metadata made in the call, as its interface allows), output [T, N, 512]."""
        if self.need_to_return_lse_for_decode:
            raise NotImplementedError(f"flashmla_backend: {DEBUG_VLLM_DECODE_KERNEL_ENV} (the ablation hook) runs "
                                      "without decode context parallelism; unset it or run without DCP")
        num_tokens, num_heads, _ = q.shape
        q_full = q if q_pe is None else torch.cat((q, q_pe), dim=-1)
        sched, _ = self.vllm_decode_ops.get_mla_metadata()
        out, _ = self.vllm_decode_ops.flash_mla_with_kvcache(
            q_full.reshape(batch, s_q, num_heads, q_full.shape[-1]), cache.unsqueeze(-2), decode.block_table,
            decode.seq_lens, self.kv_lora_rank, sched, None, softmax_scale=self.decode_scale, causal=s_q > 1)
        return out.reshape(num_tokens, num_heads, self.kv_lora_rank)

    @staticmethod
    def _log_default_scale(layer) -> None:
        """Once per process: an FP8 cache whose k scale is still vLLM's default 1.0 (no calibrated scales).

        Reads the layer's host copy of the scale (no device sync, also during CUDA-graph capture); vLLM computes
        --calculate-kv-scales before the attention of the same forward, so a calibrated layer is never reported."""
        global _default_scale_logged
        if _default_scale_logged or getattr(layer, "calculate_kv_scales", False):
            return
        if float(getattr(layer, "_k_scale_float", 1.0)) == 1.0:
            _default_scale_logged = True
            logger.warning(engine_support.default_scale_message("vllm"))
