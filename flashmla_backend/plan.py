"""The decode plan both engine adapters share: tile-scheduler metadata per step, CUDA-graph safe.

An engine builds attention metadata once per step and every MLA layer of the step reuses it. The
part that belongs to this package rather than to an engine is the tile-scheduler metadata:

    tile_scheduler_metadata [num_sm_parts, 8] int32    num_splits [batch + 1] int32

computed by flashmla_backend.get_mla_metadata on the batch's device (no host sync). Eager batches
get fresh tensors. A captured CUDA graph holds the addresses its kernels read, so for graph batches
the plan writes the fresh values into buffers allocated once and hands out views of them: every
replay reads that step's metadata at the capture-time addresses. The buffers are sized for the worst
case: num_sm_parts never exceeds the device's SM count (flashmla_backend.device.sm_count), and
num_splits has one entry more than the largest batch the engine runs (max_num_seqs in vLLM, the
largest captured batch in SGLang).

    plan = DecodePlan(device, num_q_heads=16)            # per engine builder, once
    plan.allocate_graph_buffers(max_batch=256)           # when full CUDA graphs are on
    sched = plan.schedule(DecodeStep(cache_seqlens, query_len=1), graph=True)
    sched.tile_scheduler_metadata, sched.num_splits      # hand these to flash_mla_with_kvcache

Everything the scheduler reads about one step is a field of DecodeStep, and DecodePlan.schedule is the
only place that turns it into a get_mla_metadata call: a new per-step input (an FP8 cache flag, say)
is a new field there, and the adapters set it where they build the step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import device as _device
from . import geometry
from .ops import get_mla_metadata


@dataclass(frozen=True)
class DecodeStep:
    """What the tile scheduler needs to know about one decode batch."""

    cache_seqlens: torch.Tensor  # [batch] int32 on the batch's device: keys per request
    query_len: int  # s_q: query tokens per request (1 for plain decode, more for MTP / verification)

    @property
    def batch_size(self) -> int:
        return self.cache_seqlens.shape[0]  # a shape, known on the host: no sync


class DecodeSchedule(NamedTuple):
    """The scheduler's output for one step; unpacks as (tile_scheduler_metadata, num_splits)."""

    tile_scheduler_metadata: torch.Tensor  # [num_sm_parts, 8] int32
    num_splits: torch.Tensor  # [batch + 1] int32


class DecodePlan:
    """Tile-scheduler metadata for an engine's decode steps, in persistent buffers for CUDA graphs.

    device: where the batches live. num_q_heads: query heads per rank; num_kv_heads: latent KV heads
    (1 for MLA). max_batch: allocate the graph buffers at once (see allocate_graph_buffers);
    max_batch_name: what the engine calls that limit, for error messages.
    """

    def __init__(self, device: torch.device | str, *, num_q_heads: int, num_kv_heads: int = 1,
                 max_batch: int | None = None, max_batch_name: str = "max batch"):
        if num_q_heads < 1 or num_kv_heads < 1 or num_q_heads % num_kv_heads:
            raise ValueError(f"flashmla_backend: {num_q_heads} query heads cannot share {num_kv_heads} KV heads")
        self.device = torch.device(device)
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.max_batch = 0
        self.max_batch_name = max_batch_name
        self.cg_tile_scheduler_metadata: torch.Tensor | None = None
        self.cg_num_splits: torch.Tensor | None = None
        if max_batch is not None:
            self.allocate_graph_buffers(max_batch)

    @property
    def has_graph_buffers(self) -> bool:
        return self.cg_tile_scheduler_metadata is not None

    @property
    def max_sm_parts(self) -> int:
        """Rows of the metadata buffer: no step schedules more parts than the device has SMs."""
        return _device.sm_count(self.device)

    def allocate_graph_buffers(self, max_batch: int, *, max_batch_name: str | None = None) -> None:
        """Allocate the persistent buffers for batches of up to max_batch requests.

        Called again (an engine re-initialising its graph state), it allocates new buffers: graphs
        captured before read the old ones and must be captured again, as the engine does.
        """
        if max_batch < 1:
            raise ValueError(f"flashmla_backend: CUDA-graph buffers for a maximum batch of {max_batch} requests")
        if max_batch_name is not None:
            self.max_batch_name = max_batch_name
        self.max_batch = max_batch
        self.cg_tile_scheduler_metadata = torch.zeros(
            (self.max_sm_parts, geometry.META_INTS), dtype=torch.int32, device=self.device)
        self.cg_num_splits = torch.zeros((max_batch + 1,), dtype=torch.int32, device=self.device)

    def check_graph_batch(self, batch_size: int) -> None:
        """Raise unless a graph batch of batch_size requests fits the buffers (host-side check)."""
        if not self.has_graph_buffers:
            raise RuntimeError(
                "flashmla_backend: CUDA-graph batch before the graph metadata buffers were allocated "
                "(the engine did not initialise its CUDA-graph state)")
        if batch_size > self.max_batch:
            raise RuntimeError(
                f"flashmla_backend: CUDA-graph batch of {batch_size} requests exceeds the {self.max_batch} "
                f"({self.max_batch_name}) the graph buffers were allocated for")

    def schedule(self, step: DecodeStep, *, graph: bool) -> DecodeSchedule:
        """The step's tile-scheduler metadata.

        graph=False: fresh tensors. graph=True: the values are written into the persistent buffers and
        views of them ([:num_sm_parts] and [:batch + 1]) are returned, the same addresses every step of
        the same shape. Device work only, no host sync: safe right before a CUDA-graph replay.
        """
        if graph:
            self.check_graph_batch(step.batch_size)
        fresh = DecodeSchedule(*get_mla_metadata(
            step.cache_seqlens, step.query_len * self.num_q_heads // self.num_kv_heads, self.num_kv_heads))
        if not graph:
            return fresh
        assert self.cg_tile_scheduler_metadata is not None and self.cg_num_splits is not None
        parts, rows = fresh.tile_scheduler_metadata.shape[0], fresh.num_splits.shape[0]
        if parts > self.cg_tile_scheduler_metadata.shape[0] or rows > self.cg_num_splits.shape[0]:
            raise RuntimeError(
                f"flashmla_backend: scheduler metadata ({parts} parts, {rows - 1} requests) exceeds the CUDA-graph "
                f"buffers ({self.cg_tile_scheduler_metadata.shape[0]} parts, {self.max_batch} requests = "
                f"{self.max_batch_name})")
        tile_md = self.cg_tile_scheduler_metadata[:parts]
        num_splits = self.cg_num_splits[:rows]
        tile_md.copy_(fresh.tile_scheduler_metadata)
        num_splits.copy_(fresh.num_splits)
        return DecodeSchedule(tile_md, num_splits)
