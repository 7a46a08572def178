"""Layer-level GPU tests of the SGLang plugin through SGLang's attention unit-test kit.

    python -m pytest integration/test_sglang_layer_gpu.py -v -s     (a GPU machine with SGLang 0.5.17)

SGLang's kit (sglang/test/kits/attention_unittest, shipped in the wheel) builds a MockMLAModelRunner with
a real ReqToTokenPool and MLATokenToKVPool, a tiny DeepSeek-style MLA module whose attention is a real
RadixAttention, and the backend through ATTENTION_BACKENDS[name](runner); it writes the context through
the pool's own MLA write kernel at shuffled page locations and compares the layer output with its fp32
reference. Every case runs with backend "flashmla_backend" (ours: decode / verify / draft extend on
flashmla_backend's kernel, extend on the Triton parent) and with SGLang's "triton" backend on the same
inputs; both must match the kit's reference (the kit's MLA tolerances, atol = rtol = 3e-2), and ours must
match Triton's output. The kit's runners also capture and replay CUDA graphs (decode, EAGLE verify,
draft extend v2), re-preparing metadata for new lengths before each replay.

DeepSeek-V3 shapes: kv_lora_rank 512, qk_rope_head_dim 64, page size 64, 16 and 128 heads, bf16 and fp16.

Run on an H100 with SGLang 0.5.17 (22 passed; see integration/README.md, SGLang, for the numbers and for how
to stage SGLang on a machine without a registry). The kit's functions used here have the same signatures
in 0.5.21.
"""
from __future__ import annotations

import unittest

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("SGLang layer tests need a CUDA GPU", allow_module_level=True)
sglang = pytest.importorskip("sglang")

import flashmla_backend  # noqa: E402

_ok, _why = flashmla_backend.is_supported()
if not _ok:
    pytest.skip(f"flashmla_backend does not run on this GPU: {_why}", allow_module_level=True)

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit  # noqa: E402
from sglang.test.kits.attention_unittest.runner_modes import (  # noqa: E402
    cuda_graph_decode_runner,
    speculative_draft_extend_runner,
    speculative_target_verify_runner,
)

import flashmla_backend.sglang as plugin  # noqa: E402
from flashmla_backend import geometry  # noqa: E402
from flashmla_backend.sglang.backend import FlashMLAPluginBackend  # noqa: E402

OURS, TRITON = plugin.BACKEND_NAME, "triton"
LATENT, ROPE, PAGE = geometry.HEAD_DIM_V, geometry.ROPE_DIM, geometry.PAGE_SIZE
MAX_CONTEXT = 2048
ATOL, RTOL = kit.MLA_ATOL, kit.MLA_RTOL
MLA_SHAPES = dict(kv_lora_rank=LATENT, qk_rope_head_dim=ROPE, max_context_len=MAX_CONTEXT)


@pytest.fixture(scope="module", autouse=True)
def sglang_state():
    plugin.register()
    ctx = get_parallel().override(attn_tp_size=1, attn_dcp_rank=0)
    ctx.__enter__()
    torch.cuda.set_device(0)
    yield
    ctx.__exit__(None, None, None)


class _Case(unittest.TestCase):
    """The kit's runners take a unittest.TestCase (for skipTest); pytest reports unittest.SkipTest as a skip."""

    def runTest(self):
        pass


def case(name, backend, mode, prefix_lens, extend_lens=(), heads=16):
    return kit.MLAAttentionCase(name=name, backend=backend, forward_mode=mode, num_heads=heads, page_size=PAGE,
                                prefix_lens=tuple(prefix_lens), extend_lens=tuple(extend_lens))


EAGER = {
    # name: (mode, prefix_lens, extend_lens, heads)
    "decode_page_edges": (ForwardMode.DECODE, (0, 62, 63, 64, 127, 128), (), 16),
    "decode_long": (ForwardMode.DECODE, (1000, 3, 2000, 511), (), 16),
    "decode_128_heads": (ForwardMode.DECODE, (5, 700, 1500), (), 128),
    "extend_no_prefix": (ForwardMode.EXTEND, (0, 0), (70, 5), 16),  # Triton parent
    "extend_with_prefix": (ForwardMode.EXTEND, (64, 300), (1, 90), 16),  # Triton parent
}


