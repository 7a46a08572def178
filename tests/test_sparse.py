"""Sparse decode (DeepSeek-V3.2's attention over the tokens indices name) on CPU tensors: the reference against the kit's
fp64 oracle, what skipped entries, topk_length and attn_sink do, that no unnamed slot leaks, and the public API's
FlashMLA calling convention (a FlashMLASchedMeta, block_table and cache_seqlens None)."""
import dataclasses
import math

import pytest
import torch

import flashmla_backend as fb
from flashmla_backend import FlashMLASchedMeta, fp8_ds_mla
from flashmla_backend.reference import sparse_mla_decode_reference
from kit import D_K, D_V, compare
from sparsekit import INT32_MAX, SparseCase, make_sparse_inputs, naive_sparse_fp64, unpoisoned

CASES = [
    SparseCase(),
    SparseCase(b=3, s_q=2, h_q=8, topk=40, page_size=64, num_pages=3, topk_length=[40, 17, 1], sink=True, seed=1),
    SparseCase(b=2, s_q=4, h_q=4, topk=24, page_size=1, num_pages=90, ds_dtype=torch.float8_e4m3fn, seed=2),
    SparseCase(b=2, s_q=3, h_q=3, topk=30, page_size=17, num_pages=5, ds_dtype=torch.int8, sink=True, seed=3),
    SparseCase(b=1, s_q=1, h_q=128, topk=128, page_size=64, num_pages=4, topk_length=[100], sink=True, seed=4),
    SparseCase(b=2, s_q=2, h_q=64, topk=64, num_pages=4, skipped=0.6, seed=5),
    SparseCase(b=3, s_q=2, h_q=16, topk=48, num_pages=3, cache="bf16", topk_length=[48, 0, 20], sink=True, seed=6),
    SparseCase(b=2, s_q=1, h_q=5, topk=20, page_size=16, num_pages=4, cache="fp16", seed=7),
]


def reference(inp, **kw):
    return sparse_mla_decode_reference(inp.q, inp.k_cache, inp.indices, inp.scale, inp.topk_length, inp.attn_sink, **kw)


def api(inp, meta=None, **kw):
    meta = meta if meta is not None else fb.get_mla_metadata()[0]
    args = dict(softmax_scale=inp.scale, causal=False, is_fp8_kvcache=inp.ds, indices=inp.indices,
                topk_length=inp.topk_length, attn_sink=inp.attn_sink)
    args.update(kw)
    return fb.flash_mla_with_kvcache(inp.q, inp.k_cache, None, None, D_V, meta, None, **args)


def check(out, lse, inp):
    ref_out, ref_lse = naive_sparse_fp64(inp)
    return compare(out, lse, ref_out, ref_lse, [], inp.q.shape[1], False)


# ---- the reference against the oracle ---------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_the_fp64_oracle(case):
    inp = make_sparse_inputs(case)
    out, lse = reference(inp)
    assert out.shape == (case.b, case.s_q, case.h_q, D_V) and out.dtype == inp.q.dtype
    assert lse.shape == (case.b, case.h_q, case.s_q) and lse.dtype == torch.float32
    check(out, lse, inp)


@pytest.mark.parametrize("case", [CASES[1], CASES[6]], ids=str)
def test_reference_in_fp64_equals_the_oracle(case):
    """With a float64 q and float64 arithmetic the only differences left are summation orders."""
    inp = make_sparse_inputs(case)
    inp = inp.replace(q=inp.q.double()) if inp.ds else inp.replace(q=inp.q.double(), k_cache=inp.k_cache.double())
    out, lse = reference(inp, compute_dtype=torch.float64)
    ref_out, ref_lse = naive_sparse_fp64(inp)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    seen = torch.isfinite(ref_lse)
    assert torch.allclose(lse.double()[seen], ref_lse[seen], rtol=1e-6, atol=1e-6)   # lse is float32
    assert torch.allclose(out, ref_out, rtol=1e-10, atol=1e-12)


def test_the_comparison_fails_on_wrong_answers():
    """A check that cannot fail proves nothing: a wrong softmax scale, and group scales read from the wrong group
    (the cache's scale bytes rotated), both fail against the oracle."""
    inp = make_sparse_inputs(CASES[0])
    with pytest.raises(AssertionError):
        check(*reference(inp.replace(scale=inp.scale * 1.1)), inp)
    raw = inp.k_cache.view(torch.uint8).clone()
    raw[..., 512:528] = torch.roll(raw[..., 512:528], 4, dims=-1)       # scale g now read for group g + 1
    with pytest.raises(AssertionError):
        check(*reference(inp.replace(k_cache=raw.view(inp.k_cache.dtype))), inp)


