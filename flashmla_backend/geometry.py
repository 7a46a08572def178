"""The MLA geometry the kernels are built for, stated once for all of Python.

DeepSeek-V3-architecture attention in absorbed (MQA) form: a cache row and a query row hold
HEAD_DIM_K = 576 columns, the 512-column latent (kv_lora_rank, also V: HEAD_DIM_V) followed by the
64-column RoPE part (qk_rope_head_dim). The paged cache has 64-token pages, the kernels' key tile;
query rows are tiled by 64 (BLOCK_M); a tile-scheduler metadata row is META_INTS int32.

The compiled module exports the same numbers (csrc/params.h); flashmla_backend._ext compares them with
these when it loads the module, so the two languages cannot drift apart silently.
"""
from __future__ import annotations

HEAD_DIM_V = 512      # latent columns (kv_lora_rank); V is this part of the cache row
ROPE_DIM = 64         # RoPE columns (qk_rope_head_dim)
HEAD_DIM_K = HEAD_DIM_V + ROPE_DIM   # 576: a cache row and a query row
PAGE_SIZE = 64        # tokens per KV-cache page (kernel block)
BLOCK_M = 64          # query rows per tile
META_INTS = 8         # int32 per tile-scheduler metadata row

# Name of each constant in the compiled module's `schedule_constants` dict.
EXPORTED = {"head_dim_k": HEAD_DIM_K, "head_dim_v": HEAD_DIM_V, "page_size": PAGE_SIZE,
            "block_m": BLOCK_M, "meta_ints": META_INTS}


def mismatches(exported: dict) -> list[str]:
    """The constants on which the compiled module (its `schedule_constants`) disagrees with this module."""
    return [f"{name}: compiled {exported.get(name)!r}, Python {value!r}"
            for name, value in EXPORTED.items() if exported.get(name) != value]
