"""The backend class vLLM's registry points at: static capabilities and refusals.

vLLM calls `validate_configuration` on the selected backend at start-up (in the process that builds
the model) and stops with "Selected backend CUSTOM is not valid for this configuration. Reason:
[...]" when the list is not empty; `supports_combination` adds this plugin's own explanations
(which block sizes and KV-cache dtypes work) to vLLM's generic reasons.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend

from flashmla_backend.geometry import HEAD_DIM_K, PAGE_SIZE

from .builder import FlashMLAPluginMetadataBuilder
from .impl import SUPPORTED_KV_CACHE_DTYPES, FlashMLAPluginImpl

_KV_DTYPE_BY_NAME = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class FlashMLAPluginBackend(MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(SUPPORTED_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        # The registry slot the plugin occupies; vLLM maps names back to AttentionBackendEnum members.
        return "CUSTOM"

    @staticmethod
    def get_builder_cls() -> type[FlashMLAPluginMetadataBuilder]:
        return FlashMLAPluginMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[FlashMLAPluginImpl]:
        return FlashMLAPluginImpl

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        # vLLM splits KV-manager blocks of any multiple of 64 tokens into 64-token kernel blocks.
        return [PAGE_SIZE]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [HEAD_DIM_K]

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        # sm_90 (Hopper) runs the wgmma/TMA kernel, sm_80+ with enough shared memory the portable one;
        # supports_combination asks flashmla_backend about the actual GPU.
        return capability.major >= 8

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # vLLM >= 0.33 asks this for adaptive speculative verification (drafts trimmed on the device).
        # The builder plans from the CPU query lengths (uniform s_q per decode batch): opt out.
        return False

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
        if not use_mla:
            reasons.append("flashmla_backend serves only MLA models (DeepSeek-V2/V3 architecture)")
        if use_sparse:
            reasons.append("flashmla_backend has no sparse MLA (DeepSeek-V3.2 indexer) decode")
        if block_size is not None and block_size % PAGE_SIZE != 0:
            reasons.append(
                f"flashmla_backend needs a KV block size that is a multiple of {PAGE_SIZE}: 64, 128 or 256 "
                f"work (larger blocks are split into 64-token kernel blocks), {block_size} does not; use "
                "--block-size 64 or leave --block-size unset")
        if kv_cache_dtype is not None and kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            reasons.append(
                f"flashmla_backend does not support kv_cache_dtype {kv_cache_dtype!r} (the plugin does not serve FP8 KV caches yet; the API does); "
                f"use {', '.join(SUPPORTED_KV_CACHE_DTYPES)}")
        elif kv_cache_dtype in _KV_DTYPE_BY_NAME and _KV_DTYPE_BY_NAME[kv_cache_dtype] != dtype:
            reasons.append(
                f"flashmla_backend needs the KV cache in the model dtype ({dtype}), got kv_cache_dtype "
                f"{kv_cache_dtype!r}; use --kv-cache-dtype auto")
        if torch.cuda.is_available():
            import flashmla_backend

            ok, why = flashmla_backend.is_supported()
            if not ok:
                reasons.append(why)
        return "; ".join(reasons) if reasons else None
