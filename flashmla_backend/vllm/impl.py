"""The plugin's MLA attention implementation: decode on flashmla_backend's kernel, prefill in vLLM.

vLLM's MLA layer (MLACommonImpl) runs prefill tokens through its MLA prefill backend (forward_mha,
inherited unchanged) and hands the decode tokens, which come first in the batch, to forward_mqa in
the absorbed form: q = (ql_nope [T, N, 512], q_pe [T, N, 64]) against the latent cache
[num_kernel_blocks, 64, 576] (512 latent + 64 rope, K and V share it).
"""
from __future__ import annotations

import logging

import torch

from vllm.model_executor.layers.attention.mla_attention import MLACommonImpl
from vllm.v1.attention.backend import AttentionLayer, AttentionType

import flashmla_backend
from flashmla_backend.geometry import HEAD_DIM_K, HEAD_DIM_V, ROPE_DIM

from .._env import DEBUG_BREAK_SCALE_ENV, debug_break_scale_enabled
from .builder import FlashMLAPluginMetadata

logger = logging.getLogger("vllm.flashmla_backend")

SUPPORTED_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")
_announced = False


class FlashMLAPluginImpl(MLACommonImpl[FlashMLAPluginMetadata]):
    # The decode LSE is only needed for decode context parallelism, which this plugin refuses.
    can_return_lse_for_decode: bool = False
    supports_dcp: bool = False

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
        if kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            raise NotImplementedError(
                f"flashmla_backend: KV cache dtype {kv_cache_dtype!r} is not supported (the plugin does not serve FP8 KV caches yet; the API does); "
                f"use --kv-cache-dtype {', '.join(SUPPORTED_KV_CACHE_DTYPES)}")
        if self.kv_lora_rank != HEAD_DIM_V or self.qk_rope_head_dim != ROPE_DIM or head_size != HEAD_DIM_K:
            raise NotImplementedError(
                f"flashmla_backend: the decode kernel needs kv_lora_rank {HEAD_DIM_V} and qk_rope_head_dim {ROPE_DIM} "
                f"(DeepSeek-V2/V3 MLA), got kv_lora_rank {self.kv_lora_rank}, qk_rope_head_dim "
                f"{self.qk_rope_head_dim}, head size {head_size}")
        if torch.cuda.is_available():
            ok, kernel_or_reason = flashmla_backend.is_supported()
            if not ok:
                raise RuntimeError(kernel_or_reason)
            where = f"kernel '{kernel_or_reason}' on {torch.cuda.get_device_name()}"
        else:
            where = "the PyTorch reference (no CUDA device)"

        self.decode_scale = self.scale
        if debug_break_scale_enabled():
            self.decode_scale = self.scale * 1.5
            logger.warning(
                "flashmla_backend: %s is set: decode attention uses a WRONG softmax scale (x1.5). "
                "This is a test hook; outputs are deliberately incorrect.", DEBUG_BREAK_SCALE_ENV)

        global _announced
        if not _announced:
            _announced = True
            logger.info(
                "flashmla_backend: MLA decode attention runs on flashmla_backend %s (%s), %d heads per rank, "
                "scale %.6g; prefill stays with vLLM's MLA prefill backend.",
                flashmla_backend.__version__, where, num_heads, self.decode_scale)

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: FlashMLAPluginMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode attention of the batch's first num_decode_tokens tokens.

        q: (ql_nope [T, N, 512], q_pe [T, N, 64]) or one tensor [T, N, 576]; T = num_decodes * s_q, the
        s_q tokens of each request consecutive. kv_c_and_k_pe_cache: [num_kernel_blocks, 64, 576].
        Returns (o [T, N, 512], None): token s of a request with n cached tokens (these s_q included)
        sees the keys 0 .. n - s_q + s (causal when s_q > 1).
        """
        decode = attn_metadata.decode
        if decode is None:
            raise RuntimeError("flashmla_backend: forward_mqa called without decode metadata")
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        num_tokens, num_heads, head_dim = q.shape
        batch, s_q = decode.seq_lens.shape[0], decode.query_len
        if num_tokens != batch * s_q:
            raise RuntimeError(
                f"flashmla_backend: forward_mqa got {num_tokens} decode tokens, but the metadata describes "
                f"{batch} requests of {s_q} tokens")
        out, _lse = flashmla_backend.flash_mla_with_kvcache(
            q.reshape(batch, s_q, num_heads, head_dim),
            kv_c_and_k_pe_cache.unsqueeze(-2),  # [blocks, 64, 1 latent head, 576]
            decode.block_table,
            decode.seq_lens,
            self.kv_lora_rank,
            decode.tile_scheduler_metadata,
            decode.num_splits,
            softmax_scale=self.decode_scale,
            causal=s_q > 1,
        )
        return out.view(num_tokens, num_heads, self.kv_lora_rank), None
