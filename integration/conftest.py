"""GPU integration tests: skipped without a CUDA GPU that flashmla_backend supports, or without vLLM."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # harness.py, make_tiny_checkpoint.py


def _skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return f"vLLM is not importable ({e})"
    import flashmla_backend

    ok, reason = flashmla_backend.is_supported()
    return None if ok else reason


def pytest_collection_modifyitems(config, items):
    reason = _skip_reason()
    if reason:
        skip = pytest.mark.skip(reason=f"vLLM GPU integration test: {reason}")
        for item in items:
            item.add_marker(skip)
