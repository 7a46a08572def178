"""FP8 KV cache through the public API on CPU tensors (the reference path): both modes against an fp64
computation on the dequantized inputs, output dtypes, vLLM's FP8 entry point, the newer calling convention."""
import re

import pytest
import torch

import flashmla_backend as fb
from fp8kit import FP8, dequantized, fp8_inputs
from kit import D_V, Case, brute_force_fp64


def _meta(inp, case):
    return fb.get_mla_metadata(inp.cache_seqlens, case.s_q * case.h_q // case.h_kv, case.h_kv)


def _rel(a, b):
    m = torch.isfinite(b)
    return ((a.double()[m] - b[m]).norm() / b[m].norm()).item()


@pytest.mark.parametrize("q_dtype,q_fp8", [(torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True)])
def test_both_modes_match_fp64_on_the_dequantized_inputs(q_dtype, q_fp8):
    case = Case(lengths=[70, 0, 130], s_q=2, h_q=16, dtype=q_dtype)
    inp, dq, dk = fp8_inputs(case, q_fp8=q_fp8, k_gain=3.0)
    meta, splits = _meta(inp, case)
    out, lse = fb.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, splits,
                                         softmax_scale=inp.scale, causal=True, descale_q=dq, descale_k=dk)
    assert out.dtype == (torch.bfloat16 if q_fp8 else q_dtype) and lse.dtype == torch.float32
    ref_out, ref_lse = brute_force_fp64(dequantized(inp, dq, dk), causal=True)
    assert _rel(out, ref_out) < 1e-2
    assert _rel(lse, ref_lse) < 2e-3
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))  # the empty request: out 0, lse +inf


def test_descale_k_scales_the_values():
    case = Case(lengths=[100], h_q=16)
    inp, _, dk = fp8_inputs(case)
    meta, splits = _meta(inp, case)
    args = (inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, splits)
    out1, _ = fb.flash_mla_with_kvcache(*args, softmax_scale=inp.scale, descale_k=dk)
    out2, _ = fb.flash_mla_with_kvcache(*args, softmax_scale=inp.scale, descale_k=dk * 2)
    assert not torch.equal(out1, out2)
    ref, _ = brute_force_fp64(dequantized(inp, None, dk * 2), causal=False)
    assert _rel(out2, ref) < 1e-2


def test_vllm_fp8_entry_point_matches():
    case = Case(lengths=[64, 200], s_q=1, h_q=16)
    inp, dq, dk = fp8_inputs(case, q_fp8=True)
    meta, splits = _meta(inp, case)
    a = fb.flash_mla_with_kvcache_fp8(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, splits,
                                      inp.scale, True, dq, dk)
    b = fb.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, splits,
                                  softmax_scale=inp.scale, causal=True, descale_q=dq, descale_k=dk)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_vllm_fp8_entry_point_refuses_a_16_bit_cache():
    """Without this check a bf16 cache and no descales would quietly run the 16-bit path."""
    case = Case(lengths=[64, 200], s_q=1, h_q=16)
    inp, _, dk = fp8_inputs(case)
    meta, splits = _meta(inp, case)
    message = r"flash_mla_with_kvcache_fp8 needs k_cache of dtype torch.float8_e4m3fn .*got k_cache torch.bfloat16"
    for q in (inp.q, inp.q.to(FP8)):
        with pytest.raises(TypeError, match=message):
            fb.flash_mla_with_kvcache_fp8(q, inp.k_cache.to(torch.bfloat16), inp.block_table, inp.cache_seqlens, D_V,
                                          meta, splits, inp.scale, True)
    with pytest.raises(TypeError, match=r"needs k_cache of dtype torch.float8_e4m3fn .*got k_cache list"):
        fb.flash_mla_with_kvcache_fp8(inp.q, [], inp.block_table, inp.cache_seqlens, D_V, meta, splits)


