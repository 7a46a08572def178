"""GPU integration tests: skipped without a CUDA GPU that flashmla_backend supports, or without the engine
(vLLM for *vllm* files, SGLang for *sglang* files)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # harness.py, make_tiny_checkpoint.py


def _skip_reason(engine: str) -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    import importlib.util

    if engine == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            return f"vLLM is not importable ({e})"
    elif importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed"
    import flashmla_backend

    ok, reason = flashmla_backend.is_supported()
    return None if ok else reason


def pytest_collection_modifyitems(config, items):
    reasons = {}
    for item in items:
        engine = "sglang" if "sglang" in item.path.name else "vllm"
        if engine not in reasons:
            reasons[engine] = _skip_reason(engine)
        if reasons[engine]:
            item.add_marker(pytest.mark.skip(reason=f"{engine} GPU integration test: {reasons[engine]}"))
