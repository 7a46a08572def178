"""Per-step attention metadata for the plugin: vLLM's MLA metadata plus the tile-scheduler plan.

One builder serves all MLA layers of a KV-cache group, and vLLM calls `build()` once per step, so the
scheduler metadata is computed once per batch (on the batch's device, no host sync) and every layer
reuses it.

Block tables arrive in kernel blocks: the plugin declares 64-token kernel blocks, and vLLM splits each
KV-manager block of 64, 128, 256, ... tokens into 64-token kernel blocks (kv_cache_spec.block_size here
is the kernel block size, the per-layer cache is [num_kernel_blocks, 64, 576]). Block 0 is vLLM's null
block: padded requests point at it and have length 0.

Full CUDA graphs (AttentionCGSupport.UNIFORM_BATCH): decode batches whose requests all have the same
query length are captured and replayed. The builder runs eagerly before every replay; it writes the
fresh metadata into buffers allocated once (`[num_SMs, 8]` and `[max_num_seqs + 1]` int32) so that
the captured kernels, which hold those addresses, read this step's values. flashmla_backend.plan.DecodePlan
owns those buffers and the scheduler call (the SGLang adapter uses the same plan).

Decode context parallelism (--decode-context-parallel-size N, "DCP"): every rank of a DCP group keeps
the tokens of each request whose position p has (p // I) % N == its rank (I =
--cp-kv-cache-interleave-size), packed in order into its own pages: rank-local token j of a request
sits at kernel block j // 64 of the rank's block table, row j % 64. vLLM's MLACommonMetadataBuilder.build
hands _build_decode the rank-local lengths (CommonAttentionMetadata.dcp_local_seq_lens, which may be 0
for a request with tokens on other ranks) as seq_lens, the full lengths as dcp_tot_seq_lens, and the
rank's block table; the decode kernel then reads the rank's share as an ordinary paged sequence. The
queries are all-gathered across the group (N x the rank's heads), so the plan counts N x heads.
Multi-token decode queries (MTP / speculative verification) never reach the decode path under DCP:
the plugin does not declare supports_dcp_with_varlen, so vLLM sets reorder_batch_threshold to 1 and
verifies drafts through its prefill path; the kernel's causal mask (query s sees the first n - s_q + s
keys) would be wrong for an interleaved shard, so _build_decode refuses s_q > 1 with DCP.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.config import VllmConfig
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonDecodeMetadata,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionCGSupport

from flashmla_backend.geometry import PAGE_SIZE
from flashmla_backend.plan import DecodePlan, DecodeStep


@dataclass
class FlashMLAPluginDecodeMetadata(MLACommonDecodeMetadata):
    # block_table [num_decodes, max_kernel_blocks] int32 (64-token blocks), seq_lens [num_decodes] int32
    # are inherited.
    tile_scheduler_metadata: torch.Tensor  # [num_sm_parts, 8] int32, from get_mla_metadata
    num_splits: torch.Tensor  # [num_decodes + 1] int32, from get_mla_metadata
    query_len: int  # s_q: every decode request has s_q query tokens (padding requests: 0)
    num_q_heads: int  # query heads the plan was made for (the rank's heads x the DCP size)


@dataclass
class FlashMLAPluginMetadata(MLACommonMetadata[FlashMLAPluginDecodeMetadata]):
    pass


def uniform_query_len(query_start_loc_cpu: torch.Tensor, num_decode_tokens: int) -> int:
    """s_q of a decode batch whose requests all have s_q tokens, CUDA-graph padding requests 0 tokens.

    query_start_loc_cpu: [num_decodes + 1] (CPU). num_decode_tokens: the decode rows forward_mqa receives
    (for a padded CUDA-graph batch, num_decodes * s_q, padding rows included).
    """
    num_decodes = query_start_loc_cpu.shape[0] - 1
    if num_decodes <= 0 or num_decode_tokens % num_decodes != 0:
        raise ValueError(
            f"flashmla_backend: decode batch of {num_decodes} requests with {num_decode_tokens} tokens is not "
            "uniform; the decode kernel needs every decode request to have the same query length"
        )
    s_q = num_decode_tokens // num_decodes
    lens = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]
    odd = (lens != s_q) & (lens != 0)
    if bool(odd.any()):
        raise ValueError(
            f"flashmla_backend: decode requests have query lengths {sorted(set(lens.tolist()))}, expected "
            f"{s_q} for all (0 for padding); vLLM should have split non-uniform batches (QueryLenSupport.UNIFORM)"
        )
    return s_q


def dcp_interleave_problem(interleave_size: int, block_size: int | None) -> str | None:
    """None when the rank-local tokens of a DCP shard are packed in order into the rank's pages, else why not.

    vLLM places position p of a request on rank (p // I) % N at local index
    (p // (I * N)) * I + p % I within each group of N KV-manager blocks; that is the rank's j-th token at
    index j (a plain paged sequence, which the decode kernel reads) exactly when I divides the per-rank
    block size B. vLLM's own configuration check asks the same (I <= B and B % I == 0); this repeats it
    with the sizes that work.
    """
    if block_size is None or block_size <= 0:
        return None  # vLLM has not chosen the block size yet; it checks I against it once it has
    if interleave_size >= 1 and block_size % interleave_size == 0:
        return None
    works = [d for d in range(1, block_size + 1) if block_size % d == 0]
    return (f"flashmla_backend: --cp-kv-cache-interleave-size {interleave_size} with --block-size {block_size}: "
            "decode context parallelism needs an interleave size that divides the block size (so each rank's "
            f"tokens fill its pages in order); with --block-size {block_size} use one of "
            f"{', '.join(map(str, works))} (1, the default, interleaves single tokens)")


class FlashMLAPluginMetadataBuilder(MLACommonMetadataBuilder[FlashMLAPluginMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM
    # Requests of up to 128 query tokens in a batch of equal query lengths run on the decode kernel, as with
    # vLLM's own FlashMLA builder (the same 128): decode steps, speculative verification and short prefills
    # (a short prompt, or a chunk) alike, the causal mask making a prefill of s_q tokens exact. vLLM lowers it
    # to 1 under decode context parallelism (module docstring) and raises it for more speculative tokens.
    # With 1 here a short prompt went through vLLM's MHA prefill instead, and a step's tokens were routed
    # differently from FLASHMLA's.
    reorder_batch_threshold: int = 128

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, FlashMLAPluginMetadata)
        if kv_cache_spec.block_size != PAGE_SIZE:
            raise ValueError(
                f"flashmla_backend: kernel block size {kv_cache_spec.block_size}; the decode kernel reads "
                f"{PAGE_SIZE}-token pages. Use --block-size 64, 128 or 256 (a multiple of 64), or leave it unset."
            )
        if self.dcp_world_size > 1:
            problem = dcp_interleave_problem(self.cp_kv_cache_interleave_size, vllm_config.cache_config.block_size)
            if problem is not None:
                raise ValueError(problem)
        # Query heads per rank as vLLM's MLA builder counts them: the model's count on 0.26, the layers' own
        # count on later releases (0.31-0.33 read), where a draft model's KV-cache group may have another
        # head count than the target's. With DCP the decode queries of the whole group are gathered on
        # every rank (vLLM's MLA layer all-gathers them by head before forward_mqa).
        self.num_q_heads = self.num_heads * self.dcp_world_size

        # With full CUDA graphs every decode build writes into the plan's persistent buffers (see the
        # module docstring); without them the plan hands out fresh tensors.
        self.plan = DecodePlan(
            device, num_q_heads=self.num_q_heads,
            max_batch=(vllm_config.scheduler_config.max_num_seqs
                       if self.compilation_config.cudagraph_mode.has_full_cudagraphs() else None),
            max_batch_name="max_num_seqs")

    def _build_decode(
        self,
        block_table_tensor: torch.Tensor,
        seq_lens_device: torch.Tensor,
        max_seq_len: int,
        query_start_loc_cpu: torch.Tensor,
        query_start_loc_device: torch.Tensor,
        num_decode_tokens: int,
        dcp_tot_seq_lens_device: torch.Tensor | None,
        max_query_len: int | None = None,  # passed (by keyword) by 0.31-0.33, not 0.26; s_q is derived below
    ) -> FlashMLAPluginDecodeMetadata:
        s_q = uniform_query_len(query_start_loc_cpu, num_decode_tokens)
        if self.dcp_world_size > 1 and s_q > 1:
            raise ValueError(
                f"flashmla_backend: decode batch with {s_q} query tokens per request under decode context "
                f"parallelism (DCP size {self.dcp_world_size}); the decode kernel's causal mask assumes a request's "
                "keys are contiguous, which a DCP shard is not. vLLM verifies speculative tokens through its "
                "prefill path under DCP (decode threshold 1); this batch should not have reached the decode kernel."
            )
        tile_md, num_splits = self.plan.schedule(
            DecodeStep(cache_seqlens=seq_lens_device, query_len=s_q), graph=self.plan.has_graph_buffers)

        return FlashMLAPluginDecodeMetadata(
            block_table=block_table_tensor,
            seq_lens=seq_lens_device,
            dcp_tot_seq_lens=dcp_tot_seq_lens_device,
            tile_scheduler_metadata=tile_md,
            num_splits=num_splits,
            query_len=s_q,
            num_q_heads=self.num_q_heads,
        )
