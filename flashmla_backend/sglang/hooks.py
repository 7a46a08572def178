"""The places outside the attention registry where SGLang checks backend names, taught ours.

Registered with SGLang's hook registry (sglang.srt.plugins.hook_registry.HookRegistry), which patches
the targets once every plugin has loaded:

  PAGE_SIZE_TARGET     server-argument resolution: page size 64 when ours is the attention, decode or
                       prefill backend (as SGLang does for "flashmla"); --kv-cache-dtype checked there
                       against flashmla_backend.engine_support (fp8_e4m3 served, fp8_e5m2 / mxfp8 / fp4
                       refused), before any model is loaded.
  HANDLER_TARGET       DeepSeek's attention-form choice (MHA vs absorbed MLA per batch): ours is handled
                       as "triton", whose prefill/extend path the backend inherits.
  DRAFT_FACTORY_TARGET speculative decoding (EAGLE / MTP): the draft decoder and draft-extend backend
                       factories build ours for our name.

Decode context parallelism (--dcp-size N): DeepSeek's attention gathers the query heads of the DCP group,
calls the backend's DCP decode (absorbed form: q_nope, k_nope, q_rope=, k_rope=) and merges the returned
(out, lse) across ranks only for the backends listed in FORWARD_ABSORB_CORE_ATTENTION_BACKENDS
(sglang.srt.models.deepseek_common.utils, 0.5.17-0.5.23); route_dcp_decode adds ours there when a backend is
built under DCP. Under DCP the plugin serves decode only, so page_size_constraints refuses it as the prefill
backend there.
"""
from __future__ import annotations

import logging

from flashmla_backend import engine_support
from flashmla_backend.geometry import PAGE_SIZE

logger = logging.getLogger("sglang.flashmla_backend")

PAGE_SIZE_TARGET = "sglang.srt.arg_groups.overrides._mla_backend_page_constraints"
HANDLER_TARGET = "sglang.srt.models.deepseek_common.attention_backend_handler.AttentionBackendRegistry.get_handler"
DRAFT_FACTORY_TARGET = "sglang.srt.speculative.draft_utils.DraftBackendFactory._create_backend"
# The DeepSeek attention handler whose choices match the Triton prefill path the backend inherits.
HANDLER_AS = "triton"


def _names(view) -> tuple:
    return tuple(getattr(view, f, None) for f in
                 ("attention_backend", "decode_attention_backend", "prefill_attention_backend"))


def page_size_constraints(result, view, *args, **kwargs):
    """AFTER hook of SGLang's MLA page-size pass: `result` is that pass's {field: value} declaration."""
    from . import BACKEND_NAME

    if BACKEND_NAME not in _names(view):
        return None  # keep SGLang's declaration
    kv_cache_dtype = getattr(view, "kv_cache_dtype", "auto") or "auto"
    problem = engine_support.kv_cache_dtype_problem("sglang", kv_cache_dtype)
    if problem is not None:
        raise ValueError(f"--attention-backend / --decode-attention-backend {BACKEND_NAME}: {problem}")
    # SGLang 0.5.21+: the draft model's own KV-cache dtype (None: follows --kv-cache-dtype), for our draft backends.
    draft_kv_cache_dtype = getattr(view, "speculative_draft_kv_cache_dtype", None)
    if draft_kv_cache_dtype is not None and getattr(view, "speculative_draft_attention_backend", None) in (
            None, BACKEND_NAME):
        problem = engine_support.kv_cache_dtype_problem("sglang", draft_kv_cache_dtype)
        if problem is not None:
            raise ValueError(f"--speculative-draft-kv-cache-dtype {draft_kv_cache_dtype} with the draft model on "
                             f"{BACKEND_NAME}: {problem}")
    dcp_size = int(getattr(view, "dcp_size", 1) or 1)
    if dcp_size > 1:
        prefill = getattr(view, "prefill_attention_backend", None) or getattr(view, "attention_backend", None)
        if prefill == BACKEND_NAME:
            raise ValueError(
                f"--dcp-size {dcp_size}: {BACKEND_NAME} serves decode only under decode context parallelism (its "
                "prefill is SGLang's Triton backend, which has no MLA DCP prefill). Use --prefill-attention-backend "
                f"flashinfer (or another backend SGLang runs DCP prefill with) --decode-attention-backend {BACKEND_NAME}")
        if "fp8" in str(kv_cache_dtype).lower():
            raise ValueError(
                f"--dcp-size {dcp_size} with --kv-cache-dtype {kv_cache_dtype}: {BACKEND_NAME} serves decode context "
                "parallelism with a 16-bit KV cache only (SGLang's own flashmla backend refuses FP8 with DCP too)")
    declared = dict(result or {})
    page_size = declared.get("page_size", getattr(view, "page_size", None))
    if page_size != PAGE_SIZE:
        logger.warning("flashmla_backend: the decode kernel reads %d-token pages, changing page_size %s to %d.",
                       PAGE_SIZE, page_size, PAGE_SIZE)
        declared["page_size"] = PAGE_SIZE
    return declared


