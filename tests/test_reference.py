"""The reference (flashmla_backend.reference) against brute-force fp64 attention, on the CPU; its NaN
convention and its argument checks."""
import dataclasses

import pytest
import torch

import flashmla_backend as fb
from flashmla_backend.reference import mla_decode_reference
from kit import D_K, D_V, PAGE, Case, brute_force_fp64, compare, make_inputs

CASES = [
    Case(lengths=[1], s_q=1, h_q=1),
    Case(lengths=[20, 0, 65], s_q=1, h_q=16, causal=False),
    Case(lengths=[PAGE - 1, PAGE, 140], s_q=2, h_q=8, h_kv=2),
    Case(lengths=[3, 130], s_q=4, h_q=3, causal=True),             # causal rows with no visible key (n=3 < s_q)
    Case(lengths=[0, 0], s_q=2, h_q=4),                            # all empty
    Case(lengths=[200, 5], s_q=16, h_q=2, causal=True, dtype=torch.float16),
    Case(lengths=[129], s_q=3, h_q=6, h_kv=3, causal=False, dtype=torch.float16),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_brute_force(case):
    inp = make_inputs(case)
    out, lse = mla_decode_reference(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, inp.scale,
                                    case.causal)
    assert out.dtype == case.dtype and lse.dtype == torch.float32
    ref_out, ref_lse = brute_force_fp64(inp, case.causal)
    compare(out, lse, ref_out, ref_lse, case.lengths, case.s_q, case.causal)


def test_reference_in_fp64_is_exact_to_brute_force():
    case = Case(lengths=[70, 1, 0], s_q=2, h_q=4, h_kv=2)
    inp = make_inputs(case)
    out, lse = mla_decode_reference(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, inp.scale, True,
                                    compute_dtype=torch.float64)
    ref_out, ref_lse = brute_force_fp64(inp, True)
    seen = torch.isfinite(ref_lse)
    assert torch.allclose(lse.double()[seen], ref_lse[seen], rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))


def test_brute_force_detects_a_wrong_scale():
    """The comparison must fail when the attention is wrong (a check that cannot fail proves nothing)."""
    case = Case(lengths=[100, 37], s_q=1, h_q=8)
    inp = make_inputs(case)
    out, lse = mla_decode_reference(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, inp.scale * 1.1,
                                    case.causal)
    ref_out, ref_lse = brute_force_fp64(inp, case.causal)
    with pytest.raises(AssertionError):
        compare(out, lse, ref_out, ref_lse, case.lengths, case.s_q, case.causal)


# ---- NaN rows (a NaN score is not an empty row) ------------------------------------------------------

def _nan_rows_case():
    case = Case(lengths=[100, 3, 0], s_q=4, h_q=8, h_kv=2, causal=True)
    inp = make_inputs(case)
    q = inp.q.clone()
    q[0, 1, 3, 7] = float("nan")      # one element: the whole row's scores are NaN
    q[1, 0, 5] = float("nan")         # request 1 (3 keys, s_q 4): token 0 sees no key, stays empty
    q[1, 3, 0, :] = float("nan")      # token 3 sees all 3 keys
    q[2, 2, 2] = float("nan")         # request 2 has no keys at all
    return case, inp, q


def test_nan_in_q_gives_nan_rows_not_empty_rows():
    case, inp, q = _nan_rows_case()
    out, lse = mla_decode_reference(q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, inp.scale, True)
    for (i, s, h) in [(0, 1, 3), (1, 3, 0)]:
        assert torch.isnan(out[i, s, h]).all(), (i, s, h, out[i, s, h, :4])
        assert torch.isnan(lse[i, h, s]), (i, s, h, lse[i, h, s])
    for (i, s, h) in [(1, 0, 5), (2, 2, 2)]:     # rows that see no key: out 0, lse +inf, NaN or not
        assert (out[i, s, h] == 0).all() and torch.isposinf(lse[i, h, s]), (i, s, h)
    # every other row is untouched by its neighbours' NaN
    nan_rows = torch.isnan(out).any(-1)
    assert int(nan_rows.sum()) == 2 and int(torch.isnan(lse).sum()) == 2
    clean = dataclasses.replace(inp, q=torch.where(torch.isnan(q), 0, q))
    ref_out, ref_lse = mla_decode_reference(clean.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, inp.scale,
                                            True)
    keep = ~nan_rows
    assert torch.equal(out[keep], ref_out[keep])
    assert torch.equal(lse[~torch.isnan(lse)], ref_lse[~torch.isnan(lse)])


