"""Decode context parallelism in the SGLang plugin: refused, with a message that says what to do instead.

SGLang 0.5.21 and 0.5.23 run DCP (--dcp-size N) with their own FlashMLA backend for 16-bit caches: each rank
attends the KV slots its owner rule assigns it and returns the decode lse for SGLang's cross-rank merge.
The plugin's SGLang adapter does not implement that yet; the check below is the one the backend's
constructor runs (flashmla_backend.sglang.backend.check_model_runner), under SGLang's own parallel context.

Run them with `bash tests/run.sh --engines` (SGLang in its own environment under .test-envs/).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

import test_sglang_cpu  # noqa: E402,F401  (imports SGLang as those tests do: the torchvision stand-in)
import torch  # noqa: E402

from flashmla_backend.geometry import HEAD_DIM_V, PAGE_SIZE, ROPE_DIM  # noqa: E402
from flashmla_backend.sglang import backend as sglang_backend  # noqa: E402
from flashmla_backend.sglang.backend import check_model_runner  # noqa: E402

from sglang.srt.runtime_context import get_parallel  # noqa: E402


@pytest.fixture(autouse=True)
def no_speculation(monkeypatch):
    """SGLang's parallel context as it is; its speculative-decoding namespace is published only by a server
    (what the check reads of it: no speculation)."""
    monkeypatch.setattr(sglang_backend, "_runtime",
                        lambda: (get_parallel(), SimpleNamespace(speculative_eagle_topk=None)))


def runner():
    """What check_model_runner reads from SGLang's ModelRunner, for a served configuration."""
    return SimpleNamespace(use_mla_backend=True, page_size=PAGE_SIZE, dtype=torch.bfloat16,
                           kv_cache_dtype=torch.bfloat16, kv_cache_dtype_str="auto", kv_index_translator=None,
                           model_config=SimpleNamespace(kv_lora_rank=HEAD_DIM_V, qk_rope_head_dim=ROPE_DIM))


def test_without_dcp_the_runner_is_accepted():
    with get_parallel().override(attn_dcp_size=1):
        assert check_model_runner(runner(), skip_prefill=False) == []


@pytest.mark.parametrize("size", [2, 4])
def test_dcp_is_refused_naming_what_works(size):
    with get_parallel().override(attn_dcp_size=size):
        assert get_parallel().attn_dcp_size == size
        reasons = check_model_runner(runner(), skip_prefill=False)
    (reason,) = reasons
    assert f"--dcp-size {size}" in reason and "decode context parallelism" in reason
    assert "drop --dcp-size" in reason and "--attention-backend flashmla" in reason  # what works instead
    assert "lse" in reason and "--decode-context-parallel-size" in reason  # what support needs; vLLM has it