def deepseek_handler(original, cls, backend_name, *args, **kwargs):
    """AROUND hook of AttentionBackendRegistry.get_handler (a classmethod): ours chooses as "triton"."""
    from . import BACKEND_NAME

    return original(cls, HANDLER_AS if backend_name == BACKEND_NAME else backend_name, *args, **kwargs)


def draft_backend_factory(original, factory, backend_name, backend_map, *args, **kwargs):
    """AROUND hook of DraftBackendFactory._create_backend: add our name to the map it chooses from.

    The factory calls _create_backend with its decode map (create_decode_backend) or its draft-extend map
    (create_draft_extend_backend); they are told apart by their "triton" entry. SGLang 0.5.18+ creators
    return (stamp, backend), 0.5.17's the backend alone.
    """
    from . import BACKEND_NAME, _compat
    from .backend import FlashMLAPluginBackend, FlashMLAPluginMultiStepDraftBackend

    with_stamp = _compat.draft_creators_return_stamp(_compat.installed_sglang_version())
    is_decode_map = backend_map.get("triton") == getattr(factory, "_create_triton_decode_backend", None)

    def create():
        runner = factory.draft_model_runner
        if is_decode_map:
            backend = FlashMLAPluginMultiStepDraftBackend(runner, factory.topk, factory.speculative_num_steps)
        else:
            backend = FlashMLAPluginBackend(runner, skip_prefill=False)
        return (BACKEND_NAME, backend) if with_stamp else backend

    extended = dict(backend_map)
    extended[BACKEND_NAME] = create
    return original(factory, backend_name, extended, *args, **kwargs)


ABSORB_LIST_MODULE = "sglang.srt.models.deepseek_common.utils"


def route_dcp_decode() -> bool:
    """Add our name to DeepSeek's FORWARD_ABSORB_CORE_ATTENTION_BACKENDS, the backends whose decode runs through
    the DCP path (query heads gathered, (out, lse) returned and merged). Idempotent; the list is read per forward,
    so the backend's constructor (before any forward) is early enough. False when this SGLang has no such list."""
    import importlib

    from . import BACKEND_NAME

    try:
        names = getattr(importlib.import_module(ABSORB_LIST_MODULE), "FORWARD_ABSORB_CORE_ATTENTION_BACKENDS")
    except (ImportError, AttributeError):
        return False
    if BACKEND_NAME not in names:
        names.append(BACKEND_NAME)
        logger.info("flashmla_backend: --dcp-size > 1: DeepSeek decode on %s runs the DCP path (gathered query "
                    "heads, lse merge across ranks).", BACKEND_NAME)
    return True


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(PAGE_SIZE_TARGET, page_size_constraints, HookType.AFTER)
    HookRegistry.register(HANDLER_TARGET, deepseek_handler, HookType.AROUND)
    HookRegistry.register(DRAFT_FACTORY_TARGET, draft_backend_factory, HookType.AROUND)
