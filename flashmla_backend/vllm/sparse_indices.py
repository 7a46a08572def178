"""vLLM's top-k indices (positions within a request) as the cache-wide token indices sparse decode reads.

vLLM's DeepSeek-V3.2 indexer writes, for every query token t of a step, the positions of the tokens it
selected inside t's own request: row t of the layer's topk_indices_buffer [max_tokens, topk] int32 holds
positions 0 .. seq_len - 1 of that request, and -1 where it selected nothing (a request shorter than topk, or
a query token that may not see later positions). vLLM 0.26 and 0.33 both hand the attention backend these
per-request positions and leave the translation to it (both releases' FLASHMLA_SPARSE backends convert them
with the request's block table; 0.33 shares one conversion per group of layers that reads one indexer).

flash_mla_with_kvcache's sparse decode reads indices into the whole paged cache instead: entry v names row
v % page_size of page v // page_size, and -1 (any value outside the cache) is skipped. to_global_indices does
the translation through the batch's block table (kernel blocks of 64 tokens):

    global = block_table[req, pos // 64] * 64 + pos % 64

with req = the request of query token t (vLLM's req_id_per_token). An entry becomes -1 when pos < 0, when
pos // 64 lies past the request's row of the block table, or when pos >= the request's sequence length (a
position the request has not written: its slot may belong to another request or hold stale values). Plain
tensor operations on the tensors' device: no host synchronization, so it can be captured in a CUDA graph.

counted_lengths gives each row's topk_length for the kernel: 1 + the column of its last entry that names a token.
A query token of a request shorter than topk (a short chat, the first topk positions of a prefill) has fewer
positions than topk; the kernels stop after topk_length entries instead of masking the rest block by block.
Entries before that length that are skipped stay skipped, so the result is the same for any order of the indexer's
entries.
"""
from __future__ import annotations

import torch

from flashmla_backend.geometry import PAGE_SIZE

SKIP = -1


def to_global_indices(indices: torch.Tensor, req_id_per_token: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor | None = None, block_size: int = PAGE_SIZE) -> torch.Tensor:
    """Per-request top-k positions -> cache-wide token indices (page * block_size + offset), -1 for skipped.

    indices [T, topk] int32 (positions within each token's request, -1 = none); req_id_per_token [T] int32
    (the batch row of each token's request); block_table [R, max_blocks] int32 (kernel blocks of block_size
    tokens); seq_lens [R] int32 (tokens each request has in the cache, this step's included) or None to
    skip only what lies past the block table. Returns [T, topk] int32 on indices' device.
    """
    if indices.dim() != 2:
        raise ValueError(f"flashmla_backend: indices must be [num_tokens, topk], got shape {tuple(indices.shape)}")
    num_tokens = indices.shape[0]
    if req_id_per_token.shape[0] < num_tokens:
        raise ValueError(f"flashmla_backend: req_id_per_token has {req_id_per_token.shape[0]} entries for "
                         f"{num_tokens} query tokens; it must name the request of every token")
    if block_table.dim() != 2:
        raise ValueError(f"flashmla_backend: block_table must be [num_requests, max_blocks], got shape "
                         f"{tuple(block_table.shape)}")
    req = req_id_per_token[:num_tokens].long()
    pos = indices.long()
    width = block_table.shape[1]
    block = torch.div(pos, block_size, rounding_mode="floor")
    keep = (pos >= 0) & (block < width)
    if seq_lens is not None:
        keep &= pos < seq_lens.long()[req].unsqueeze(1)
    # [T, topk]: each entry's page, read straight from the table (not through a [T, max_blocks] copy of its rows).
    page = block_table[req.unsqueeze(1), torch.where(keep, block, 0)].long()
    out = page * block_size + pos.remainder(block_size)
    return torch.where(keep, out, SKIP).to(torch.int32)


def counted_lengths(global_indices: torch.Tensor) -> torch.Tensor:
    """Per row of [T, topk] cache-wide indices (-1 = skipped): 1 + the column of its last entry >= 0, 0 for a row
    of skips. [T] int32 on the indices' device; no host synchronization."""
    if global_indices.dim() != 2:
        raise ValueError(f"flashmla_backend: indices must be [num_tokens, topk], got shape "
                         f"{tuple(global_indices.shape)}")
    cols = torch.arange(1, global_indices.shape[1] + 1, dtype=torch.int32, device=global_indices.device)
    zero = torch.zeros((), dtype=torch.int32, device=global_indices.device)
    return torch.where(global_indices >= 0, cols, zero).amax(dim=1)