# ---- skipped entries, topk_length, empty rows, poison -------------------------------------------------------------

def _as_minus_one(inp):
    """The same inputs with every entry that does not count (skipped, or past topk_length) set to -1."""
    total = inp.k_cache.shape[0] * inp.k_cache.shape[1]
    idx = inp.indices.clone()
    idx[(idx < 0) | (idx >= total)] = -1
    if inp.topk_length is not None:
        for i, n in enumerate(inp.topk_length.tolist()):
            idx[i, :, n:] = -1
    return inp.replace(indices=idx, topk_length=None)


@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[6]], ids=str)
def test_entries_that_do_not_count_equal_minus_one(case):
    """An entry past the cache (num_pages * page_size, INT32_MAX), another negative one (-7, INT32_MIN), and an entry
    past topk_length: each gives exactly what -1 gives (bitwise)."""
    inp = make_sparse_inputs(case)
    total = inp.k_cache.shape[0] * inp.k_cache.shape[1]
    kinds = set(inp.indices[(inp.indices < 0) | (inp.indices >= total)].tolist())
    assert {-1, total, INT32_MAX, -7} <= kinds or case.topk < 30, kinds   # the generator made them all
    out, lse = reference(inp)
    want_out, want_lse = reference(_as_minus_one(inp))
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("cache", ["fp8_ds_mla", "bf16"])
def test_rows_without_keys_get_zero_and_plus_inf(cache):
    """All -1, all past the cache, topk_length 0: out 0 and lse +inf, with or without a sink; other rows as usual."""
    case = SparseCase(b=3, s_q=2, h_q=4, topk=16, num_pages=2, cache=cache, topk_length=[16, 0, 16], sink=True,
                      skipped=0.0, seed=8)
    inp = make_sparse_inputs(case)
    idx = inp.indices.clone()
    idx[0, 1] = -1                                       # request 0, token 1: every entry -1
    idx[2, 0] = torch.arange(16) + 2 * 64                # request 2, token 0: every entry just past the cache
    inp = inp.replace(indices=idx)
    out, lse = reference(inp)
    empty = {(0, 1), (1, 0), (1, 1), (2, 0)}
    for i in range(3):
        for s in range(2):
            if (i, s) in empty:
                assert bool((out[i, s] == 0).all()) and bool(torch.isposinf(lse[i, :, s]).all()), (i, s)
            else:
                assert bool(torch.isfinite(lse[i, :, s]).all()) and bool(out[i, s].abs().sum() > 0), (i, s)
    check(out, lse, inp)


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[6], CASES[7]], ids=str)
def test_unnamed_slots_never_reach_the_output(case):
    """Every slot that no counted entry names holds NaN (the generator's poison); the same inputs with zeros or
    large finite values there give bitwise the same output, with no NaN anywhere."""
    inp = make_sparse_inputs(case)
    out, lse = reference(inp)
    assert not bool(torch.isnan(out).any()) and not bool(torch.isnan(lse).any())
    for fill in (0.0, 1000.0):
        clean_out, clean_lse = reference(unpoisoned(inp, fill))
        assert torch.equal(out, clean_out) and torch.equal(lse, clean_lse)


def test_a_token_named_twice_counts_twice():
    inp = make_sparse_inputs(SparseCase(b=1, s_q=1, h_q=2, topk=3, num_pages=1, cache="bf16", skipped=0.0, seed=9))
    a, b = inp.indices[0, 0, :2].tolist()
    once, _ = reference(inp.replace(indices=torch.tensor([[[a, b, -1]]], dtype=torch.int32)))
    twice, twice_lse = reference(inp.replace(indices=torch.tensor([[[a, a, b]]], dtype=torch.int32)))
    assert not torch.equal(once, twice)
    check(twice, twice_lse, inp.replace(indices=torch.tensor([[[a, a, b]]], dtype=torch.int32)))


# ---- attn_sink ----------------------------------------------------------------------------------------------------

