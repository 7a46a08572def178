"""vLLM plugin: flashmla_backend's decode kernels as vLLM's MLA decode attention backend.

Installed packages register it through the entry point (pyproject.toml)

    [project.entry-points."vllm.general_plugins"]
    flashmla_backend = "flashmla_backend.vllm:register"

which vLLM calls in its front end, engine core and every worker. Then select it with
`vllm serve MODEL --attention-backend CUSTOM` or `LLM(MODEL, attention_backend="CUSTOM")`
(vLLM releases that accept named backends, 0.32 and later, also take
`--attention-backend FLASHMLA_BACKEND`). By default vLLM never picks it on its own; with
FLASHMLA_BACKEND_VLLM_DEFAULT=1 in the environment of every vLLM process it becomes the automatic choice
for dense MLA layers on Hopper that it supports (opt-in, see flashmla_backend.vllm.default_choice).

Sparse MLA models (DeepSeek-V3.2, GLM-5: vLLM's indexer picks the top-k tokens) select the plugin with the
same flag and get its sparse backend (flashmla_backend.vllm.sparse_backend, routed by sparse_choice); on a
CUDA device it refuses at start-up until the Hopper sparse decode kernel exists.

What runs (dense MLA): requests of up to the builder's decode threshold of query tokens in a batch of equal
query lengths (decode steps, MTP / speculative verification, short prompts and prefill chunks; builder.py says
the threshold) go to flashmla_backend.flash_mla_with_kvcache on 64-token pages, causal; longer prefills stay
with vLLM's MLA prefill backend. KV caches: the model's 16-bit dtype or FP8 e4m3 (`--kv-cache-dtype fp8`), with the
query mode chosen by FLASHMLA_BACKEND_FP8_MODE (flashmla_backend.engine_support states what is accepted).
Supported vLLM versions: see flashmla_backend.vllm._compat.

Test hook: FLASHMLA_BACKEND_DEBUG_BREAK_SCALE=1 multiplies the softmax scale by 1.5 in this plugin's
decode path and in its sparse attention (DeepSeek-V3.2) only (nothing else reads it). It exists so that
the end-to-end comparison tests can prove they detect wrong attention; never set it otherwise. Ablation hook:
FLASHMLA_BACKEND_DEBUG_VLLM_DECODE_KERNEL=1 makes the plugin's decode call vLLM's own FlashMLA kernel instead of
flashmla_backend's (16-bit cache, no decode context parallelism; the rest of the plugin unchanged), for the engine
test that tells a kernel difference from an engine-path one; never set it otherwise.
"""
from __future__ import annotations

import logging

from . import _compat, default_choice, sparse_choice

BACKEND_CLASS_PATH = "flashmla_backend.vllm.backend.FlashMLAPluginBackend"
UNSUPPORTED_CLASS_PATH = "flashmla_backend.vllm.unsupported.UnsupportedVLLMVersionBackend"
# Descriptive name registered where vLLM's register_backend accepts new names (0.32+; not 0.26-0.31).
BACKEND_NAME = "FLASHMLA_BACKEND"
from .._env import DEBUG_BREAK_SCALE_ENV  # noqa: E402 (re-exported for the tests)

# A child of vLLM's logger, so that messages appear with vLLM's own log format and level.
logger = logging.getLogger("vllm.flashmla_backend")


def _supports_named_backends(enum_cls) -> bool:
    return callable(getattr(enum_cls, "register", None))


def register() -> None:
    """Entry point of the `vllm.general_plugins` group: registers the backend with vLLM's registry.

    Idempotent (vLLM may load plugins more than once per process). Never raises for an unsupported
    vLLM release: it registers a stand-in whose selection fails with a message naming the supported
    versions, so that vLLM keeps working with its own backends.
    """
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError as e:
        logger.error(
            "flashmla_backend: cannot register the vLLM attention backend: %s. %s",
            e, _compat.unsupported_reason(_compat.installed_vllm_version()) or "",
        )
        return

    version = _compat.installed_vllm_version()
    reason = _compat.unsupported_reason(version)
    if reason is not None:
        register_backend(AttentionBackendEnum.CUSTOM, UNSUPPORTED_CLASS_PATH)
        logger.warning("%s Selecting CUSTOM will fail with this message.%s", reason,
                       f" {default_choice.ENV}=1 is ignored." if default_choice.requested() else "")
        return

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS_PATH)
    names = ["CUSTOM"]
    if _supports_named_backends(AttentionBackendEnum):
        if BACKEND_NAME not in AttentionBackendEnum.__members__:
            register_backend(BACKEND_NAME, BACKEND_CLASS_PATH)
        names.append(BACKEND_NAME)
    logger.info(
        "flashmla_backend: registered the MLA decode backend %s as attention backend %s (vLLM %s). "
        "Select it with --attention-backend %s.",
        BACKEND_CLASS_PATH, " and ".join(names), version, names[-1],
    )
    _install_sparse_choice(tuple(names))
    if default_choice.requested():
        _install_default_choice()


def _install_sparse_choice(names: tuple[str, ...]) -> None:
    """Sparse MLA layers (DeepSeek-V3.2) selecting the plugin get its sparse backend (sparse_choice.py); logs
    instead of raising."""
    try:
        from vllm.platforms import current_platform

        sparse_choice.install(current_platform, BACKEND_CLASS_PATH, names)
    except Exception as e:
        logger.warning("flashmla_backend: the sparse MLA backend could not be attached to vLLM's selector (%s: %s); "
                       "sparse MLA models selecting %s get the dense backend's refusal.", type(e).__name__, e,
                       " or ".join(names))


def _install_default_choice() -> None:
    """The opt-in automatic choice (FLASHMLA_BACKEND_VLLM_DEFAULT=1); logs instead of raising."""
    try:
        from vllm.platforms import current_platform

        default_choice.install(current_platform, BACKEND_CLASS_PATH)
    except Exception as e:
        logger.warning("flashmla_backend: %s=1 could not be applied (%s: %s); vLLM chooses attention "
                       "backends as usual.", default_choice.ENV, type(e).__name__, e)


__all__ = ["register", "BACKEND_CLASS_PATH", "BACKEND_NAME", "DEBUG_BREAK_SCALE_ENV"]
