"""FlashMLA's newer calling convention: get_mla_metadata() -> FlashMLASchedMeta, num_splits=None.

The object is filled by the first flash_mla_with_kvcache call and reused after; every call is checked against
the configuration it was filled for. CPU tests run the reference path; GPU-marked ones the kernels.
"""
import pytest
import torch

import flashmla_backend as fb
from flashmla_backend import FlashMLASchedMeta
from kit import D_V, Case, make_inputs


def call(inp, meta, num_splits=None, causal=True, **kw):
    return fb.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, num_splits,
                                     softmax_scale=inp.scale, causal=causal, **kw)


def old_convention(inp, case):
    meta, ns = fb.get_mla_metadata(inp.cache_seqlens, case.s_q * case.h_q // case.h_kv, case.h_kv)
    return meta, ns


def test_no_arguments_give_an_empty_object():
    meta, none = fb.get_mla_metadata()
    assert isinstance(meta, FlashMLASchedMeta) and none is None
    assert not meta.have_initialized and meta.config is None and meta.tile_scheduler_metadata is None


@pytest.mark.parametrize("case", [Case(lengths=[70, 5, 0], s_q=2, h_q=16), Case(lengths=[300, 64], h_q=8, h_kv=2)],
                         ids=str)
def test_first_call_fills_later_calls_reuse_and_outputs_equal_the_old_convention(case):
    inp = make_inputs(case)
    meta, _ = fb.get_mla_metadata()
    out, lse = call(inp, meta)
    assert meta.have_initialized
    assert meta.config == FlashMLASchedMeta.Config(case.b, case.s_q, case.h_q, 64, case.h_kv, True, False, None)
    want_meta, want_splits = old_convention(inp, case)
    assert torch.equal(meta.tile_scheduler_metadata, want_meta) and torch.equal(meta.num_splits, want_splits)
    old_out, old_lse = call(inp, want_meta, want_splits)
    assert torch.equal(out, old_out) and torch.equal(lse, old_lse)
    tensors = (meta.tile_scheduler_metadata, meta.num_splits)
    out2, lse2 = call(inp, meta)                       # another layer of the same step
    assert meta.tile_scheduler_metadata is tensors[0] and meta.num_splits is tensors[1]
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


@pytest.mark.parametrize("change, field", [
    (dict(lengths=[70, 5, 9, 1]), "b 3 -> 4"),
    (dict(s_q=1), "s_q 2 -> 1"),
    (dict(h_q=32), "h_q 16 -> 32"),
    (dict(h_q=16, h_kv=2), "h_k 1 -> 2"),
    (dict(causal=False), "causal True -> False"),
])
def test_a_changed_call_is_refused_naming_what_changed(change, field):
    base = dict(lengths=[70, 5, 0], s_q=2, h_q=16, h_kv=1, causal=True)
    inp = make_inputs(Case(**base))
    meta, _ = fb.get_mla_metadata()
    call(inp, meta)
    other = dict(base, **change)
    causal = other.pop("causal")
    with pytest.raises(ValueError, match=f"filled by an earlier call with other arguments \\({field}"):
        call(make_inputs(Case(**other)), meta, causal=causal)


def test_num_splits_must_be_none_with_the_object():
    inp = make_inputs(Case(lengths=[70]))
    meta, _ = fb.get_mla_metadata()
    _, ns = old_convention(inp, Case(lengths=[70]))
    with pytest.raises(TypeError, match="num_splits must be None when tile_scheduler_metadata is a FlashMLASchedMeta"):
        call(inp, meta, ns)
    assert not meta.have_initialized


def test_bad_arguments_are_named_before_the_object_is_filled():
    inp = make_inputs(Case(lengths=[70]))
    meta, _ = fb.get_mla_metadata()
    with pytest.raises(ValueError, match="q's last dimension must be 576"):
        fb.flash_mla_with_kvcache(inp.q[..., :512], inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, None)
    assert not meta.have_initialized


def test_old_convention_unchanged_positionally():
    case = Case(lengths=[70, 5], h_q=16)
    inp = make_inputs(case)
    meta, ns = fb.get_mla_metadata(inp.cache_seqlens, case.s_q * case.h_q, 1)
    assert isinstance(meta, torch.Tensor) and isinstance(ns, torch.Tensor)
    with pytest.raises(ValueError, match="num_q_tokens_per_head_k"):
        fb.get_mla_metadata(inp.cache_seqlens)          # half of the old argument list is still an error


@pytest.mark.gpu
def test_graph_capture_with_a_filled_object_and_refusal_while_unfilled():
    case = Case(lengths=[3000, 0, 70, 4097], s_q=2, h_q=64)
    inp = make_inputs(case, "cuda")
    meta, _ = fb.get_mla_metadata()
    eager_out, eager_lse = call(inp, meta)            # fills the object
    old_out, old_lse = call(inp, *old_convention(inp, case))
    assert torch.equal(eager_out, old_out) and torch.equal(eager_lse, old_lse)
    arg_out, arg_lse = call(inp, old_convention(inp, case)[0], None)   # argument list, num_splits=None
    assert torch.equal(arg_out, old_out) and torch.equal(arg_lse, old_lse)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = call(inp, meta)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, eager_out) and torch.equal(g_lse, eager_lse)

    empty, _ = fb.get_mla_metadata()
    with pytest.raises(RuntimeError, match="being filled during CUDA-graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            call(inp, empty)
    assert not empty.have_initialized


def test_newer_convention_with_the_argument_list_and_num_splits_none():
    """FlashMLA's newer callers (vLLM's FLASHMLA backend among them) may still pass get_mla_metadata's argument
    list, keep only the first element and pass num_splits=None: same outputs as with both tensors."""
    case = Case(lengths=[70, 5, 0], s_q=2, h_q=16)
    inp = make_inputs(case)
    meta, ns = old_convention(inp, case)
    out, lse = call(inp, meta, None)
    want_out, want_lse = call(inp, meta, ns)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    other = make_inputs(Case(lengths=[70, 5, 0], s_q=1, h_q=16))
    with pytest.raises(ValueError, match="computed by get_mla_metadata for batch 3, num_q_tokens_per_head_k 32"):
        call(other, meta, None)
    with pytest.raises(TypeError, match="num_splits is None but tile_scheduler_metadata is a tensor"):
        call(inp, meta.clone(), None)


def test_a_malformed_q_on_reuse_is_named():
    inp = make_inputs(Case(lengths=[70]))
    meta, _ = fb.get_mla_metadata()
    call(inp, meta)
    with pytest.raises(ValueError, match="q must be"):
        fb.flash_mla_with_kvcache(inp.q[0], inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, None)
