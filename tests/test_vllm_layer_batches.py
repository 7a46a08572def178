"""CPU check of the vLLM layer test's hand-built batches (integration/test_vllm_layer_gpu.py): every batch is in the
order vLLM's model runner would hand it to each backend the test runs, so that vLLM's prefill path (used by
TRITON_MLA for spec-decode requests, by every backend for the prefill requests of mixed batches) sees its requests
with cached context before those without. No vLLM and no GPU needed."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"
sys.path.insert(0, str(INTEGRATION))


def _load_layer_test():
    spec = importlib.util.spec_from_file_location("vllm_layer_test_under_cpu_test",
                                                  INTEGRATION / "test_vllm_layer_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


layer = _load_layer_test()


@pytest.mark.parametrize("backend", list(layer.DECODE_SPLITS))
@pytest.mark.parametrize("name", list(layer.CASES))
def test_cases_are_in_vllms_prefill_order(name, backend):
    case = layer.CASES[name]
    threshold, uniform = layer.DECODE_SPLITS[backend](case)
    nd = layer.vllm_num_decodes(case, threshold, uniform)
    assert layer.prefill_order_problems(case, nd) == []


def test_the_old_spec_batch_order_is_caught():
    """The order the spec-decode batch had when TRITON_MLA's prefill tokens were off by 1.0: the request without
    context first, all four requests prefills for TRITON_MLA (threshold 1), decodes for ours and FLASHMLA."""
    old = layer.Case([2, 64, 300, 2049], [2] * 4, spec_tokens=1)
    assert layer.vllm_num_decodes(old, 1, False) == 0
    assert layer.prefill_order_problems(old, 0) == [
        "prefill request 1 has cached context but comes after request 0, which has none",
        "prefill request 2 has cached context but comes after request 0, which has none",
        "prefill request 3 has cached context but comes after request 0, which has none"]
    for threshold, uniform in ((2, True), (128, True)):
        nd = layer.vllm_num_decodes(old, threshold, uniform)
        assert nd == 4 and layer.prefill_order_problems(old, nd) == []


@pytest.mark.parametrize("q, threshold, uniform, expected", [
    ([1, 1, 1, 37, 200, 128], 128, True, 3),    # uniform: the first query length only
    ([1, 1, 1, 37, 200, 128], 1, False, 3),
    ([1, 1, 100, 513], 128, True, 2),
    ([2, 2, 31, 77], 1, False, 0),               # the first request above the threshold: no decodes
    ([2, 2, 31, 77], 2, True, 2),
    ([4, 4, 4], 4, True, 3),
])
def test_num_decodes_follows_vllms_split(q, threshold, uniform, expected):
    case = layer.Case([s + 10 for s in q], q)
    assert layer.vllm_num_decodes(case, threshold, uniform) == expected
