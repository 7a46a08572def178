"""Per-step metadata of the sparse MLA backend: vLLM's sparse MLA metadata plus the sparse decode plan.

vLLM's SparseMLACommonMetadataBuilder (vllm.model_executor.layers.attention.sparse_mla_attention, in 0.26 and
0.33 alike) does the common work: it splits the batch into decode requests (first) and prefill requests, maps
every query token to the batch row of its request (req_id_per_token, which the index conversion reads), and
prepares vLLM's dense-MHA prefill. This builder adds what flashmla_backend's sparse decode needs:

  * decode_query_len: s_q of the decode requests. Decode requests all have the same query length (1, or
    1 + the speculative tokens for MTP: require_uniform_decodes, and vLLM raises the decode threshold to
    1 + num_speculative_tokens since the builder declares supports_spec_as_decode);
  * two FlashMLASchedMeta objects (flashmla_backend.get_mla_metadata() without arguments, FlashMLA's sparse
    convention): one for the decode tokens ([decode requests, s_q] queries), one for prefill tokens that reach the
    sparse path (each token a query of its own: [num_tokens, 1]); each serves every layer of the step, which all
    have the same shapes. The decode one is filled here (flashmla_backend.fill_sparse_sched_meta) and kept for its
    batch shape (decode requests, s_q, top-k): a captured CUDA graph's decode calls read its tensors in every replay,
    so they must exist before the capture and live as long as the graph (at most one object a decode batch size;
    on a CPU device it holds the configuration only). The prefill one is fresh every step and filled by the first
    layer's call (prefill tokens run outside graphs).

Which tokens reach forward_mqa is vLLM's choice (MLAAttention.forward): the decode tokens always; the prefill
tokens too when vLLM does not run them through its dense-MHA prefill (0.26: no prefill backend, a prefill
longer than index_topk tokens, or --attention-config sparse_mla_force_mqa; 0.33 adds its masked-MHA choice,
keyed on vLLM's own backend names, so never for this backend).

Full CUDA graphs (AttentionCGSupport.UNIFORM_BATCH, as vLLM's FLASHMLA_SPARSE declares): uniform decode
batches are captured. Everything the captured forward reads comes from vLLM's persistent buffers (the
block table, seq_lens, req_id_per_token, the indexer's top-k buffer, the decode schedule kept by this builder) and
the index conversion is plain tensor arithmetic on the device.

The metadata class: 0.33 has SparseMLACommonMetadata (keyword-only fields) and builds it with
decode_max_query_len; 0.26 has no common class (each backend declares the fields the common builder fills),
so the fields 0.26's builder passes are declared here.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from vllm.config import VllmConfig
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadata
from vllm.model_executor.layers.attention import sparse_mla_attention as _sparse

import flashmla_backend
from flashmla_backend import engine_support
from flashmla_backend.geometry import PAGE_SIZE

from .builder import uniform_query_len

SparseMLACommonMetadataBuilder = _sparse.SparseMLACommonMetadataBuilder
_CommonMetadata = getattr(_sparse, "SparseMLACommonMetadata", None)   # 0.33; None on 0.26

if _CommonMetadata is None:
    @dataclasses.dataclass(kw_only=True)
    class _CommonMetadata(AttentionMetadata):
        """The fields vLLM 0.26's SparseMLACommonMetadataBuilder.build passes (and its MLA layer reads)."""

        num_reqs: int
        max_query_len: int
        max_seq_len: int
        num_actual_tokens: int
        query_start_loc: torch.Tensor
        slot_mapping: torch.Tensor
        block_table: torch.Tensor           # [num_reqs, max_kernel_blocks] int32, 64-token kernel blocks
        req_id_per_token: torch.Tensor      # [num_tokens] int32: the batch row of each query token's request
        seq_lens: torch.Tensor | None = None
        block_size: int = PAGE_SIZE
        topk_tokens: int = 2048
        num_decodes: int = 0
        num_prefills: int = 0
        num_decode_tokens: int = 0
        prefill_max_seq_len: int = 0
        prefill: Any = None                 # vLLM's MLACommonPrefillMetadata (dense-MHA prefill)
        cp_kv_cache_interleave_size: int = 1


@dataclasses.dataclass(kw_only=True)
class FlashMLASparsePluginMetadata(_CommonMetadata):
    decode_query_len: int = 0              # s_q of every decode request (0: no decode requests)
    decode_sched_meta: Any = None          # FlashMLASchedMeta for the decode tokens, [num_decodes, s_q]
    prefill_sched_meta: Any = None         # FlashMLASchedMeta for prefill tokens on the sparse path, [tokens, 1]


class FlashMLASparsePluginMetadataBuilder(SparseMLACommonMetadataBuilder[FlashMLASparsePluginMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    require_uniform_decodes: ClassVar[bool] = True
    metadata_cls = FlashMLASparsePluginMetadata

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if kv_cache_spec.block_size != PAGE_SIZE:
            raise ValueError(
                f"flashmla_backend: kernel block size {kv_cache_spec.block_size}; sparse decode reads {PAGE_SIZE}-token "
                f"pages. Use --block-size 64 (or a multiple of 64), or leave it unset.")
        if self.dcp_world_size > 1:
            raise ValueError(
                f"flashmla_backend: --decode-context-parallel-size {self.dcp_world_size} with a sparse MLA model; the "
                "plugin's sparse decode does not support decode context parallelism. Leave it at 1.")
        self.num_heads = self.model_config.get_num_attention_heads(vllm_config.parallel_config)
        problem = engine_support.sparse_heads_problem(self.num_heads)
        if problem is not None:
            raise ValueError(problem)
        # Decode = query length 1; vLLM raises it to 1 + num_speculative_tokens (MTP) for this builder.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        self._kv_ds_mla = engine_support.sparse_is_ds_mla(vllm_config.cache_config.cache_dtype)
        self._decode_sched: dict[tuple[int, int, int], Any] = {}   # (decode requests, s_q, top-k) -> filled object

    def _decode_sched_meta(self, batch: int, s_q: int, topk: int):
        """The decode tokens' FlashMLASchedMeta for this batch shape, filled once and kept (module docstring)."""
        key = (batch, s_q, topk)
        meta = self._decode_sched.get(key)
        if meta is None:
            meta = flashmla_backend.fill_sparse_sched_meta(
                flashmla_backend.get_mla_metadata()[0], batch=batch, s_q=s_q, num_heads_q=self.num_heads, topk=topk,
                device=self.device, is_fp8_kvcache=self._kv_ds_mla, page_block_size=PAGE_SIZE)
            self._decode_sched[key] = meta
        return meta

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False
              ) -> FlashMLASparsePluginMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if metadata.num_decodes > 0:
            qsl = common_attn_metadata.query_start_loc_cpu[: metadata.num_decodes + 1]
            metadata.decode_query_len = uniform_query_len(qsl, metadata.num_decode_tokens)
            metadata.decode_sched_meta = self._decode_sched_meta(
                metadata.num_decode_tokens // metadata.decode_query_len, metadata.decode_query_len,
                metadata.topk_tokens)
        if metadata.num_decode_tokens < metadata.num_actual_tokens:
            metadata.prefill_sched_meta = flashmla_backend.get_mla_metadata()[0]
        return metadata