def test_attn_sink_scales_the_output_and_leaves_lse():
    """out x exp(lse) / (exp(lse) + exp(sink)) per head; lse bitwise as without a sink; -inf changes nothing
    (bitwise), +inf gives 0."""
    case = dataclasses.replace(CASES[1], sink=False)
    inp = make_sparse_inputs(case)
    inp = inp.replace(q=inp.q.double())                    # float64 out: the factor is compared closely
    plain_out, plain_lse = reference(inp, compute_dtype=torch.float64)
    sink = torch.tensor([-math.inf, math.inf, 0.0, 2.5, -3.0, 40.0, -40.0, float(plain_lse[0, 7, 0])])
    out, lse = reference(inp.replace(attn_sink=sink), compute_dtype=torch.float64)
    assert torch.equal(lse, plain_lse)
    assert torch.equal(out[..., 0, :], plain_out[..., 0, :])                   # sink -inf
    assert bool((out[..., 1, :] == 0).all())                                  # sink +inf
    factor = torch.sigmoid(plain_lse.double().permute(0, 2, 1) - sink.double())   # [b, s_q, h_q]
    factor = torch.where(torch.isposinf(plain_lse.permute(0, 2, 1)), 0.0, factor)
    assert torch.allclose(out, plain_out * factor[..., None], rtol=1e-6, atol=1e-12)   # lse came back as float32
    assert abs(float(out[0, 0, 7].norm() / plain_out[0, 0, 7].norm()) - 0.5) < 1e-6   # sink = lse: half
    check(*reference(inp.replace(q=inp.q.bfloat16(), attn_sink=sink)), inp.replace(q=inp.q.bfloat16(), attn_sink=sink))


# ---- NaN in q -----------------------------------------------------------------------------------------------------

def test_nan_in_q_gives_nan_rows_not_empty_rows():
    case = SparseCase(b=2, s_q=2, h_q=4, topk=16, num_pages=2, cache="bf16", topk_length=[16, 0], seed=10)
    inp = make_sparse_inputs(case)
    q = inp.q.clone()
    q[0, 1, 2, 7] = float("nan")      # a row with keys: NaN out and lse
    q[1, 0, 1, 3] = float("nan")      # request 1 counts no entry: stays the empty row
    out, lse = reference(inp.replace(q=q))
    assert bool(torch.isnan(out[0, 1, 2]).all()) and bool(torch.isnan(lse[0, 2, 1]))
    assert bool((out[1] == 0).all()) and bool(torch.isposinf(lse[1]).all())
    clean_out, clean_lse = reference(inp)
    keep = torch.ones_like(out, dtype=torch.bool)
    keep[0, 1, 2] = False
    assert torch.equal(out[keep], clean_out[keep])


# ---- the public API on CPU tensors --------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[6]], ids=str)
def test_flashmla_calling_convention_runs_the_reference(case):
    inp = make_sparse_inputs(case)
    meta, none = fb.get_mla_metadata()
    assert none is None
    out, lse = fb.flash_mla_with_kvcache(inp.q, inp.k_cache, None, None, 512, meta, None, softmax_scale=inp.scale,
                                         causal=False, is_fp8_kvcache=inp.ds, indices=inp.indices,
                                         topk_length=inp.topk_length, attn_sink=inp.attn_sink)
    want_out, want_lse = reference(inp)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    check(out, lse, inp)
    assert meta.have_initialized and meta.tile_scheduler_metadata is None and meta.num_splits is None
    assert meta.config == FlashMLASchedMeta.Config(case.b, case.s_q, case.h_q, case.page_size, 1, False, inp.ds,
                                                   case.topk)
    again = api(inp, meta)                                  # another layer of the step
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


def test_default_scale_is_head_dim_k():
    inp = make_sparse_inputs(CASES[0])
    out, lse = api(inp, softmax_scale=None)
    want = api(inp, softmax_scale=D_K ** -0.5)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


def test_block_table_and_cache_seqlens_are_not_read():
    """FlashMLA's sparse decode ignores them (older callers pass placeholders): any tensors give the same result."""
    inp = make_sparse_inputs(CASES[0])
    want = api(inp)
    got = fb.flash_mla_with_kvcache(inp.q, inp.k_cache, torch.full((2, 1), -5, dtype=torch.int32),
                                    torch.zeros(7, dtype=torch.int64), 512, fb.get_mla_metadata()[0], None,
                                    softmax_scale=inp.scale, is_fp8_kvcache=True, indices=inp.indices)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("change, field", [
    (dict(topk=32), "topk 64 -> 32"),
    (dict(h_q=8), "h_q 16 -> 8"),
    (dict(b=3), "b 2 -> 3"),
    (dict(page_size=32, num_pages=12), "page_block_size 64 -> 32"),
    (dict(cache="bf16"), "is_fp8_kvcache True -> False"),
], ids=str)
def test_a_changed_call_is_refused_naming_what_changed(change, field):
    meta, _ = fb.get_mla_metadata()
    api(make_sparse_inputs(SparseCase()), meta)
    with pytest.raises(ValueError, match=rf"filled by an earlier call with other arguments \({field}"):
        api(make_sparse_inputs(SparseCase(**change)), meta)


