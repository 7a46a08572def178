"""The sparse MLA backend (DeepSeek-V3.2 / GLM-5 attention): static capabilities and refusals.

vLLM asks for a sparse MLA backend (use_sparse) for the attention layers of DeepSeek-V3.2-architecture models,
whose indexer chooses the top-k cache tokens every query token attends. With `--attention-backend CUSTOM`
the plugin's registry slot names the dense backend (flashmla_backend.vllm.backend); for sparse layers
flashmla_backend.vllm.sparse_choice hands vLLM's selector this class instead, after the same
validate_configuration check vLLM runs on a selected backend.

What it serves: the model's 16-bit cache (576 values a token) or DeepSeek's fp8_ds_mla cache (656 bytes a
token; `--kv-cache-dtype fp8_ds_mla`, or `fp8` / `fp8_e4m3`, which vLLM stores as fp8_ds_mla for this backend
as for its own FLASHMLA_SPARSE), KV blocks of 64 tokens (larger multiples of 64 are split into 64-token kernel
blocks), 64 or 128 query heads per rank (checked where vLLM knows the head count: the builder and the impl).
Refused at start-up with a message naming what works: other cache dtypes and block sizes, attention sinks,
and, on a machine with a CUDA device, everything unless FLASHMLA_BACKEND_SPARSE_GPU is set: the Hopper sparse decode
kernel (fp8_ds_mla caches) has served only a tiny test model inside vLLM and is slower than FlashMLA's at b = 1 and
top-k 512 (benchmarks/RESULTS.md) and its prefill of long prompts slower than FLASHMLA_SPARSE's
(integration/README.md), and a 16-bit cache goes through the dense kernel on gathered tokens (the API's path, about
a third of FlashMLA's speed), so the plugin refuses rather than offer it or fall back. With the variable set, a
Hopper GPU runs either (for the GPU tests and those who try it: engine_support.sparse_device_problem). CPU tensors
run flashmla_backend's PyTorch reference, which is what the CPU conformance tests use.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from vllm.v1.attention.backend import AttentionBackend

from flashmla_backend import engine_support, kv_format
from flashmla_backend._env import SPARSE_GPU_ENV
from flashmla_backend.geometry import HEAD_DIM_K, PAGE_SIZE

from .sparse_builder import FlashMLASparsePluginMetadataBuilder
from .sparse_impl import FlashMLASparsePluginImpl

SPARSE_KERNEL_MISSING = (
    "flashmla_backend: the plugin's sparse MLA backend (DeepSeek-V3.2 indexer attention) does not run on GPUs yet: "
    "flashmla_backend's Hopper sparse decode kernel (the fp8_ds_mla cache) has served only a tiny test model inside "
    "vLLM and is slower than FlashMLA's at short top-k (512) and in the prefill of long prompts, and a 16-bit cache's "
    "tokens are gathered for the dense kernel, at about a third of FlashMLA's speed. Serve this model with vLLM's own "
    "sparse backends (leave --attention-backend "
    f"unset, or FLASHMLA_SPARSE); {SPARSE_GPU_ENV}=1 runs it anyway on a Hopper GPU (--kv-cache-dtype fp8 / "
    "fp8_ds_mla, or auto), for testing")


class FlashMLASparsePluginBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = list(engine_support.MODEL_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(engine_support.SPARSE_KV_CACHE_DTYPES["vllm"])

    @staticmethod
    def get_name() -> str:
        # The registry slot the plugin occupies (vLLM maps names back to AttentionBackendEnum members).
        return "CUSTOM"

    @staticmethod
    def get_builder_cls() -> type[FlashMLASparsePluginMetadataBuilder]:
        return FlashMLASparsePluginMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[FlashMLASparsePluginImpl]:
        return FlashMLASparsePluginImpl

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        # vLLM splits KV-manager blocks of any multiple of 64 tokens into 64-token kernel blocks.
        return [PAGE_SIZE]

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        """The per-layer cache vLLM 0.26 allocates: [blocks, block_size, 656] bytes for fp8_ds_mla, else
        [blocks, block_size, 576] (vLLM 0.33 takes the layout from the KV-cache spec and does not call this)."""
        if cache_dtype_str == engine_support.SPARSE_DS_MLA:
            return (num_blocks, block_size, kv_format.FP8_DS_MLA.width)
        return (num_blocks, block_size, head_size)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [HEAD_DIM_K]

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        # The sparse decode kernel is to be written for sm_90 (Hopper); supports_combination refuses CUDA
        # devices until it exists.
        return capability.major == 9

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability,
    ) -> str | None:
        reasons = []
        if not use_sparse:
            reasons.append("flashmla_backend's sparse MLA backend serves sparse MLA layers (DeepSeek-V3.2 indexer) "
                           "only; dense MLA layers use flashmla_backend.vllm.backend")
        if has_sink:
            reasons.append("flashmla_backend's sparse MLA decode has no attention sinks in vLLM")
        for problem in (engine_support.block_size_problem(block_size),
                        engine_support.sparse_kv_cache_dtype_problem("vllm", kv_cache_dtype, dtype)):
            if problem is not None:
                reasons.append(problem)
        if (kv_cache_dtype in engine_support.SPARSE_FP8_ALIASES
                and not _fp8_alias_available()):
            reasons.append(f"this vLLM release offers no way to store --kv-cache-dtype {kv_cache_dtype} as "
                           f"fp8_ds_mla for a plugin backend; use --kv-cache-dtype {engine_support.SPARSE_DS_MLA}")
        problem = engine_support.sparse_device_problem(
            SPARSE_KERNEL_MISSING, cuda=torch.cuda.is_available(),
            ds_mla=engine_support.sparse_is_ds_mla(kv_cache_dtype), capability=_capability(device_capability))
        if problem is not None:
            reasons.append(problem)
        return "; ".join(reasons) if reasons else None


def _capability(device_capability) -> tuple[int, int] | None:
    """vLLM's DeviceCapability (major, minor) as a tuple; None where the selector passes none."""
    if device_capability is None:
        return None
    if hasattr(device_capability, "major"):
        return (device_capability.major, device_capability.minor)
    return tuple(device_capability)[:2]


def _fp8_alias_available() -> bool:
    from . import sparse_choice

    return sparse_choice.fp8_alias_available()
