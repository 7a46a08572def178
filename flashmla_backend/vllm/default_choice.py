"""Opt-in: make the plugin vLLM's automatic choice for MLA decode on Hopper.

vLLM picks an attention backend in `vllm.v1.attention.selector.get_attn_backend`, which asks the
current platform (`current_platform.get_attn_backend_cls(selected_backend, attn_selector_config,
num_heads)`); with no `--attention-backend`, the CUDA platform walks a fixed priority list that it builds
itself (`_get_backend_priorities` in vllm/platforms/cuda.py: FLASH_ATTN_MLA, FLASHMLA, FLASHINFER_MLA,
TRITON_MLA, ... on sm_90) and takes the first backend whose `validate_configuration` accepts the layer.
No vLLM release from 0.26 to 0.33 offers plugins a way to add to or reorder that list.

What this module does, only when `FLASHMLA_BACKEND_VLLM_DEFAULT=1` is set in every vLLM process and
only on a CUDA platform: it wraps the platform object's `get_attn_backend_cls` (the selector's one
call site; same signature in 0.26-0.33) so that a selection with no backend named, for a dense MLA layer
on a compute-capability-9.x GPU, returns this plugin when its own `validate_configuration` accepts the
layer. Everything else goes to vLLM's function unchanged: a named backend (including
`--attention-backend FLASH_ATTN_MLA` etc.), non-MLA layers, sparse MLA, other GPUs, and every layer the
plugin refuses (KV-cache formats outside flashmla_backend.engine_support, such as fp8_e5m2 or fp8_ds_mla;
block sizes that are not multiples of 64, an unsupported GPU or a missing compiled module), which then
get vLLM's usual choice. FP8 (e4m3) KV caches are covered like 16-bit ones, and decode context parallelism
like its absence.

Without the variable nothing is wrapped and vLLM's choice is untouched (tests/test_vllm_cpu.py checks
both on a stand-in Hopper platform).
"""
from __future__ import annotations

import logging
import os

from . import _compat

ENV = "FLASHMLA_BACKEND_VLLM_DEFAULT"
HOPPER_MAJOR = 9
_MARK = "_flashmla_backend_default_choice"

logger = logging.getLogger("vllm.flashmla_backend")


def requested() -> bool:
    """True when the opt-in variable is set to 1 (anything else, or unset, leaves vLLM's choice alone)."""
    return os.environ.get(ENV, "").strip() == "1"


def is_installed(platform) -> bool:
    """True when this module's wrapper is on platform.get_attn_backend_cls (_compat.selector_wrapped_by)."""
    return _compat.selector_wrapped_by(platform, _MARK)


def install(platform, backend_class_path: str) -> bool:
    """Wraps `platform.get_attn_backend_cls` (an instance attribute on vLLM's current platform object).

    Returns True when the wrapper is in place (also when it already was), False when the platform is
    not CUDA. Idempotent.
    """
    if not platform.is_cuda():
        logger.info("flashmla_backend: %s=1 has no effect on the %s platform (CUDA only).",
                    ENV, getattr(platform, "device_name", type(platform).__name__))
        return False
    if is_installed(platform):
        return True
    vllm_choice = platform.get_attn_backend_cls
    announced = []

    def get_attn_backend_cls(selected_backend, attn_selector_config, num_heads=None):
        if selected_backend is None and _eligible(platform, attn_selector_config):
            if not announced:
                announced.append(True)
                logger.info("flashmla_backend: %s=1: MLA decode attention on this Hopper GPU uses "
                            "flashmla_backend (vLLM's automatic choice replaced; unset it to restore it).", ENV)
            return backend_class_path
        return vllm_choice(selected_backend, attn_selector_config=attn_selector_config, num_heads=num_heads)

    setattr(get_attn_backend_cls, _MARK, True)
    get_attn_backend_cls.__wrapped__ = vllm_choice
    platform.get_attn_backend_cls = get_attn_backend_cls
    logger.info("flashmla_backend: %s=1: flashmla_backend becomes the automatic choice for dense MLA "
                "layers on Hopper (sm_90) GPUs it supports; other layers and GPUs keep vLLM's choice.", ENV)
    return True


def _eligible(platform, attn_selector_config) -> bool:
    """A dense MLA layer on a 9.x GPU that the plugin's own checks accept. Never raises."""
    try:
        if not attn_selector_config.use_mla or getattr(attn_selector_config, "use_sparse", False):
            return False
        capability = platform.get_device_capability()
        if capability is None or capability.major != HOPPER_MAJOR:
            return False
        from .backend import FlashMLAPluginBackend

        reasons = FlashMLAPluginBackend.validate_configuration(
            device_capability=capability, **attn_selector_config._asdict())
    except Exception as e:  # never break vLLM's own selection
        logger.warning("flashmla_backend: %s=1 but the plugin could not check this layer (%s: %s); "
                       "vLLM chooses the backend.", ENV, type(e).__name__, e)
        return False
    if reasons:
        logger.info("flashmla_backend: %s=1 but this MLA layer is not for flashmla_backend (%s); "
                    "vLLM chooses the backend.", ENV, "; ".join(reasons))
        return False
    return True