def test_nan_in_q_on_the_public_cpu_path():
    case, inp, q = _nan_rows_case()
    meta, ns = fb.get_mla_metadata(inp.cache_seqlens, case.s_q * case.h_q // case.h_kv, case.h_kv)
    out, lse = fb.flash_mla_with_kvcache(q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, ns,
                                         softmax_scale=inp.scale, causal=True)
    assert torch.isnan(out[0, 1, 3]).all() and torch.isnan(lse[0, 3, 1])
    assert (out[1, 0, 5] == 0).all() and torch.isposinf(lse[1, 5, 0])


# ---- the reference checks its arguments like the public API ------------------------------------------

def _ref_args(case=None):
    case = case or Case(lengths=[70, 5], s_q=2, h_q=4)
    inp = make_inputs(case)
    return dict(q=inp.q, k_cache=inp.k_cache, block_table=inp.block_table, cache_seqlens=inp.cache_seqlens,
                head_dim_v=D_V, softmax_scale=inp.scale, causal=True)


@pytest.mark.parametrize("change,exc,match", [
    (lambda a: dict(block_table=_set(a["block_table"], (0, 0), -1)), ValueError,
     r"block_table\[0\] holds page ids outside \[0, \d+\).*-1"),
    (lambda a: dict(block_table=_set(a["block_table"], (1, 0), 10**6)), ValueError, r"block_table\[1\] holds page ids"),
    (lambda a: dict(cache_seqlens=torch.tensor([70, -1], dtype=torch.int32)), ValueError,
     r"cache_seqlens must be >= 0"),
    (lambda a: dict(cache_seqlens=torch.tensor([70, 1000], dtype=torch.int32)), ValueError,
     r"block_table is too short.*\(1, 1000\)"),
    (lambda a: dict(head_dim_v=128), ValueError, rf"head_dim_v must be {D_V}"),
    (lambda a: dict(q=a["q"][..., :D_V].contiguous()), ValueError, rf"q's last dimension must be {D_K}"),
    (lambda a: dict(q=a["q"][0]), ValueError, rf"q must be \[batch, seqlen_q, num_heads_q, {D_K}\]"),
    (lambda a: dict(q=a["q"].half()), TypeError, r"q and k_cache must have the same dtype"),
    (lambda a: dict(q=a["q"].int()), TypeError, r"q must have dtype .*torch.float32"),
    (lambda a: dict(k_cache=a["k_cache"].squeeze(2)), ValueError, r"k_cache must be \[num_pages, page_size"),
    (lambda a: dict(block_table=a["block_table"].long()), TypeError, r"block_table must have dtype torch.int32"),
    (lambda a: dict(block_table=a["block_table"][:1]), ValueError, r"block_table must be \[batch=2"),
    (lambda a: dict(cache_seqlens=a["cache_seqlens"][:1]), ValueError, r"cache_seqlens must be \[batch=2\]"),
    (lambda a: dict(softmax_scale=float("nan")), ValueError, r"softmax_scale must be a finite positive float"),
    (lambda a: dict(causal=1), TypeError, r"causal must be a bool"),
], ids=["negative page id", "page id too big", "negative length", "table too short", "head_dim_v", "q width",
        "q rank", "dtypes differ", "q int", "cache rank", "table dtype", "table batch", "seqlens batch", "scale nan",
        "causal int"])
def test_reference_checks_its_arguments(change, exc, match):
    a = _ref_args()
    with pytest.raises(exc, match=match):
        mla_decode_reference(**dict(a, **change(a)))


def _set(t, index, value):
    t = t.clone()
    t[index] = value
    return t


def test_reference_accepts_float32_and_float64():
    case = Case(lengths=[70, 5], s_q=2, h_q=4)
    inp = make_inputs(case)
    want_out, want_lse = brute_force_fp64(inp, True)
    for dtype in (torch.float32, torch.float64):
        out, lse = mla_decode_reference(inp.q.to(dtype), inp.k_cache.to(dtype), inp.block_table, inp.cache_seqlens,
                                        D_V, inp.scale, True)
        assert out.dtype == dtype
        compare(out, lse, want_out, want_lse, case.lengths, case.s_q, True)


def test_negative_page_id_used_to_read_the_last_page():
    """Without the checks, page id -1 silently indexes the last page; a request that uses it must be refused,
    an unused entry (past the request's pages) may hold anything."""
    a = _ref_args()
    bt = a["block_table"].clone()
    bt[1, 1:] = -1                       # request 1 (5 keys) uses only column 0
    mla_decode_reference(**dict(a, block_table=bt))
    bt[1, 0] = -1
    with pytest.raises(ValueError, match=r"block_table\[1\] holds page ids outside"):
        mla_decode_reference(**dict(a, block_table=bt))
