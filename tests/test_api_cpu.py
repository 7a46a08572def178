"""Public API on CPU tensors (the reference path) and its torch.compile / custom-op registration."""
import inspect

import pytest
import torch

import flashmla_backend as fb
from kit import D_K, D_V, Case, brute_force_fp64, compare, make_inputs


def run(inp, case):
    meta, ns = fb.get_mla_metadata(inp.cache_seqlens, case.s_q * case.h_q // case.h_kv, case.h_kv)
    return fb.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, ns,
                                     softmax_scale=inp.scale, causal=case.causal)


@pytest.mark.parametrize("case", [Case(lengths=[0, 90, 1], s_q=2, h_q=4), Case(lengths=[130], h_q=2, h_kv=2, causal=False)],
                         ids=str)
def test_cpu_api_matches_brute_force(case):
    inp = make_inputs(case)
    out, lse = run(inp, case)
    compare(out, lse, *brute_force_fp64(inp, case.causal), case.lengths, case.s_q, case.causal)


def test_default_scale_is_head_dim_k():
    case = Case(lengths=[50], h_q=2)
    inp = make_inputs(case)
    meta, ns = fb.get_mla_metadata(inp.cache_seqlens, 2, 1)
    out1, lse1 = fb.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, ns,
                                           causal=True)
    out2, lse2 = fb.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, ns,
                                           softmax_scale=D_K ** -0.5, causal=True)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)


def test_signature_is_flashmla_compatible():
    params = list(inspect.signature(fb.flash_mla_with_kvcache).parameters)
    assert params[:9] == ["q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata",
                          "num_splits", "softmax_scale", "causal"]
    # FlashMLA's newer interface goes on with these, in this order (sparse decode's arguments)
    assert params[9:16] == ["is_fp8_kvcache", "indices", "attn_sink", "extra_k_cache", "extra_indices_in_kvcache",
                            "topk_length", "extra_topk_length"]
    assert list(inspect.signature(fb.get_mla_metadata).parameters)[:3] == [
        "cache_seqlens", "num_q_tokens_per_head_k", "num_heads_k"]


def test_custom_ops_are_registered():
    assert hasattr(torch.ops.flashmla_backend, "mla_decode")
    assert hasattr(torch.ops.flashmla_backend, "get_mla_metadata")


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph(backend):
    """torch.compile traces through the public API without graph breaks (custom ops + fake impls)."""
    case = Case(lengths=[33, 100], s_q=2, h_q=8)
    inp = make_inputs(case)

    def step(q, k_cache, block_table, seqlens):
        meta, ns = fb.get_mla_metadata(seqlens, 16, 1)
        out, lse = fb.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, D_V, meta, ns,
                                             softmax_scale=inp.scale, causal=True)
        return out.float().sum(-1), lse

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    got = compiled(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens)
    want = step(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_opcheck():
    """torch.library.opcheck validates schema, fake impl and dispatch of the decode op."""
    case = Case(lengths=[70, 3], s_q=1, h_q=4)
    inp = make_inputs(case)
    meta, ns = fb.get_mla_metadata(inp.cache_seqlens, 4, 1)
    torch.library.opcheck(torch.ops.flashmla_backend.mla_decode.default,
                          (inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, meta, ns, inp.scale, True),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.flashmla_backend.get_mla_metadata.default, (inp.cache_seqlens, 8),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("device,exc,match", [
    ("nonsense", ValueError, r"device must be None, a torch.device, a device string .* got 'nonsense'"),
    ("cuda:x", ValueError, r"got 'cuda:x'"),
    (-1, ValueError, r"\(>= 0\), got -1"),
    (1.5, TypeError, r"device must be None, .* got float 1.5"),
    (True, TypeError, r"got bool True"),
    ([0], TypeError, r"got list \[0\]"),
], ids=repr)
def test_is_supported_refuses_what_is_not_a_device(device, exc, match):
    """A mistyped device is an error, not a reason to report (it used to answer with a GPU reason)."""
    with pytest.raises(exc, match=match):
        fb.is_supported(device)


@pytest.mark.parametrize("device", [None, "cpu", "cuda", "cuda:0", 0, torch.device("cpu"), torch.device("cuda", 0)],
                         ids=repr)
def test_is_supported_answers_for_every_device(device):
    ok, why = fb.is_supported(device)
    assert isinstance(ok, bool) and isinstance(why, str) and why
    if not torch.cuda.is_available():
        assert not ok and "no CUDA device" in why
