"""The backend class vLLM's registry points at: static capabilities and refusals.

vLLM calls `validate_configuration` on the selected backend at start-up (in the process that builds
the model) and stops with "Selected backend CUSTOM is not valid for this configuration. Reason:
[...]" when the list is not empty; `supports_combination` adds this plugin's own explanations
(which block sizes and KV-cache dtypes work, from flashmla_backend.engine_support) to vLLM's generic
reasons. The opt-in automatic choice (default_choice.py) asks the same method.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend

from flashmla_backend import engine_support
from flashmla_backend.geometry import HEAD_DIM_K, PAGE_SIZE

from .builder import FlashMLAPluginMetadataBuilder
from .impl import FlashMLAPluginImpl


class FlashMLAPluginBackend(MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = list(engine_support.MODEL_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(engine_support.accepted_names("vllm"))

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
            # Sparse layers selecting the plugin are handed its sparse backend (sparse_choice.py) before vLLM
            # asks this class; reaching here means that routing is not in place in this process.
            reasons.append("flashmla_backend's dense MLA backend does not serve sparse MLA layers (DeepSeek-V3.2 "
                           "indexer); its sparse backend (flashmla_backend.vllm.sparse_backend) is chosen for them "
                           "when the plugin's register() has run in this process")
        for problem in (engine_support.block_size_problem(block_size),
                        engine_support.kv_cache_dtype_problem("vllm", kv_cache_dtype, dtype)):
            if problem is not None:
                reasons.append(problem)
        if torch.cuda.is_available():
            import flashmla_backend

            ok, why = flashmla_backend.is_supported()
            if not ok:
                reasons.append(why)
        return "; ".join(reasons) if reasons else None