def test_dense_and_sparse_calls_do_not_share_an_object():
    from kit import Case, make_inputs

    dense = make_inputs(Case(lengths=[70, 5], h_q=16, causal=False))
    sparse = make_sparse_inputs(SparseCase())
    meta, _ = fb.get_mla_metadata()
    fb.flash_mla_with_kvcache(dense.q, dense.k_cache, dense.block_table, dense.cache_seqlens, D_V, meta, None)
    with pytest.raises(ValueError, match=r"other arguments \(.*topk None -> 64"):
        api(sparse, meta)
    meta, _ = fb.get_mla_metadata()
    api(sparse, meta)
    with pytest.raises(ValueError, match=r"other arguments \(.*topk 64 -> None"):
        fb.flash_mla_with_kvcache(dense.q, dense.k_cache, dense.block_table, dense.cache_seqlens, D_V, meta, None)


# ---- fill_sparse_sched_meta: the schedule made ahead of the first call (engines' metadata builders) --------------

def filled_for(case, inp, **kw):
    args = dict(batch=case.b, s_q=case.s_q, num_heads_q=case.h_q, topk=case.topk, device="cpu",
                is_fp8_kvcache=inp.ds, page_block_size=case.page_size)
    args.update(kw)
    return fb.fill_sparse_sched_meta(fb.get_mla_metadata()[0], **args)


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[6]], ids=str)
def test_a_filled_object_serves_the_calls_it_was_filled_for(case):
    inp = make_sparse_inputs(case)
    meta = filled_for(case, inp)
    assert meta.have_initialized and meta.tile_scheduler_metadata is None  # on CPU: the configuration only
    out, lse = api(inp, meta)
    want = api(inp)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert meta.config == FlashMLASchedMeta.Config(case.b, case.s_q, case.h_q, case.page_size, 1, False, inp.ds,
                                                   case.topk)


@pytest.mark.parametrize("fill, field", [
    (dict(topk=40), "topk 40 -> 64"),
    (dict(s_q=2), "s_q 2 -> 1"),
    (dict(num_heads_q=32), "h_q 32 -> 16"),
    (dict(is_fp8_kvcache=False), "is_fp8_kvcache False -> True"),
    (dict(page_block_size=32), "page_block_size 32 -> 64"),
], ids=str)
def test_a_call_unlike_the_fill_is_refused_naming_the_field(fill, field):
    case = SparseCase()
    inp = make_sparse_inputs(case)
    meta = filled_for(case, inp, **fill)
    with pytest.raises(ValueError, match=rf"filled by an earlier call with other arguments \(.*{field}"):
        api(inp, meta)


@pytest.mark.parametrize("kw, message", [
    (dict(batch=-1), r"batch must be an int >= 0, got -1"),
    (dict(s_q=0), r"s_q must be an int >= 1, got 0"),
    (dict(topk=2.0), r"topk must be an int >= 1, got 2.0"),
    (dict(num_heads_q=True), r"num_heads_q must be an int >= 1, got True"),
    (dict(num_heads_k=2), r"one latent KV head, got num_heads_k 2"),
], ids=str)
def test_fill_refuses_bad_arguments_naming_them(kw, message):
    args = dict(batch=2, s_q=1, num_heads_q=16, topk=64, device="cpu")
    args.update(kw)
    with pytest.raises(ValueError, match=message):
        fb.fill_sparse_sched_meta(fb.get_mla_metadata()[0], **args)


def test_fill_takes_only_an_empty_sched_meta():
    case = SparseCase()
    inp = make_sparse_inputs(case)
    meta = filled_for(case, inp)
    with pytest.raises(ValueError, match="takes an empty FlashMLASchedMeta; this one was filled already"):
        fb.fill_sparse_sched_meta(meta, batch=2, s_q=1, num_heads_q=16, topk=64, device="cpu")
    with pytest.raises(TypeError, match="takes a FlashMLASchedMeta"):
        fb.fill_sparse_sched_meta(torch.zeros(4), batch=2, s_q=1, num_heads_q=16, topk=64, device="cpu")