def test_sched_meta_records_the_cache_format():
    case = Case(lengths=[64, 200], h_q=16)
    inp, _, dk = fp8_inputs(case)
    sched, none = fb.get_mla_metadata()
    fb.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, sched, none,
                              descale_k=dk)
    with pytest.raises(ValueError, match="is_fp8_kvcache"):
        fb.flash_mla_with_kvcache(inp.q, inp.k_cache.to(torch.bfloat16), inp.block_table, inp.cache_seqlens, D_V,
                                  sched, None)


def test_reference_takes_descales():
    case = Case(lengths=[64], h_q=16)
    inp, _, dk = fp8_inputs(case)
    out, _ = fb.mla_decode_reference(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, inp.scale,
                                     descale_k=dk)
    ref, _ = brute_force_fp64(dequantized(inp, None, dk), causal=False)
    assert out.dtype == torch.bfloat16 and _rel(out, ref) < 1e-2
    with pytest.raises(ValueError, match="needs descale_k"):
        fb.mla_decode_reference(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, inp.scale)


BAD_DESCALES = [0.0, -0.0, -0.5, float("nan"), float("inf"), -float("inf")]


def _bad_descale_case(name, value):
    case = Case(lengths=[64, 10], h_q=16)
    inp, dq, dk = fp8_inputs(case, q_fp8=True)
    meta, splits = _meta(inp, case)
    descales = dict(descale_q=dq, descale_k=dk)
    descales[name] = torch.full((1,), value)
    message = re.escape(f"{name} must be finite and positive (true value = stored value x {name}), got {value!r}")
    return inp, meta, splits, descales, message


@pytest.mark.parametrize("value", BAD_DESCALES, ids=repr)
@pytest.mark.parametrize("name", ["descale_k", "descale_q"])
def test_descale_values_must_be_finite_and_positive(name, value):
    """A zero, negative or non-finite descale is refused on CPU tensors (it would give zeros, garbage or NaN)."""
    inp, meta, splits, descales, message = _bad_descale_case(name, value)
    args = (inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V)
    with pytest.raises(ValueError, match=message):
        fb.flash_mla_with_kvcache(*args, meta, splits, softmax_scale=inp.scale, causal=True, **descales)
    with pytest.raises(ValueError, match=message):
        fb.flash_mla_with_kvcache_fp8(*args, meta, splits, inp.scale, True, descales["descale_q"],
                                      descales["descale_k"])
    with pytest.raises(ValueError, match=message):
        fb.mla_decode_reference(*args, inp.scale, True, **descales)
    sched, none = fb.get_mla_metadata()
    with pytest.raises(ValueError, match=message):
        fb.flash_mla_with_kvcache(*args, sched, none, softmax_scale=inp.scale, causal=True, **descales)


def test_descale_value_in_a_zero_dim_tensor_is_read():
    inp, meta, splits, descales, message = _bad_descale_case("descale_k", 0.0)
    descales["descale_k"] = torch.tensor(0.0)
    with pytest.raises(ValueError, match=message):
        fb.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, splits,
                                  softmax_scale=inp.scale, causal=True, **descales)


# ---- descales per (request, KV head): [b, h_kv] tensors, any strides ---------------------------------------------
from fp8kit import descale_table  # noqa: E402


