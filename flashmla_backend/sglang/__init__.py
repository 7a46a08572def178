"""SGLang plugin: flashmla_backend's decode kernels as an SGLang attention backend.

Installed packages register it through the entry point (pyproject.toml)

    [project.entry-points."sglang.srt.plugins"]
    flashmla_backend = "flashmla_backend.sglang:register"

which SGLang calls in its launcher, engine, scheduler and detokenizer processes (SGLANG_PLUGINS
filters by name). Then select it with

    python -m sglang.launch_server --model-path M --attention-backend flashmla_backend

(or `--decode-attention-backend flashmla_backend` to pair it with another prefill backend). The
plugin forces --page-size 64 for it. What runs: decode, MTP / EAGLE target verification and draft
extend (topk 1) go to flashmla_backend.flash_mla_with_kvcache over SGLang's MLA KV pool; prefill and
extend stay with SGLang's Triton backend (flashmla_backend.sglang.backend). KV caches: the model's 16-bit
dtype or FP8 e4m3 (`--kv-cache-dtype fp8_e4m3`, read in place with the layer's k scale; 16-bit queries);
flashmla_backend.engine_support states what is accepted. Supported SGLang versions:
flashmla_backend.sglang._compat.

DeepSeek-V3.2 / GLM-5 (SGLang's DSA backend, --attention-backend dsa or nsa): FLASHMLA_BACKEND_DSA_DECODE=1 runs
that backend's decode on flashmla_backend's sparse decode and leaves its indexer and prefill to SGLang
(flashmla_backend.sglang.dsa, which says what it serves and why it is a variable).

Names: the backend is "flashmla_backend"; it does not touch SGLang's own "flashmla" backend, the
`flash_mla` package or the `torch.ops.flash_mla*` ops (ours are torch.ops.flashmla_backend.*).

Test hook: FLASHMLA_BACKEND_DEBUG_BREAK_SCALE=1 multiplies the softmax scale by 1.5 in this plugin's
decode path only, so that end-to-end comparisons can prove they detect wrong attention; the value "draft"
does it only in the speculative draft model's backends (the acceptance check of the MTP run must see it).
"""
from __future__ import annotations

import logging

from . import _compat

BACKEND_NAME = "flashmla_backend"
from .._env import DEBUG_BREAK_SCALE_ENV  # noqa: E402 (re-exported for the tests)

logger = logging.getLogger("sglang.flashmla_backend")
_hooks_registered = False


def create_backend(runner):
    """The attention-registry factory: `fn(model_runner) -> AttentionBackend`."""
    from .backend import FlashMLAPluginBackend

    return FlashMLAPluginBackend(runner)


def _unsupported_factory(reason: str):
    def create(runner):
        raise RuntimeError(reason)

    return create


def _add_choice(name: str) -> None:
    try:  # 0.5.21-0.5.23 define the choice lists here (server_args re-exports them)
        from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    except ImportError:  # 0.5.17: in server_args
        from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    if name not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([name])


def _import_failure(error: ImportError) -> str:
    """The message when SGLang's attention registry does not import: SGLang missing, or which one failed."""
    version = _compat.installed_sglang_version()
    reason = _compat.unsupported_reason(version)
    if not version:
        return f"flashmla_backend: cannot register the SGLang attention backend: {reason}"
    return (f"flashmla_backend: cannot register the SGLang attention backend: SGLang {version} is installed but "
            f"sglang.srt.layers.attention.attention_registry does not import ({type(error).__name__}: {error})."
            + (f" {reason}" if reason else ""))


def _inside_load_plugins() -> bool:
    try:
        from sglang.srt.plugins.hook_registry import _current_plugin_source
    except ImportError:
        return False
    return _current_plugin_source.get() is not None


def register(apply_hooks: bool | None = None) -> None:
    """Entry point of the `sglang.srt.plugins` group.

    Adds "flashmla_backend" to the --attention-backend / --decode-attention-backend choices and to
    SGLang's attention registry, and registers the hooks of flashmla_backend.sglang.hooks. SGLang's
    plugin loader applies hooks after every plugin ran; called from elsewhere (apply_hooks None) this
    applies them itself. With FLASHMLA_BACKEND_DSA_DECODE set it also registers the hooks of
    flashmla_backend.sglang.dsa (and raises RuntimeError, after registering the rest, where this SGLang has no
    DSA backend class for them). Idempotent. On an unsupported SGLang it logs why and registers a backend whose
    creation raises that message (so the name is accepted and fails with an explanation, never silently).
    Where SGLang cannot be imported (not installed, or a broken installation) it raises ImportError saying so.
    """
    global _hooks_registered
    try:
        from sglang.srt.layers.attention.attention_registry import register_attention_backend
    except ImportError as e:
        raise ImportError(_import_failure(e)) from e

    version = _compat.installed_sglang_version()
    reason = _compat.unsupported_reason(version)
    _add_choice(BACKEND_NAME)
    if reason is not None:
        register_attention_backend(BACKEND_NAME)(_unsupported_factory(reason))
        logger.error("%s Selecting --attention-backend %s will fail with this message.", reason, BACKEND_NAME)
        return

    register_attention_backend(BACKEND_NAME)(create_backend)
    dsa_failure = None
    if not _hooks_registered:
        from . import dsa
        from .hooks import register_hooks

        register_hooks()
        _hooks_registered = True
        try:
            dsa_registered = dsa.register_hooks()
        except RuntimeError as e:
            dsa_failure, dsa_registered = e, False
        if dsa_registered:
            logger.info("flashmla_backend: %s is set: the decode of SGLang's DSA attention backend runs on "
                        "flashmla_backend's sparse decode.", dsa.DSA_DECODE_ENV)
    if apply_hooks is None:
        apply_hooks = not _inside_load_plugins()
    if apply_hooks:
        from sglang.srt.plugins.hook_registry import HookRegistry

        HookRegistry.apply_hooks()
    logger.info("flashmla_backend: registered SGLang attention backend %r (SGLang %s). Select it with "
                "--attention-backend %s.", BACKEND_NAME, version, BACKEND_NAME)
    if dsa_failure is not None:
        logger.error("%s", dsa_failure)
        raise dsa_failure


__all__ = ["register", "create_backend", "BACKEND_NAME", "DEBUG_BREAK_SCALE_ENV"]
