"""Per-batch decode metadata for the SGLang backend: page table, key lengths, tile-scheduler plan.

Pure PyTorch (no SGLang import), so it runs on CPU tensors in the tests and on CUDA tensors in the
engine, where every step is a fixed-shape device op: no host sync, safe to run before a CUDA-graph
replay.

SGLang's MLA KV pool (MLATokenToKVPool) stores one latent row per token, `[num_tokens + 64, 1, 576]`
per layer, token slot t at row t. With page size 64 the allocator hands out whole pages, so the slots
of a request's positions 64*j .. 64*j + 63 are consecutive rows of page `slot // 64`, and the pool
viewed as `[num_pages, 64, 1, 576]` is the paged cache flash_mla_with_kvcache reads. Page 0 holds
slots 0..63, which SGLang never hands out (padding): unused block-table entries point at it.

Key lengths per mode (q rows are request-major, s_q rows per request):
  decode            s_q = 1                kv_len = seq_len + step_offset
  target_verify     s_q = num_draft_tokens kv_len = seq_len + num_draft_tokens   (drafts not in seq_len)
  draft_extend      s_q = num_draft_tokens kv_len = seq_len                      (window already in seq_len)
step_offset is 0 except in the multi-step draft decoder, whose step i reads the i + 1 draft tokens
written after seq_len (topk = 1). With s_q > 1 attention is causal inside the window: row s of a
request sees keys 0 .. kv_len - s_q + s.

Decode context parallelism (SGLang's --dcp-size N, rank r of the DCP group): req_to_token holds "widened"
slots; slot s belongs to rank s % N and sits in that rank's pool at row s // N (SGLang's MLA pool writes
through set_mla_kv_buffer by that rule, and its allocator hands out pages of 64 * N slots). Rank r thus holds
request positions r, r + N, r + 2N, ...: its j-th local key is position r + j * N, in its page
req_to_token[row, r + 64 * N * (j // 64)] // N // 64 at offset j % 64. The builder then plans on the local
share: kv_len_local = kv_len // N + (r < kv_len % N) (0 allowed: an empty shard), and page k of the local
table is the page of position r + 64 * N * k. Only decode (s_q = 1) is built this way.

The tile-scheduler metadata, and its persistent CUDA-graph buffers, come from flashmla_backend.plan
(the vLLM adapter uses the same plan); this module adds the page table and key lengths, whose graph
buffers live here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flashmla_backend.geometry import PAGE_SIZE
from flashmla_backend.plan import DecodePlan, DecodeStep

MODE_DECODE = "decode"
MODE_TARGET_VERIFY = "target_verify"
MODE_DRAFT_EXTEND = "draft_extend"


@dataclass
class DecodeMetadata:
    """What forward_decode / forward_extend hand to flash_mla_with_kvcache for one batch."""

    mode: str
    batch_size: int
    query_len: int  # s_q
    cache_seqlens: torch.Tensor  # [batch_size] int32: keys per request (kv_len)
    block_table: torch.Tensor  # [batch_size, max_pages] int32: page ids, 0 past kv_len
    tile_scheduler_metadata: torch.Tensor  # [num_sm_parts, 8] int32
    num_splits: torch.Tensor  # [batch_size + 1] int32


def pages_for(num_tokens: int) -> int:
    return -(-num_tokens // PAGE_SIZE)


def dcp_local_lens(kv_lens: torch.Tensor, dcp_size: int, dcp_rank: int) -> torch.Tensor:
    """Keys of each request that rank `dcp_rank` of `dcp_size` holds (positions p with p % dcp_size == dcp_rank)."""
    if dcp_size == 1:
        return kv_lens
    return (torch.div(kv_lens, dcp_size, rounding_mode="floor")
            + (torch.remainder(kv_lens, dcp_size) > dcp_rank).to(kv_lens.dtype))


def fill_block_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_lens: torch.Tensor,
                     out: torch.Tensor, *, dcp_size: int = 1, dcp_rank: int = 0) -> torch.Tensor:
    """Write the page table of `kv_lens` tokens per request into `out` [bs, max_pages] int32 and return it.

    req_to_token: [pool_size, max_context_len] slot of each request position (int32);
    req_pool_indices: [bs] row of each request in req_to_token; kv_lens: [bs] int32.
    Page j of request b is req_to_token[req_pool_indices[b], 64 * j] // 64 for j < ceil(kv_lens[b] / 64),
    page 0 (padding) after. Device ops only (gather, compare, where): no host sync.
    With dcp_size > 1, kv_lens are rank dcp_rank's local lengths and page j is that rank's page of request
    position dcp_rank + 64 * dcp_size * j: req_to_token there // dcp_size // 64 (module docstring).
    """
    bs, max_pages = out.shape
    width = req_to_token.shape[1]
    local_first = torch.arange(max_pages, device=out.device, dtype=torch.int64) * PAGE_SIZE  # [max_pages]
    cols = (dcp_rank + local_first * dcp_size).clamp(max=width - 1)
    rows = req_pool_indices[:bs].to(torch.int64)
    first_slot = req_to_token[rows.unsqueeze(1), cols.unsqueeze(0)]  # [bs, max_pages]
    used = local_first.unsqueeze(0) < kv_lens[:bs].to(torch.int64).unsqueeze(1)
    page = torch.div(torch.div(first_slot, dcp_size, rounding_mode="floor"), PAGE_SIZE, rounding_mode="floor")
    out.copy_(torch.where(used, page, torch.zeros_like(first_slot)))
    return out


class DecodeMetadataBuilder:
    """Builds DecodeMetadata once per batch; all layers of the step reuse it.

    Eager batches get fresh tensors. CUDA-graph batches (`graph=True`, after `init_graph_buffers`)
    write into buffers allocated once, whose addresses the captured kernels hold, so that every
    replay reads that step's values: the key lengths and page table here, the scheduler metadata in
    `plan` (a flashmla_backend.plan.DecodePlan).
    """

    def __init__(self, *, req_to_token: torch.Tensor, num_q_heads: int, num_draft_tokens: int | None,
                 step_offset: int = 0, dcp_size: int = 1, dcp_rank: int = 0):
        if not 0 <= dcp_rank < dcp_size:
            raise ValueError(f"flashmla_backend: DCP rank {dcp_rank} outside a group of {dcp_size}")
        self.dcp_size, self.dcp_rank = int(dcp_size), int(dcp_rank)
        self.req_to_token = req_to_token
        self.num_q_heads = num_q_heads
        self.num_draft_tokens = int(num_draft_tokens or 0)
        self.step_offset = step_offset
        self.device = req_to_token.device
        # Enough pages for any position of req_to_token (+1: a draft window may end past a page edge).
        self.max_pages = pages_for(req_to_token.shape[1]) + 1
        self.plan = DecodePlan(self.device, num_q_heads=num_q_heads, max_batch_name="cuda_graph_max_bs")
        self.cg_cache_seqlens: torch.Tensor | None = None
        self.cg_block_table: torch.Tensor | None = None

    # ---- modes ----------------------------------------------------------------------------------

    def query_len(self, mode: str) -> int:
        if mode == MODE_DECODE:
            return 1
        if self.num_draft_tokens <= 0:
            raise RuntimeError(
                f"flashmla_backend: {mode} batch without speculative decoding configured "
                "(speculative_num_draft_tokens is 0)")
        return self.num_draft_tokens

    def kv_lens(self, mode: str, seq_lens: torch.Tensor) -> torch.Tensor:
        """Keys per request (int32) for this mode: see the module docstring."""
        if mode == MODE_DECODE:
            extra = self.step_offset
        elif mode == MODE_TARGET_VERIFY:
            extra = self.num_draft_tokens
        elif mode == MODE_DRAFT_EXTEND:
            extra = 0
        else:
            raise ValueError(f"flashmla_backend: unknown decode mode {mode!r}")
        lens = seq_lens.to(torch.int32)
        return lens + extra if extra else lens

    # ---- CUDA-graph buffers ---------------------------------------------------------------------

    def init_graph_buffers(self, max_bs: int) -> None:
        """Allocate the persistent buffers for batches of up to max_bs requests (CUDA graphs)."""
        self.plan.allocate_graph_buffers(max_bs)
        self.cg_cache_seqlens = torch.zeros((max_bs,), dtype=torch.int32, device=self.device)
        self.cg_block_table = torch.zeros((max_bs, self.max_pages), dtype=torch.int32, device=self.device)

    # ---- build ----------------------------------------------------------------------------------

    def build(self, mode: str, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, *,
              graph: bool = False, max_kv_len_hint: int | None = None) -> DecodeMetadata:
        """Metadata of a batch of `bs` requests (the first bs entries of the index/length tensors).

        graph=True writes into the persistent buffers (init_graph_buffers first); max_kv_len_hint (a host
        value, e.g. from seq_lens_cpu) narrows an eager block table, never a graph one.
        """
        s_q = self.query_len(mode)
        kv_lens = self.kv_lens(mode, seq_lens[:bs])
        if self.dcp_size > 1:
            if mode != MODE_DECODE or self.step_offset:
                raise RuntimeError(f"flashmla_backend: {mode} batches are not served under decode context "
                                   "parallelism (decode only)")
            kv_lens = dcp_local_lens(kv_lens, self.dcp_size, self.dcp_rank)
        if graph:
            if self.cg_block_table is None:
                raise RuntimeError("flashmla_backend: CUDA-graph batch before init_cuda_graph_state")
            self.plan.check_graph_batch(bs)  # before writing into the buffers below
            cache_seqlens = self.cg_cache_seqlens[:bs]
            cache_seqlens.copy_(kv_lens)
            block_table = fill_block_table(self.req_to_token, req_pool_indices, cache_seqlens,
                                           self.cg_block_table[:bs], dcp_size=self.dcp_size, dcp_rank=self.dcp_rank)
        else:
            cache_seqlens = kv_lens.contiguous()
            pages = self.max_pages
            if max_kv_len_hint is not None:
                extra = (self.num_draft_tokens if mode == MODE_TARGET_VERIFY
                         else self.step_offset if mode == MODE_DECODE else 0)
                pages = max(1, min(pages, pages_for(-(-(int(max_kv_len_hint) + extra) // self.dcp_size))))
            block_table = torch.empty((bs, pages), dtype=torch.int32, device=self.device)
            fill_block_table(self.req_to_token, req_pool_indices, cache_seqlens, block_table,
                             dcp_size=self.dcp_size, dcp_rank=self.dcp_rank)

        tile_md, num_splits = self.plan.schedule(DecodeStep(cache_seqlens=cache_seqlens, query_len=s_q), graph=graph)
        return DecodeMetadata(mode=mode, batch_size=bs, query_len=s_q, cache_seqlens=cache_seqlens,
                              block_table=block_table, tile_scheduler_metadata=tile_md, num_splits=num_splits)
