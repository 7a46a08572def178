"""One flag for dense and sparse MLA: `--attention-backend CUSTOM` selects the sparse backend for sparse layers.

vLLM keeps one class path per registry slot (`register_backend(AttentionBackendEnum.CUSTOM, path)`), and the
plugin's slot names the dense backend. vLLM's selector resolves a named backend in the platform's
`get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)` (vllm/platforms/cuda.py: the
slot's class, its validate_configuration, then its path; the same in the 0.26 and 0.33 sources). register()
wraps that method on vLLM's current platform object (install below) so that a layer asking for sparse MLA
(attn_selector_config.use_sparse, DeepSeek-V3.2's attention) with the plugin's slot selected gets
flashmla_backend.vllm.sparse_backend.FlashMLASparsePluginBackend instead, after the same check vLLM makes
(validate_configuration of that class, and "Selected backend ... is not valid for this configuration.
Reason: [...]" when it refuses). Every other selection goes to vLLM's method unchanged: dense MLA layers
still get the dense backend, other backends and layers are untouched.

The FP8 spellings: vLLM stores `--kv-cache-dtype fp8` (and fp8_e4m3) of a sparse MLA layer as fp8_ds_mla only
for backends named FLASHMLA_SPARSE (and one other name), in
vllm.model_executor.layers.attention.mla_attention._canonicalize_sparse_mla_kv_cache_dtype, called by the
MLA layer right after the selection (0.26 and 0.33). install_fp8_alias wraps that function so that the
plugin's sparse backend gets the same promotion; where a release has no such function, fp8_alias_available()
is False and the sparse backend refuses `fp8` with a message asking for `--kv-cache-dtype fp8_ds_mla`.
"""
from __future__ import annotations

import logging

from flashmla_backend import engine_support

from . import _compat

SPARSE_CLASS_PATH = "flashmla_backend.vllm.sparse_backend.FlashMLASparsePluginBackend"
_MARK = "_flashmla_backend_sparse_choice"
_CANONICALIZER = "_canonicalize_sparse_mla_kv_cache_dtype"

logger = logging.getLogger("vllm.flashmla_backend")


def is_installed(platform) -> bool:
    """True when the sparse route is on platform.get_attn_backend_cls (_compat.selector_wrapped_by)."""
    return _compat.selector_wrapped_by(platform, _MARK)


def install(platform, dense_class_path: str, plugin_names: tuple[str, ...]) -> bool:
    """Wraps `platform.get_attn_backend_cls`; idempotent. plugin_names: the registry names that select the
    plugin (CUSTOM, and FLASHMLA_BACKEND where vLLM accepts new names). Returns True when the wrapper is in place."""
    if is_installed(platform):
        return True
    vllm_choice = getattr(platform, "get_attn_backend_cls", None)
    if vllm_choice is None:
        return False

    def get_attn_backend_cls(selected_backend, attn_selector_config, num_heads=None):
        if (getattr(attn_selector_config, "use_sparse", False)
                and _selects_plugin(selected_backend, dense_class_path, plugin_names)):
            return _choose_sparse(platform, selected_backend, attn_selector_config)
        return vllm_choice(selected_backend, attn_selector_config=attn_selector_config, num_heads=num_heads)

    setattr(get_attn_backend_cls, _MARK, True)
    get_attn_backend_cls.__wrapped__ = vllm_choice
    platform.get_attn_backend_cls = get_attn_backend_cls
    return True


def _selects_plugin(selected_backend, dense_class_path: str, plugin_names: tuple[str, ...]) -> bool:
    """True when the selected registry member is one of the plugin's and still points at its dense backend."""
    if selected_backend is None or getattr(selected_backend, "name", None) not in plugin_names:
        return False
    try:
        return selected_backend.get_path() == dense_class_path
    except ValueError:  # an unregistered CUSTOM
        return False


def _choose_sparse(platform, selected_backend, attn_selector_config) -> str:
    from .sparse_backend import FlashMLASparsePluginBackend

    reasons = FlashMLASparsePluginBackend.validate_configuration(
        device_capability=platform.get_device_capability(), **attn_selector_config._asdict())
    if reasons:
        # vLLM's own wording for a selected backend that refuses the layer.
        raise ValueError(f"Selected backend {selected_backend} is not valid for this configuration. "
                         f"Reason: {reasons}")
    install_fp8_alias()
    logger.info("flashmla_backend: sparse MLA layers (DeepSeek-V3.2 indexer) use %s.", SPARSE_CLASS_PATH)
    return SPARSE_CLASS_PATH


def _mla_module():
    from vllm.model_executor.layers.attention import mla_attention

    return mla_attention


def fp8_alias_available() -> bool:
    """True when vLLM's MLA layer has the dtype promotion install_fp8_alias extends."""
    try:
        return callable(getattr(_mla_module(), _CANONICALIZER, None))
    except ImportError:
        return False


def install_fp8_alias() -> bool:
    """Makes vLLM's MLA layer store `fp8` / `fp8_e4m3` as fp8_ds_mla for the plugin's sparse backend. Idempotent;
    False where the release has no such promotion."""
    if not fp8_alias_available():
        return False
    module = _mla_module()
    vllm_canonicalize = getattr(module, _CANONICALIZER)
    if getattr(vllm_canonicalize, _MARK, False):
        return True

    def canonicalize(attn_backend, kv_cache_dtype):
        if (kv_cache_dtype in engine_support.SPARSE_FP8_ALIASES
                and getattr(attn_backend, "__module__", "") == SPARSE_CLASS_PATH.rsplit(".", 1)[0]):
            return engine_support.SPARSE_DS_MLA
        return vllm_canonicalize(attn_backend, kv_cache_dtype)

    setattr(canonicalize, _MARK, True)
    canonicalize.__wrapped__ = vllm_canonicalize
    setattr(module, _CANONICALIZER, canonicalize)
    return True
