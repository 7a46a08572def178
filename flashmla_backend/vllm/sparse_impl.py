"""The sparse MLA implementation: vLLM's top-k tokens, attended by flashmla_backend's sparse decode.

vLLM's sparse MLA layer (DeepSeek-V3.2) runs its indexer first; the indexer writes the top-k positions of
every query token into a buffer shared by the layers (the impl's topk_indices_buffer, [max_tokens, topk]
int32, positions within the token's request, -1 = none). The layer then hands forward_mqa the absorbed
query of the tokens it sends down the sparse path: q = (ql_nope [T, N, 512], q_pe [T, N, 64]) against the
latent cache [num_kernel_blocks, 64, 656 bytes] (fp8_ds_mla) or [num_kernel_blocks, 64, 576] (16-bit).

forward_mqa:
  1. turns rows 0 .. T-1 of the buffer into cache-wide token indices through the request's block table
     (flashmla_backend.vllm.sparse_indices.to_global_indices: page * 64 + offset, -1 kept as skip);
  2. runs flashmla_backend.flash_mla_with_kvcache with indices= (FlashMLA's sparse calling convention,
     causal False: the indices say what each query token sees) on the decode tokens as [num_decodes, s_q]
     queries, and on prefill tokens, when vLLM sends them down this path too, as queries of their own
     ([tokens, 1]); with topk_length= each row's entries up to its last one that names a token
     (sparse_indices.counted_lengths; a decode request's longest row), so that a request shorter than top-k
     costs its own length, not top-k;
  3. returns (o [T, N, 512], None).
Prefill tokens that vLLM runs through its dense-MHA prefill (forward_mha, inherited from vLLM's
SparseMLACommonImpl) never reach forward_mqa.

What it refuses at start-up: query heads other than 64 or 128 per rank, cache dtypes other than the 16-bit
ones and fp8_ds_mla (engine_support.sparse_kv_cache_dtype_problem), kv_lora_rank / rope widths other than
512 / 64, and a CUDA device (the backend does not run on GPUs yet: sparse_backend.SPARSE_KERNEL_MISSING) unless
FLASHMLA_BACKEND_SPARSE_GPU is set, a Hopper GPU and the fp8_ds_mla cache (engine_support.sparse_device_problem).
"""
from __future__ import annotations

import logging

import torch

from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonImpl
from vllm.v1.attention.backend import AttentionLayer

import flashmla_backend
from flashmla_backend import engine_support
from flashmla_backend._env import SPARSE_GPU_ENV, debug_break_scale_factor

from .sparse_builder import FlashMLASparsePluginMetadata
from .sparse_indices import counted_lengths, to_global_indices

logger = logging.getLogger("vllm.flashmla_backend")

_announced = False