@pytest.mark.parametrize("h_kv", [1, 2])
@pytest.mark.parametrize("q_fp8", [False, True], ids=["accurate", "fast"])
def test_per_request_descales_match_fp64(h_kv, q_fp8):
    """Each request's keys (and, fast mode, its query heads) read with the scale of its (request, KV head): the
    reference against fp64 attention on inputs dequantized per request and head (fp8kit.dequantized)."""
    case = Case(lengths=[70, 0, 130, 5], s_q=2, h_q=16, h_kv=h_kv)
    inp, dq, dk = fp8_inputs(case, q_fp8=q_fp8, k_gain=2.0)
    dk = descale_table(dk, case.b, h_kv, seed=1)
    dq = descale_table(dq, case.b, h_kv, seed=2) if q_fp8 else None
    assert len(set(dk.flatten().tolist())) == dk.numel()  # every (request, head) its own scale
    meta, splits = _meta(inp, case)
    out, lse = fb.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, splits,
                                         softmax_scale=inp.scale, causal=True, descale_q=dq, descale_k=dk)
    ref_out, ref_lse = brute_force_fp64(dequantized(inp, dq, dk), causal=True)
    assert _rel(out, ref_out) < 1e-2
    assert _rel(lse, ref_lse) < 2e-3
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    # The per-tensor result with request i's scale is request i's result (h_kv = 1: one scale per request).
    if h_kv == 1:
        for i in (0, 2):
            one_k = dk[i].reshape(1).contiguous()
            one_q = dq[i].reshape(1).contiguous() if q_fp8 else None
            o_i, l_i = fb.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta,
                                                 splits, softmax_scale=inp.scale, causal=True, descale_q=one_q,
                                                 descale_k=one_k)
            assert torch.equal(o_i[i], out[i]) and torch.equal(l_i[i], lse[i])


def test_expanded_descales_equal_the_per_tensor_ones():
    """scale.expand(b, h_kv) (strides 0, 0; how vLLM's FA3 path passes its scales) reads like the one value."""
    case = Case(lengths=[64, 200, 0], s_q=1, h_q=32, h_kv=2)
    inp, dq, dk = fp8_inputs(case, q_fp8=True)
    meta, splits = _meta(inp, case)
    args = (inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, splits)
    one = fb.flash_mla_with_kvcache(*args, softmax_scale=inp.scale, causal=True, descale_q=dq, descale_k=dk)
    expanded = fb.flash_mla_with_kvcache(*args, softmax_scale=inp.scale, causal=True,
                                         descale_q=dq.expand(case.b, 2), descale_k=dk.expand(case.b, 2))
    assert dk.expand(case.b, 2).stride() == (0, 0)
    assert torch.equal(one[0], expanded[0]) and torch.equal(one[1], expanded[1])


def test_descale_tables_through_every_entry_point():
    """flash_mla_with_kvcache_fp8 (vLLM's argument order), the FlashMLASchedMeta convention and the reference take
    [b, h_kv] descales as they take one-element ones, with the same results."""
    case = Case(lengths=[64, 200], s_q=2, h_q=16)
    inp, dq, dk = fp8_inputs(case, q_fp8=True)
    dq, dk = descale_table(dq, case.b, 1, seed=3), descale_table(dk, case.b, 1, seed=4)
    meta, splits = _meta(inp, case)
    args = (inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V)
    want = fb.flash_mla_with_kvcache(*args, meta, splits, softmax_scale=inp.scale, causal=True, descale_q=dq,
                                     descale_k=dk)
    got = [fb.flash_mla_with_kvcache_fp8(*args, meta, splits, inp.scale, True, dq, dk),
           fb.flash_mla_with_kvcache(*args, fb.get_mla_metadata()[0], None, softmax_scale=inp.scale, causal=True,
                                     descale_q=dq, descale_k=dk),
           fb.mla_decode_reference(*args, inp.scale, True, descale_q=dq, descale_k=dk)]
    for out, lse in got:
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


def test_a_bad_entry_of_a_descale_table_is_named():
    case = Case(lengths=[64, 10], h_q=16, h_kv=2)
    inp, _, dk = fp8_inputs(case)
    meta, splits = _meta(inp, case)
    table = descale_table(dk, case.b, 2).clone()
    table[1, 0] = 0.0
    message = re.escape("descale_k must be finite and positive (true value = stored value x descale_k), got 0.0 at "
                        "[request 1, kv head 0]")
    with pytest.raises(ValueError, match=message):
        fb.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, splits,
                                  softmax_scale=inp.scale, descale_k=table)