def test_a_refused_call_leaves_the_object_empty():
    inp = make_sparse_inputs(SparseCase(topk_length=[64, 3]))
    meta, _ = fb.get_mla_metadata()
    with pytest.raises(ValueError, match=r"topk_length must be in \[0, topk=64\]"):
        api(inp, meta, topk_length=torch.tensor([65, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"causal must be False"):
        api(inp, meta, causal=True)
    assert not meta.have_initialized and meta.config is None


def test_value_errors_name_the_entries():
    inp = make_sparse_inputs(SparseCase(h_q=4))
    with pytest.raises(ValueError, match=r"topk_length must be in \[0, topk=64\] \(topk: dimension 2 of indices\), "
                                         r"got \(index, value\) \[\(0, -1\), \(1, 65\)\]"):
        api(inp, topk_length=torch.tensor([-1, 65], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"attn_sink must not be NaN .* got NaN at heads \[1, 3\]"):
        api(inp, attn_sink=torch.tensor([0.0, math.nan, math.inf, math.nan]))
    with pytest.raises(ValueError, match=r"topk_length must be in \[0, topk=64\]"):
        sparse_mla_decode_reference(inp.q, inp.k_cache, inp.indices, topk_length=torch.tensor([0, 99],
                                                                                              dtype=torch.int32))


def test_empty_batch():
    inp = make_sparse_inputs(SparseCase(b=1))
    out, lse = api(inp.replace(q=inp.q[:0], indices=inp.indices[:0]))
    assert out.shape == (0, 1, 16, D_V) and lse.shape == (0, 16, 1)


def test_the_old_metadata_convention_is_refused_for_sparse_decode():
    inp = make_sparse_inputs(SparseCase())
    with pytest.raises(NotImplementedError, match=r"topk .* is not supported: sparse decode takes the "
                                                  r"FlashMLASchedMeta of get_mla_metadata\(\) without arguments"):
        fb.get_mla_metadata(torch.full((2,), 64, dtype=torch.int32), 16, 1, 16, True, 64)
    dense_meta, splits = fb.get_mla_metadata(torch.full((2,), 64, dtype=torch.int32), 16, 1)
    with pytest.raises(TypeError, match=r"tile_scheduler_metadata must be the FlashMLASchedMeta of get_mla_metadata\(\)"):
        fb.flash_mla_with_kvcache(inp.q, inp.k_cache, None, None, D_V, dense_meta, splits, is_fp8_kvcache=True,
                                  indices=inp.indices)


# ---- a 16-bit cache through the dense decode (ops._sparse_decode_gathered; on CUDA tensors the dense kernels) ----

GATHERED_CASES = [
    SparseCase(b=3, s_q=2, h_q=16, topk=48, num_pages=3, cache="bf16", topk_length=[48, 0, 20], sink=True, seed=30),
    SparseCase(b=2, s_q=1, h_q=5, topk=20, page_size=16, num_pages=4, cache="fp16", seed=31),
    SparseCase(b=2, s_q=3, h_q=64, topk=130, page_size=1, num_pages=300, cache="bf16", skipped=0.5, seed=32),
    SparseCase(b=1, s_q=2, h_q=8, topk=64, num_pages=2, cache="bf16", skipped=1.0, seed=33),   # every row empty
    SparseCase(b=2, s_q=1, h_q=128, topk=200, page_size=17, num_pages=30, cache="fp16", topk_length=[150, 199],
               sink=True, seed=34),
]


def gathered(inp):
    """The mapping the CUDA path runs, here on CPU tensors: the dense decode of the gathered tokens is the dense
    reference then."""
    from flashmla_backend import ops
    return ops._sparse_decode_gathered(inp.q, inp.k_cache, inp.scale, inp.indices, inp.topk_length, inp.attn_sink)


@pytest.mark.parametrize("case", GATHERED_CASES, ids=str)
def test_the_gathered_dense_decode_matches_the_fp64_oracle(case):
    """Skipped entries of every kind, topk_length (0 included), duplicates, NaN in every unnamed slot, pages of 1 and
    17 tokens, top-k not a multiple of the scratch cache's 64-token pages, attn_sink."""
    inp = make_sparse_inputs(case)
    out, lse = gathered(inp)
    assert out.shape == (case.b, case.s_q, case.h_q, D_V) and out.dtype == inp.q.dtype
    assert lse.shape == (case.b, case.h_q, case.s_q) and lse.dtype == torch.float32 and lse.is_contiguous()
    check(out, lse, inp)
    want = reference(inp)
    assert torch.allclose(lse, want[1], rtol=0, atol=1e-5)  # the same float32 sums in another order


def test_the_gathered_decode_in_chunks_equals_one_call(monkeypatch):
    """Rows split over several dense calls (GATHER_CHUNK_BYTES) give the same bits: each row is its own request."""
    from flashmla_backend import ops
    inp = make_sparse_inputs(GATHERED_CASES[0])
    whole = gathered(inp)
    monkeypatch.setattr(ops, "GATHER_CHUNK_BYTES", 1)   # one row a call
    calls = []
    dense = ops.flash_mla_with_kvcache
    monkeypatch.setattr(ops, "flash_mla_with_kvcache", lambda *a, **k: calls.append(a[0].shape[0]) or dense(*a, **k))
    chunked = gathered(inp)
    assert calls == [1] * (inp.q.shape[0] * inp.q.shape[1])
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


def test_the_gathered_decode_splits_rows_into_equal_chunks(monkeypatch):
    """Six rows with room for four a chunk go as two calls of three (not four and two), with the same bits."""
    from flashmla_backend import ops
    inp = make_sparse_inputs(GATHERED_CASES[0])
    whole = gathered(inp)
    row_bytes = 64 * D_K * inp.k_cache.element_size()   # top-k 48: one 64-token scratch page a row
    monkeypatch.setattr(ops, "GATHER_CHUNK_BYTES", 4 * row_bytes)
    calls = []
    dense = ops.flash_mla_with_kvcache
    monkeypatch.setattr(ops, "flash_mla_with_kvcache", lambda *a, **k: calls.append(a[0].shape[0]) or dense(*a, **k))
    chunked = gathered(inp)
    assert calls == [3, 3]
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


def test_the_gathered_decode_reads_no_skipped_entry(monkeypatch):
    """The scratch cache holds a row's counted tokens first, in index order; its length is their count."""
    from flashmla_backend import ops
    case = SparseCase(b=1, s_q=1, h_q=4, topk=6, page_size=4, num_pages=3, cache="bf16", skipped=0.0, seed=35)
    inp = make_sparse_inputs(case)
    inp = inp.replace(indices=torch.tensor([[[5, -1, 11, 12, 2, 7]]], dtype=torch.int32),
                      topk_length=torch.tensor([5], dtype=torch.int32))
    seen = {}
    dense = ops.flash_mla_with_kvcache

    def spy(q, k_cache, block_table, cache_seqlens, *a, **k):
        seen["lens"] = cache_seqlens.tolist()
        seen["tokens"] = k_cache.reshape(-1, D_K)[: int(cache_seqlens[0])].clone()
        return dense(q, k_cache, block_table, cache_seqlens, *a, **k)

    monkeypatch.setattr(ops, "flash_mla_with_kvcache", spy)
    gathered(inp)
    flat = inp.k_cache.reshape(-1, D_K)
    # -1 skipped, 12 past the 12-token cache, 7 past topk_length 5: tokens 5, 11, 2 in that order
    assert seen["lens"] == [3]
    assert torch.equal(seen["tokens"].view(torch.int16), flat[[5, 11, 2]].view(torch.int16))


@pytest.mark.parametrize("layout", ["contiguous", "two_layers_a_row", "odd_row_stride", "every_other_page"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_token_gather_copies_the_named_rows_of_every_layout(layout, dtype):
    """ops._gather_tokens: word copies where tokens are evenly strided rows (whole 16-byte words, or rows of an odd
    stride), the per-element indexing elsewhere (pages not page_size rows apart); every layout gives the named rows
    bit for bit, a NaN row included."""
    from flashmla_backend import ops
    g = torch.Generator().manual_seed(36)
    width = {"contiguous": 576, "two_layers_a_row": 1152, "odd_row_stride": 577, "every_other_page": 576}[layout]
    pages = 20 if layout == "every_other_page" else 10
    big = torch.randn(pages, 64, 1, width, generator=g).to(dtype)
    cache = {"contiguous": big, "two_layers_a_row": big[..., 576:], "odd_row_stride": big[..., 1:],
             "every_other_page": big[::2]}[layout]
    cache[3, 5, 0, :] = float("nan")
    assert (cache.stride(0) == 64 * cache.stride(1)) == (layout != "every_other_page")
    tok = torch.randint(0, 640, (300,), generator=g)
    tok[0] = 3 * 64 + 5
    want = torch.stack([cache[t // 64, t % 64, 0] for t in tok.tolist()])
    got = ops._gather_tokens(cache, tok)
    assert got.shape == (300, 576) and got.dtype == dtype
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_a_fill_for_a_sixteen_bit_cache_records_the_configuration_only():
    """Its decode schedules the gathered tokens in every call, so no sparse schedule is made (no device touched)."""
    meta = fb.fill_sparse_sched_meta(fb.get_mla_metadata()[0], batch=2, s_q=1, num_heads_q=64, topk=128,
                                     device="cuda", is_fp8_kvcache=False)
    assert meta.have_initialized and meta.tile_scheduler_metadata is None and meta.sparse_lengths is None
    assert meta.config == FlashMLASchedMeta.Config(2, 1, 64, 64, 1, False, False, 128)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_without_the_sm90_kernel_are_refused_naming_it():
    """The sparse kernel is the sm90 one (tests/test_sparse_gpu.py runs it); another GPU's kernel is refused."""
    from flashmla_backend import device
    kernel = device.kernel_for(torch.device("cuda"))
    if kernel == "sm90":
        pytest.skip("this GPU runs the sparse kernel (tests/test_sparse_gpu.py)")
    inp = make_sparse_inputs(SparseCase())
    meta, _ = fb.get_mla_metadata()
    with pytest.raises(NotImplementedError, match=rf"the fp8_ds_mla KV cache is read in sparse decode \(indices\) by "
                                                  rf"the sm90 kernel only, not by the {kernel} kernel.*CPU tensors"):
        fb.flash_mla_with_kvcache(inp.q.cuda(), inp.k_cache.cuda(), None, None, D_V, meta, None, is_fp8_kvcache=True,
                                  indices=inp.indices.cuda())
    assert not meta.have_initialized


def test_codec_round_trip_through_the_api():
    """A 16-bit cache and its fp8_ds_mla quantization give outputs a few e4m3 steps apart, no more."""
    case = SparseCase(b=2, s_q=2, h_q=8, topk=48, num_pages=3, cache="bf16", skipped=0.1, seed=11)
    inp = make_sparse_inputs(case)
    total = inp.k_cache.shape[0] * inp.k_cache.shape[1]
    ds = fp8_ds_mla.quantize(inp.k_cache.reshape(total, D_K)).view(inp.k_cache.shape[:3] + (656,))
    out16, _ = api(inp)
    out8, _ = api(inp.replace(k_cache=ds, q=inp.q), is_fp8_kvcache=True)
    err = float((out8.float() - out16.float()).norm() / out16.float().norm())
    assert 1e-4 < err < 0.06, err


@pytest.mark.parametrize("rows,topk,h_q,cut", [
    (128, 2048, 128, False), (256, 2048, 128, False), (128, 2048, 64, False), (64, 2048, 128, False),
    (128, 512, 128, False), (32, 2048, 128, True), (1, 2048, 128, True), (100, 2048, 128, True), (0, 2048, 128, False)])
def test_the_combine_runs_only_where_the_sparse_schedule_cuts_a_row(rows, topk, h_q, cut):
    """ops._sparse_schedule_splits (the host's mirror of the GPU's schedule) says whether any row is cut in splits: the
    benchmark table's shapes at b >= 64 are scheduled whole (one row a part or rows whole on 66 parts at h_q 128, 132
    at h_q 64), b32 and b1 are cut; the sparse path then launches the decode without the combine (skip_combine)."""
    from flashmla_backend import ops, scheduler
    parts = scheduler.sparse_num_sm_parts(132, rows, topk, h_q)
    assert ops._sparse_schedule_splits(rows, topk, parts) is cut
    if rows:
        _, splits = scheduler.schedule(torch.full((rows,), topk, dtype=torch.int32), parts,
                                       scheduler.SPARSE_MIN_PART_BLOCKS)
        assert bool((splits[1:] - splits[:-1]).max() > 1) is cut
