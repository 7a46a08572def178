"""Environment switches read by the package (one parser, so that every switch accepts the same values)."""
from __future__ import annotations

import os

# Test hook of the engine adapters (vLLM, SGLang): multiplies the decode softmax scale by 1.5 so that the
# end-to-end comparison tests can prove they detect wrong attention. Never set it otherwise.
# The value "draft" breaks only the speculative draft model's attention (SGLang), which leaves the verified
# tokens right and shows only in the draft acceptance.
DEBUG_BREAK_SCALE_ENV = "FLASHMLA_BACKEND_DEBUG_BREAK_SCALE"

# Ablation hook of the vLLM adapter: the plugin's decode calls vLLM's own FlashMLA kernel (16-bit cache, no decode
# context parallelism) instead of flashmla_backend's; the builder, the routing of tokens and the rest of the plugin
# stay as they are. The GPU engine test uses it to tell a difference made by the kernel from one made by the path
# the engine takes with the plugin. Never set it otherwise.
DEBUG_VLLM_DECODE_KERNEL_ENV = "FLASHMLA_BACKEND_DEBUG_VLLM_DECODE_KERNEL"

# SGLang: run the decode of SGLang's DSA attention backend (--attention-backend dsa / nsa: DeepSeek-V3.2, GLM-5)
# on flashmla_backend's sparse decode; SGLang's indexer, prefill and extend stay its own
# (flashmla_backend.sglang.dsa).
DSA_DECODE_ENV = "FLASHMLA_BACKEND_DSA_DECODE"

# Both engines: let the sparse MLA decode (vLLM's sparse backend of the plugin, SGLang's DSA decode above) run on a
# Hopper GPU with the fp8_ds_mla cache, the one cache the Hopper sparse kernel reads. Without it a CUDA device is
# refused at start-up: the kernel has not yet been validated inside the engines and is slower than FlashMLA's at
# small batches and short top-k (engine_support.sparse_device_problem).
SPARSE_GPU_ENV = "FLASHMLA_BACKEND_SPARSE_GPU"


def flag(name: str) -> bool:
    """True unless the variable is unset or one of '', '0', 'false', 'no', 'off' (any case)."""
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")


def debug_break_scale_enabled(draft_runner: bool = False) -> bool:
    """Whether the test hook applies to an attention backend (of the draft model when draft_runner)."""
    if not flag(DEBUG_BREAK_SCALE_ENV):
        return False
    return draft_runner or os.environ[DEBUG_BREAK_SCALE_ENV].strip().lower() != "draft"


def debug_break_scale_factor(attention: str, log, draft_runner: bool = False) -> float:
    """The test hook's factor on an attention backend's softmax scale: 1.5 when DEBUG_BREAK_SCALE_ENV applies to it
    (debug_break_scale_enabled), with a warning on `log` naming `attention`; else 1.0."""
    if not debug_break_scale_enabled(draft_runner):
        return 1.0
    log.warning("flashmla_backend: %s is set: %s uses a WRONG softmax scale (x1.5). This is a test hook; outputs are "
                "deliberately incorrect.", DEBUG_BREAK_SCALE_ENV, attention)
    return 1.5