def run_eager(name, backend, dtype):
    mode, prefix, extend, heads = EAGER[name]
    c = case(name, backend, mode, prefix, extend, heads)
    fixture = kit.build_mla_attention_fixture(_Case(), c, dtype=dtype, device="cuda", **MLA_SHAPES)
    out = kit.run_mla_fixture_eager(fixture)
    return fixture, out, kit.expected_mla_fixture_output(fixture)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(EAGER))
def test_eager_matches_triton_and_reference(name, dtype):
    fx_ours, out_ours, ref = run_eager(name, OURS, dtype)
    assert isinstance(fx_ours.backend, FlashMLAPluginBackend)
    if EAGER[name][0] == ForwardMode.DECODE:
        md = fx_ours.backend.decode_metadata  # decode went to our kernel, with our metadata
        assert md is not None and md.mode == "decode" and md.batch_size == len(EAGER[name][1])
    _, out_triton, ref_t = run_eager(name, TRITON, dtype)
    torch.testing.assert_close(ref, ref_t)  # same seeds: same weights, inputs and reference

    def diff(a, b):
        return (a.float() - b.float()).abs().max().item()

    print(f"\n[{name} {dtype}] max |ours - ref| {diff(out_ours, ref):.3e}, max |triton - ref| "
          f"{diff(out_triton, ref):.3e}, max |ours - triton| {diff(out_ours, out_triton):.3e}")
    assert torch.isfinite(out_ours).all()
    torch.testing.assert_close(out_triton, ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out_ours, ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out_ours, out_triton, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("backend", [OURS, TRITON])
def test_decode_cuda_graph_replay(backend):
    c = case("cg_decode", backend, ForwardMode.DECODE, (5, 64, 300, 1000))
    cuda_graph_decode_runner.run_mla_cuda_graph_decode_case(
        _Case(), c, dtype=torch.bfloat16, device="cuda", cuda_graph_capture_batch_size=8, **MLA_SHAPES)


@pytest.mark.parametrize("backend", [OURS, TRITON])
@pytest.mark.parametrize("prefix", [(10, 200, 64), (63, 1000)])
def test_target_verify_topk1(backend, prefix):
    c = case("verify", backend, ForwardMode.TARGET_VERIFY, prefix, (4,) * len(prefix))
    speculative_target_verify_runner.run_mla_eagle_verify_case(
        _Case(), c, topk=1, dtype=torch.bfloat16, device="cuda", **MLA_SHAPES)


# The kit's EAGLE-verify CUDA-graph runner (0.5.17) is used here with the shape SGLang's own backend tests
# give it. Measured on an H100: with any larger shape -- (10, 200, 64, 1000) x 3 draft tokens, (10, 200, 63)
# x 3 padded to 4, (10, 130) x 4, (10, 200, 64) x 4 -- its eager leg disagrees with its own reference by
# 0.1-0.44 for SGLang's Triton backend and for ours alike (the same elements, the same maxima), so those
# shapes test the kit, not a backend. Larger verify shapes are covered eagerly by test_target_verify_topk1.
VERIFY_CG = {
    "bs2_padded": ((4, 7), (3, 3)),
}


@pytest.mark.parametrize("backend", [OURS, TRITON])
@pytest.mark.parametrize("shape", list(VERIFY_CG))
def test_target_verify_cuda_graph(backend, shape):
    prefix, extend = VERIFY_CG[shape]
    c = case("verify_cg", backend, ForwardMode.TARGET_VERIFY, prefix, extend)
    speculative_target_verify_runner.run_mla_eagle_verify_cuda_graph_case(
        _Case(), c, topk=1, dtype=torch.bfloat16, device="cuda", cuda_graph_capture_batch_size=4, **MLA_SHAPES)


@pytest.mark.parametrize("backend", [OURS, TRITON])
def test_draft_extend_v2_cuda_graph(backend):
    c = case("draft_extend", backend, ForwardMode.DRAFT_EXTEND_V2, (10, 130, 64), (4, 4, 4))
    speculative_draft_extend_runner.run_mla_draft_extend_v2_cuda_graph_case(
        _Case(), c, dtype=torch.bfloat16, device="cuda", cuda_graph_capture_batch_size=4, **MLA_SHAPES)


def test_broken_scale_hook_is_detected(monkeypatch):
    """The comparison above must be able to fail: with the debug hook (scale x1.5) ours leaves the reference."""
    monkeypatch.setenv(plugin.DEBUG_BREAK_SCALE_ENV, "1")
    _, out, ref = run_eager("decode_long", OURS, torch.bfloat16)
    assert (out.float() - ref.float()).abs().max().item() > ATOL
