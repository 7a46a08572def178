"""FlashMLA's newer calling convention: a scheduler-metadata object filled by the first decode call.

Code written for FlashMLA's newer interface (the one vLLM's bundled FlashMLA has too) does

    sched_meta, _ = get_mla_metadata()                      # no arguments: an empty object
    for layer in layers:                                    # one decode step
        out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512,
                                          sched_meta, None, softmax_scale=scale, causal=True)

The first call fills the object: it computes the tile-scheduler metadata for that call's cache_seqlens and
shapes (exactly what get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv) returns) and records the
call's configuration; later calls reuse the metadata and are refused, naming what changed, when their
shapes or flags differ from the recorded ones. The metadata belongs to the cache_seqlens of the first call:
like FlashMLA's, an object serves the layers of one decode step; take a new one for the next step.

Sparse decode (indices=) takes such an object too, as FlashMLA's sparse calling convention does. Its first call
records the configuration (topk, the last dimension of indices, among it) and later calls are checked against it
the same way; an object filled by dense calls refuses sparse ones and the reverse (topk differs). On CPU tensors the
tensors stay None (the reference needs no schedule); the first call on CUDA tensors computes the sparse kernel's
schedule, as FlashMLA's does: every query token of the batch a row of topk entries (sparse_lengths), whatever
topk_length says (the kernel reads topk_length itself).

CUDA graphs: fill the object before capture (one eager call); the captured calls then read its tensors.
Filling it while a graph is being captured is refused: the metadata would be computed once, at capture, and
replays with other lengths would read it without anything saying so. (Engines that replay graphs with new
lengths every step use the old convention with persistent buffers: flashmla_backend.plan.DecodePlan.)
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class FlashMLASchedMeta:
    """Tile-scheduler metadata of one decode step, filled by the first flash_mla_with_kvcache call."""

    @dataclasses.dataclass(frozen=True)
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: int | None

    have_initialized: bool = False
    config: Config | None = None
    tile_scheduler_metadata: torch.Tensor | None = None   # [num_sm_parts, META_INTS] int32 (dense decode)
    num_splits: torch.Tensor | None = None                # [b + 1] int32 (dense decode; sparse: [b s_q + 1])
    sparse_lengths: torch.Tensor | None = None            # sparse decode on CUDA: [b s_q] int32, the rows' lengths
                                                          # of the schedule (topk each)
    sparse_split: bool | None = None                      # sparse decode on CUDA: whether the schedule cuts a row
                                                          # in splits (the combine runs only then)

    def config_of(self, q: torch.Tensor, k_cache: torch.Tensor, causal: bool, is_fp8_kvcache: bool,
                  topk: int | None) -> Config:
        return self.Config(q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], k_cache.shape[2], bool(causal),
                           bool(is_fp8_kvcache), topk)

    def check_matches(self, config: Config) -> None:
        """Raise ValueError naming every field of `config` that differs from the one this object was filled for."""
        assert self.config is not None
        diff = [f"{f.name} {getattr(self.config, f.name)!r} -> {getattr(config, f.name)!r}"
                for f in dataclasses.fields(config) if getattr(self.config, f.name) != getattr(config, f.name)]
        if diff:
            raise ValueError(
                "flashmla_backend: tile_scheduler_metadata (a FlashMLASchedMeta from get_mla_metadata()) was filled "
                f"by an earlier call with other arguments ({', '.join(diff)}); an object serves the calls of one "
                "decode step with the same shapes and flags: take a new one with get_mla_metadata()")
