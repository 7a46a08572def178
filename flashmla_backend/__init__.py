"""flashmla_backend: MLA decode kernels (DeepSeek-V3 attention, absorbed form) for NVIDIA GPUs.

Drop-in compatible with FlashMLA's dense decode API:

    from flashmla_backend import get_mla_metadata, flash_mla_with_kvcache, geometry
    meta, num_splits = get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)
    out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, geometry.HEAD_DIM_V, meta,
                                      num_splits, softmax_scale=scale, causal=True)

The geometry (row widths, page size) is in flashmla_backend.geometry; argument rules in
flashmla_backend.validate. FlashMLA's newer convention (get_mla_metadata() with no arguments, num_splits=None)
works too: flashmla_backend.sched_meta. FP8 KV caches (float8_e4m3fn with descale_k): flash_mla_with_kvcache's
docstring; flash_mla_with_kvcache_fp8 takes vLLM's FlashMLA-FP8 argument order. Sparse decode (DeepSeek-V3.2:
indices=, topk_length=, attn_sink=, the 656-byte fp8_ds_mla cache or a 16-bit one): flash_mla_with_kvcache's
docstring: on CUDA tensors the sm90 sparse kernel (fp8_ds_mla caches) or, for a 16-bit cache, the dense kernels on
the gathered tokens; the reference on CPU tensors (sparse_mla_decode_reference); fill_sparse_sched_meta makes its schedule ahead of CUDA-graph capture. The cache
formats: flashmla_backend.kv_format.

CUDA tensors run the kernels (Hopper: wgmma/TMA; A100: portable mma.sync kernel); CPU tensors run
the pure-PyTorch reference (flashmla_backend.reference). Engine plugins: flashmla_backend.vllm.
"""
from . import geometry
from .device import UnsupportedGPUError, is_supported
from .ops import fill_sparse_sched_meta, flash_mla_with_kvcache, flash_mla_with_kvcache_fp8, get_mla_metadata
from .reference import mla_decode_reference, sparse_mla_decode_reference
from .sched_meta import FlashMLASchedMeta

__version__ = "0.1.0"

__all__ = [
    "get_mla_metadata",
    "flash_mla_with_kvcache",
    "flash_mla_with_kvcache_fp8",
    "mla_decode_reference",
    "sparse_mla_decode_reference",
    "FlashMLASchedMeta",
    "fill_sparse_sched_meta",
    "is_supported",
    "UnsupportedGPUError",
    "__version__",
]