class FlashMLASparsePluginImpl(SparseMLACommonImpl[FlashMLASparsePluginMetadata]):
    # The 16-bit query goes to the kernel (fp8_ds_mla tokens are dequantized against it); no lse for DCP.
    supports_quant_query_input: bool = False
    can_return_lse_for_decode: bool = False
    supports_dcp: bool = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes,
                 sliding_window, kv_cache_dtype: str, logits_soft_cap, attn_type: str,
                 kv_sharing_target_layer_name, **mla_args) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args)
        self.supports_quant_query_input = False
        if any(x is not None for x in (alibi_slopes, sliding_window, logits_soft_cap)):
            raise NotImplementedError(
                "flashmla_backend: ALiBi slopes, sliding windows and logit soft-capping are not supported")
        problem = (engine_support.sparse_heads_problem(num_heads)
                   or engine_support.sparse_kv_cache_dtype_problem("vllm", kv_cache_dtype))
        if problem is not None:
            raise NotImplementedError(problem)
        dims = engine_support.mla_dims_problem(self.kv_lora_rank, self.qk_rope_head_dim, "DeepSeek-V3.2", head_size)
        if dims is not None:
            raise NotImplementedError(f"flashmla_backend: sparse decode {dims}")
        self.kv_ds_mla = engine_support.sparse_is_ds_mla(kv_cache_dtype)
        on_gpu = torch.cuda.is_available()
        if on_gpu:
            from .sparse_backend import SPARSE_KERNEL_MISSING

            problem = engine_support.sparse_device_problem(SPARSE_KERNEL_MISSING, cuda=True, ds_mla=self.kv_ds_mla,
                                                           device="cuda")  # the current GPU
            if problem is not None:
                raise RuntimeError(problem)

        # The test hook of the engine tests (flashmla_backend.vllm: FLASHMLA_BACKEND_DEBUG_BREAK_SCALE): a deliberately
        # wrong softmax scale, so that a GPU run proves its comparison catches broken attention.
        self.attn_scale = self.scale * debug_break_scale_factor("sparse MLA attention", logger)

        global _announced
        if not _announced:
            _announced = True
            logger.info(
                "flashmla_backend: sparse MLA attention (DeepSeek-V3.2 indexer) runs on flashmla_backend %s (%s), %d "
                "heads per rank, scale %.6g, KV cache %s.", flashmla_backend.__version__,
                (f"the Hopper sparse decode kernel, opted in by {SPARSE_GPU_ENV}" if self.kv_ds_mla else
                 f"the dense decode kernel on the gathered tokens, opted in by {SPARSE_GPU_ENV}")
                if on_gpu else "the PyTorch reference, no CUDA device", num_heads, self.scale,
                "fp8_ds_mla (656-byte tokens)" if self.kv_ds_mla else f"{kv_cache_dtype} (16-bit)")

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: FlashMLASparsePluginMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sparse attention of the T tokens vLLM sends down the sparse path (decode tokens first).

        q: (ql_nope [T, N, 512], q_pe [T, N, 64]) or one tensor [T, N, 576]. kv_c_and_k_pe_cache:
        [num_kernel_blocks, 64, 656] bytes (fp8_ds_mla) or [num_kernel_blocks, 64, 576] (16-bit). Query token t
        attends the cache tokens that row t of the indexer's buffer names (its request's positions). Returns
        (o [T, N, 512] in q's dtype, None).
        """
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)  # sparse decode takes q whole
        num_tokens, num_heads, _ = q.shape
        buffer = self.topk_indices_buffer
        if buffer is None:
            raise RuntimeError("flashmla_backend: sparse MLA forward without the indexer's top-k buffer (vLLM passes it "
                               "to sparse MLA impls as topk_indices_buffer or through the indexer)")
        indices = to_global_indices(buffer[:num_tokens], attn_metadata.req_id_per_token, attn_metadata.block_table,
                                    attn_metadata.seq_lens, attn_metadata.block_size)
        lengths = counted_lengths(indices)
        cache = kv_c_and_k_pe_cache
        if cache.shape[1] != attn_metadata.block_size:
            # The indices count kernel blocks of block_size tokens; a cache handed in larger KV-manager blocks is
            # read through a view in kernel blocks (which needs its blocks to follow each other without gaps).
            try:
                cache = cache.view(-1, attn_metadata.block_size, cache.shape[-1])
            except RuntimeError as e:
                raise RuntimeError(
                    f"flashmla_backend: KV cache {tuple(cache.shape)} (strides {cache.stride()}) cannot be viewed in "
                    f"{attn_metadata.block_size}-token kernel blocks, which the top-k indices address") from e
        cache = cache.unsqueeze(-2)  # [blocks, 64, 1 latent head, 656 or 576]
        out = q.new_empty((num_tokens, num_heads, self.kv_lora_rank))

        num_decode_tokens = min(attn_metadata.num_decode_tokens, num_tokens)
        if num_decode_tokens > 0:
            s_q = attn_metadata.decode_query_len
            if s_q <= 0 or num_decode_tokens % s_q != 0:
                raise RuntimeError(
                    f"flashmla_backend: {num_decode_tokens} decode tokens do not form requests of "
                    f"{attn_metadata.decode_query_len} query tokens (the metadata's decode query length)")
            batch = num_decode_tokens // s_q
            # topk_length is per request: the longest of its s_q rows (a shorter row's extra entries are skips)
            out[:num_decode_tokens] = self._sparse_decode(
                q[:num_decode_tokens].view(batch, s_q, num_heads, -1), cache,
                indices[:num_decode_tokens].view(batch, s_q, -1), attn_metadata.decode_sched_meta,
                lengths[:num_decode_tokens].view(batch, s_q).amax(dim=1),
            ).view(num_decode_tokens, num_heads, -1)
        if num_tokens > num_decode_tokens:
            # Prefill tokens on the sparse path: each token is a query of its own.
            rest = num_tokens - num_decode_tokens
            out[num_decode_tokens:] = self._sparse_decode(
                q[num_decode_tokens:].unsqueeze(1), cache, indices[num_decode_tokens:].unsqueeze(1),
                attn_metadata.prefill_sched_meta, lengths[num_decode_tokens:],
            ).view(rest, num_heads, -1)
        return out, None

    def _sparse_decode(self, q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor, sched_meta,
                       topk_length: torch.Tensor) -> torch.Tensor:
        if sched_meta is None:
            raise RuntimeError("flashmla_backend: the sparse metadata has no schedule for these tokens; the builder "
                               "makes one per step for the decode tokens and one for prefill tokens")
        out, _ = flashmla_backend.flash_mla_with_kvcache(
            q, cache, None, None, self.kv_lora_rank, sched_meta, None, softmax_scale=self.attn_scale, causal=False,
            is_fp8_kvcache=self.kv_ds_mla, indices=indices, topk_length=topk_length)
        return out
