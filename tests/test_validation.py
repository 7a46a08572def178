"""Bad input gets a clear Python exception naming the argument (CPU tensors; GPU-only checks marked)."""
import re

import numpy as np
import pytest
import torch

import flashmla_backend as fb
from flashmla_backend import validate
from flashmla_backend.geometry import BLOCK_M
from kit import D_K, D_V, PAGE, Case, make_inputs


def args(case=None, device="cpu"):
    case = case or Case(lengths=[70, 5], s_q=2, h_q=16)
    inp = make_inputs(case, device)
    meta, num_splits = fb.get_mla_metadata(inp.cache_seqlens, case.s_q * case.h_q // case.h_kv, case.h_kv)
    return dict(q=inp.q, k_cache=inp.k_cache, block_table=inp.block_table, cache_seqlens=inp.cache_seqlens,
                head_dim_v=D_V, tile_scheduler_metadata=meta, num_splits=num_splits, softmax_scale=inp.scale,
                causal=True, descale_q=None, descale_k=None, q_pe=None)


def call(**kw):
    return fb.flash_mla_with_kvcache(**kw)


def expect(exc, match, **changes):
    a = args()
    a.update(changes)
    with pytest.raises(exc, match=match):
        call(**a)


def test_valid_arguments_run():
    out, lse = call(**args())
    assert out.shape == (2, 2, 16, D_V) and lse.shape == (2, 16, 2)


def test_q_dtype():
    a = args()
    expect(TypeError, r"q must have dtype torch.bfloat16 or torch.float16", q=a["q"].float())


def test_q_and_cache_dtypes_differ():
    a = args()
    expect(TypeError, r"q and k_cache must have the same dtype", q=a["q"].half())


FP8 = torch.float8_e4m3fn
ONE = torch.ones(1)


def test_fp8_cache_errors_name_the_argument():
    a = args()
    k8 = a["k_cache"].to(FP8)
    shapes = re.escape("of shape (1,) (one scale for the tensor; any one-element tensor) or (batch, num_heads_k) = "
                       "(2, 1) (one per request and KV head, any strides: e.g. scale.expand(2, 1))")
    expect(ValueError, r"k_cache is float8_e4m3fn .* needs descale_k: a float32 tensor on cpu " + shapes, k_cache=k8)
    expect(ValueError, r"descale_k must be a float32 tensor, got \(1,\) torch.float64", k_cache=k8,
           descale_k=ONE.double())
    for bad in (torch.ones(2), torch.ones(2, 2), torch.ones(1, 2), torch.ones(2, 1, 1), torch.ones(3, 1)):
        expect(ValueError, r"descale_k must have shape \(1,\) .* = \(2, 1\) .*, got " + re.escape(str(tuple(bad.shape))),
               k_cache=k8, descale_k=bad)
    expect(ValueError, r"descale_q must have shape \(1,\) .* = \(2, 1\)", q=a["q"].to(FP8), k_cache=k8, descale_k=ONE,
           descale_q=torch.ones(1, 2))
    expect(TypeError, r"descale_k must be None or a torch.Tensor, got float", k_cache=k8, descale_k=1.0)
    expect(ValueError, r"descale_k is only used with a float8_e4m3fn k_cache, but k_cache is torch.bfloat16",
           descale_k=ONE)
    expect(TypeError, r"k_cache has dtype torch.float8_e5m2: the supported FP8 cache is float8_e4m3fn",
           k_cache=a["k_cache"].to(torch.float8_e5m2))
    expect(TypeError, r"a float8_e4m3fn q \(the fast FP8 mode\) needs a float8_e4m3fn k_cache",
           q=a["q"].to(FP8), descale_q=ONE)
    expect(ValueError, r"q is float8_e4m3fn .* needs descale_q", q=a["q"].to(FP8), k_cache=k8, descale_k=ONE)
    expect(ValueError, r"descale_q is only used with a float8_e4m3fn q", k_cache=k8, descale_k=ONE, descale_q=ONE)
    expect(TypeError, r"q has dtype torch.float8_e5m2", q=a["q"].to(torch.float8_e5m2))
    with pytest.raises(ValueError, match=r"is_fp8_kvcache=True needs a float8_e4m3fn k_cache .* or the 656-byte "
                                         r"fp8_ds_mla cache with indices \(sparse decode\); got k_cache \(6, 64, 1, 576\) "
                                         r"torch.bfloat16"):
        fb.flash_mla_with_kvcache(**a, is_fp8_kvcache=True)
    # The 656-byte fp8_ds_mla cache without indices: whichever of its three dtypes, the message says to pass indices.
    for ds_dtype in (torch.uint8, torch.int8, FP8):
        ds = torch.zeros(4, PAGE, 1, 656, dtype=torch.uint8).view(ds_dtype)
        with pytest.raises(ValueError, match=r"is_fp8_kvcache=True with a k_cache of 656-byte fp8_ds_mla tokens .* is "
                                             r"sparse decode: pass indices \[batch, seqlen_q, topk\] int32"):
            fb.flash_mla_with_kvcache(**dict(a, k_cache=ds), is_fp8_kvcache=True)
        with pytest.raises((TypeError, ValueError), match=r"the 656-byte fp8_ds_mla cache is read by sparse decode: "
                                                          r"pass indices="):
            fb.flash_mla_with_kvcache(**dict(a, k_cache=ds, descale_k=ONE))


def test_metadata_is_the_same_for_both_cache_formats():
    a = args()
    m0, n0 = fb.get_mla_metadata(a["cache_seqlens"], 32, 1)
    m1, n1 = fb.get_mla_metadata(a["cache_seqlens"], 32, 1, is_fp8_kvcache=True)
    assert torch.equal(m0, m1) and torch.equal(n0, n1)


def test_q_shape():
    a = args()
    expect(ValueError, rf"q must be \[batch, seqlen_q, num_heads_q, {D_K}\]", q=a["q"][0])
    expect(ValueError, rf"q's last dimension must be {D_K}", q=a["q"][..., :D_V].contiguous())


def test_cache_rank_and_page_size():
    a = args()
    expect(ValueError, rf"k_cache must be \[num_pages, page_size, num_heads_k, {D_K}\].*unsqueeze",
           k_cache=a["k_cache"].squeeze(2))
    expect(ValueError, rf"page size {PAGE // 2} .*only {PAGE}-token pages",
           k_cache=a["k_cache"].reshape(-1, PAGE // 2, 1, D_K))


def test_head_dim_v():
    expect(ValueError, rf"head_dim_v must be {D_V}", head_dim_v=128)


def test_heads_divisible():
    case = Case(lengths=[70, 5], s_q=1, h_q=3, h_kv=1)
    a = args(case)
    a["k_cache"] = a["k_cache"].expand(-1, -1, 2, -1)
    with pytest.raises(ValueError, match=r"num_heads_q \(3\) must be a multiple of num_heads_k \(2\)"):
        call(**a)


def test_head_counts_must_be_positive():
    """No heads is not a multiple of anything worth running: the message says the count must be positive."""
    a = args()
    expect(ValueError, r"q must have num_heads_q >= 1 \(dimension 2: the count of query heads must be positive\)",
           q=a["q"][:, :, :0])
    expect(ValueError, r"k_cache must have num_heads_k >= 1 \(dimension 2: the count of KV heads must be positive\)",
           k_cache=a["k_cache"][:, :, :0])


def test_last_dim_contiguous():
    a = args()
    q = torch.empty(a["q"].shape[:-1] + (D_K * 2,), dtype=a["q"].dtype)[..., ::2]
    expect(ValueError, r"q must have a contiguous last dimension", q=q)


def test_block_table_dtype_and_shape():
    a = args()
    expect(TypeError, r"block_table must have dtype torch.int32", block_table=a["block_table"].long())
    expect(ValueError, r"block_table must be \[batch=2", block_table=a["block_table"][:1])


def test_seqlens_dtype_and_shape():
    a = args()
    expect(TypeError, r"cache_seqlens must have dtype torch.int32", cache_seqlens=a["cache_seqlens"].long())
    expect(ValueError, r"cache_seqlens must be \[batch=2\]", cache_seqlens=a["cache_seqlens"][:1])


def test_metadata_shapes():
    a = args()
    expect(ValueError, r"tile_scheduler_metadata must be \[num_sm_parts, 8\]",
           tile_scheduler_metadata=a["tile_scheduler_metadata"][:, :4].contiguous())
    expect(ValueError, r"num_splits must be \[batch \+ 1 = 3\]", num_splits=a["num_splits"][:2])


def test_negative_length():
    expect(ValueError, r"cache_seqlens must be >= 0.*\(1, -3\)", cache_seqlens=torch.tensor([70, -3], dtype=torch.int32))


def test_negative_length_refused_where_the_metadata_is_made():
    """get_mla_metadata on CPU tensors refuses a negative length itself, not only the decode that follows."""
    bad = torch.tensor([70, -3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cache_seqlens must be >= 0, got negative lengths at \(index, length\) "
                                         r"\[\(1, -3\)\]"):
        fb.get_mla_metadata(bad, 32, 1)
    meta, num_splits = fb.get_mla_metadata(bad.clamp(min=0), 32, 1)  # the same lengths, none negative
    assert num_splits.shape == (4,)


def test_block_table_too_short():
    expect(ValueError, r"block_table is too short.*\(0, 1000\)", cache_seqlens=torch.tensor([1000, 5], dtype=torch.int32))


def test_page_id_out_of_range():
    a = args()
    bt = a["block_table"].clone()
    bt[0, 0] = 10**6
    expect(ValueError, r"block_table\[0\] holds page ids outside", block_table=bt)


def test_softmax_scale_and_causal():
    expect(ValueError, r"softmax_scale must be a finite positive float", softmax_scale=-1.0)
    expect(TypeError, r"causal must be a bool", causal=1)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -1e-3, np.float32("nan"),
                                   np.float64(0.0), np.float32(-1.0)], ids=repr)
def test_softmax_scale_must_be_finite_and_positive(scale):
    expect(ValueError, r"softmax_scale must be a finite positive float.*got", softmax_scale=scale)


@pytest.mark.parametrize("scale", [np.float32(0.07), np.float64(0.07), np.int64(1), 1], ids=repr)
def test_numpy_scalars_are_accepted(scale):
    a = args()
    want_out, want_lse = call(**dict(a, softmax_scale=float(scale)))
    out, lse = call(**dict(a, softmax_scale=scale, head_dim_v=np.int64(D_V)))
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert validate.DECODE.accepts(**dict(a, softmax_scale=scale, head_dim_v=np.int32(D_V)))
    meta, ns = fb.get_mla_metadata(a["cache_seqlens"], np.int64(32), np.int32(1), num_heads_q=np.int64(16))
    assert torch.equal(meta, a["tile_scheduler_metadata"]) and torch.equal(ns, a["num_splits"])


def test_numpy_bool_and_float_head_dim_refused():
    expect(ValueError, r"softmax_scale must be a finite positive float", softmax_scale=np.bool_(True))
    expect(ValueError, rf"head_dim_v must be {D_V} \(an int\), got {float(D_V)}", head_dim_v=float(D_V))


def test_not_a_tensor():
    expect(TypeError, r"q must be a torch.Tensor, got list", q=[1, 2])


def test_device_mismatch_on_cpu():
    """A tensor on another device (the meta device stands in for a GPU here) is named."""
    a = args()
    expect(ValueError, r"block_table is on meta but q is on cpu", block_table=a["block_table"].to("meta"))
    meta_args = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    with pytest.raises(ValueError, match=r"q is on meta; only CUDA and CPU tensors work"):
        call(**meta_args)


def _mutations():
    """name -> (changes, valid): every mutation but the valid ones is a bad input."""
    a = args()
    q, kc = a["q"], a["k_cache"]
    meta = a["tile_scheduler_metadata"]
    bad = {
        "q float32": dict(q=q.float()),
        "q fp16 vs bf16 cache": dict(q=q.half()),
        "q 3-D": dict(q=q[0]),
        "q last dim D_V": dict(q=q[..., :D_V].contiguous()),
        "q strided last dim": dict(q=torch.empty(q.shape[:-1] + (2 * D_K,), dtype=q.dtype)[..., ::2]),
        "q list": dict(q=[1, 2]),
        "q seqlen 0": dict(q=q[:, :0]),
        "q on meta": {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in a.items()},
        "cache list": dict(k_cache=None),
        "cache fp8": dict(k_cache=kc.to(torch.float8_e4m3fn)) if hasattr(torch, "float8_e4m3fn") else {},
        "cache 3-D": dict(k_cache=kc.squeeze(2)),
        "cache float32": dict(k_cache=kc.float()),
        "cache strided last dim": dict(k_cache=torch.empty(kc.shape[:-1] + (2 * D_K,), dtype=kc.dtype)[..., ::2]),
        "cache last dim D_V": dict(k_cache=kc[..., :D_V].contiguous()),
        "cache no pages": dict(k_cache=kc[:0]),
        "half pages": dict(k_cache=kc.reshape(-1, PAGE // 2, 1, D_K)),
        "cache h_kv 3 of 16": dict(k_cache=kc.expand(-1, -1, 3, -1)),
        "cache h_kv 0": dict(k_cache=kc[:, :, :0]),
        "q no heads": dict(q=q[:, :, :0]),
        "cache on meta": dict(k_cache=kc.to("meta")),
        "head_dim_v 128": dict(head_dim_v=128),
        "head_dim_v float": dict(head_dim_v=float(D_V)),
        "head_dim_v None": dict(head_dim_v=None),
        "block_table int64": dict(block_table=a["block_table"].long()),
        "block_table short batch": dict(block_table=a["block_table"][:1]),
        "block_table no columns": dict(block_table=a["block_table"][:, :0]),
        "block_table 1-D": dict(block_table=a["block_table"][0]),
        "block_table strided": dict(block_table=a["block_table"].repeat(1, 2)[:, ::2]),
        "block_table list": dict(block_table=[[0]]),
        "block_table on meta": dict(block_table=a["block_table"].to("meta")),
        "seqlens int64": dict(cache_seqlens=a["cache_seqlens"].long()),
        "seqlens short": dict(cache_seqlens=a["cache_seqlens"][:1]),
        "seqlens 2-D": dict(cache_seqlens=a["cache_seqlens"][None]),
        "seqlens strided": dict(cache_seqlens=torch.zeros(4, dtype=torch.int32)[::2]),
        "seqlens last-dim strided": dict(cache_seqlens=torch.zeros(2, 2, dtype=torch.int32)[:, 0]),
        "seqlens list": dict(cache_seqlens=[70, 5]),
        "seqlens on meta": dict(cache_seqlens=a["cache_seqlens"].to("meta")),
        "meta 4 columns": dict(tile_scheduler_metadata=meta[:, :4].contiguous()),
        "meta no rows": dict(tile_scheduler_metadata=meta[:0]),
        "meta strided": dict(tile_scheduler_metadata=meta.repeat(1, 2)[:, ::2]),
        "meta transposed": dict(tile_scheduler_metadata=meta.t().contiguous().t()),
        "meta rows strided": dict(tile_scheduler_metadata=meta.repeat(1, 2)[:, :8]),
        "meta int64": dict(tile_scheduler_metadata=meta.long()),
        "meta 1-D": dict(tile_scheduler_metadata=meta[0]),
        "meta None": dict(tile_scheduler_metadata=None),
        "meta on meta": dict(tile_scheduler_metadata=meta.to("meta")),
        "num_splits short": dict(num_splits=a["num_splits"][:2]),
        "num_splits int64": dict(num_splits=a["num_splits"].long()),
        "num_splits 2-D": dict(num_splits=a["num_splits"][None]),
        "num_splits strided": dict(num_splits=a["num_splits"].repeat(2)[::2]),
        "num_splits last-dim strided": dict(num_splits=a["num_splits"][:, None].repeat(1, 2)[:, 0]),
        "num_splits tuple": dict(num_splits=(0, 1, 2)),
        "num_splits on meta": dict(num_splits=a["num_splits"].to("meta")),
        "scale negative": dict(softmax_scale=-1.0),
        "scale zero": dict(softmax_scale=0.0),
        "scale nan": dict(softmax_scale=float("nan")),
        "scale inf": dict(softmax_scale=float("inf")),
        "scale np nan": dict(softmax_scale=np.float32("nan")),
        "scale bool": dict(softmax_scale=True),
        "scale np bool": dict(softmax_scale=np.bool_(True)),
        "scale string": dict(softmax_scale="0.1"),
        "scale tensor": dict(softmax_scale=torch.tensor(0.1)),
        "causal int": dict(causal=1),
        "causal None": dict(causal=None),
        "causal np bool": dict(causal=np.bool_(True)),
        "cache e5m2": dict(k_cache=kc.to(torch.float8_e5m2), descale_k=ONE),
        "q e5m2": dict(q=a["q"].to(torch.float8_e5m2), k_cache=kc.to(FP8), descale_k=ONE, descale_q=ONE),
        "cache fp8 without descale_k": dict(k_cache=kc.to(FP8)),
        "cache fp8 descale_k float64": dict(k_cache=kc.to(FP8), descale_k=ONE.double()),
        "cache fp8 descale_k two elements": dict(k_cache=kc.to(FP8), descale_k=torch.ones(2)),
        "cache fp8 descale_k [b, 2 heads]": dict(k_cache=kc.to(FP8), descale_k=torch.ones(2, 2)),
        "cache fp8 descale_k [h_kv, b]": dict(k_cache=kc.to(FP8), descale_k=torch.ones(1, 2)),
        "cache fp8 descale_k [b, h_kv, 1]": dict(k_cache=kc.to(FP8), descale_k=torch.ones(2, 1, 1)),
        "cache fp8 descale_k [b + 1, h_kv]": dict(k_cache=kc.to(FP8), descale_k=torch.ones(3, 1)),
        "cache fp8 descale_k [b, h_kv] float64": dict(k_cache=kc.to(FP8), descale_k=torch.ones(2, 1).double()),
        "cache fp8 descale_k list": dict(k_cache=kc.to(FP8), descale_k=[1.0]),
        "cache fp8 descale_k on meta": dict(k_cache=kc.to(FP8), descale_k=ONE.to("meta")),
        "descale_k with a bf16 cache": dict(descale_k=ONE),
        "q fp8 with a bf16 cache": dict(q=a["q"].to(FP8), descale_q=ONE),
        "q fp8 without descale_q": dict(q=a["q"].to(FP8), k_cache=kc.to(FP8), descale_k=ONE),
        "descale_q with a bf16 q": dict(k_cache=kc.to(FP8), descale_k=ONE, descale_q=ONE),
        "q fp8 descale_q int32": dict(q=a["q"].to(FP8), k_cache=kc.to(FP8), descale_k=ONE,
                                      descale_q=torch.ones(1, dtype=torch.int32)),
        "q fp8 descale_q [h_kv, b]": dict(q=a["q"].to(FP8), k_cache=kc.to(FP8), descale_k=ONE,
                                          descale_q=torch.ones(1, 2)),
        "q fp8 descale_q on meta": dict(q=a["q"].to(FP8), k_cache=kc.to(FP8), descale_k=ONE, descale_q=ONE.to("meta")),
        "q fp8 descale_q 0-d float": dict(q=a["q"].to(FP8), k_cache=kc.to(FP8), descale_k=ONE, descale_q=3.0),
        "q_pe list": dict(q=q[..., :D_V], q_pe=[0.0] * 64),
        "q_pe with a 576-column q": dict(q_pe=q[..., D_V:]),
        "q_pe fp16 with a bf16 q": dict(q=q[..., :D_V], q_pe=q[..., D_V:].half()),
        "q_pe 3-D": dict(q=q[..., :D_V], q_pe=q[0, ..., D_V:]),
        "q_pe 32 columns": dict(q=q[..., :D_V], q_pe=q[..., D_V:D_V + 32]),
        "q_pe other heads": dict(q=q[..., :D_V], q_pe=q[:, :, :8, D_V:]),
        "q_pe strided last dim": dict(q=q[..., :D_V], q_pe=torch.empty(q.shape[:-1] + (128,), dtype=q.dtype)[..., ::2]),
        "q_pe on meta": dict(q=q[..., :D_V], q_pe=q[..., D_V:].to("meta")),
    }
    good = {
        "valid": {},
        "scale None": dict(softmax_scale=None),
        "scale np.float32": dict(softmax_scale=np.float32(0.05)),
        "scale np.float64": dict(softmax_scale=np.float64(0.05)),
        "scale int": dict(softmax_scale=1),
        "scale np.int64": dict(softmax_scale=np.int64(1)),
        "head_dim_v np.int64": dict(head_dim_v=np.int64(D_V)),
        "causal False": dict(causal=False),
        "fp8 cache": dict(k_cache=kc.to(FP8), descale_k=ONE * 0.5),
        "fp8 cache, 0-d descale_k": dict(k_cache=kc.to(FP8), descale_k=torch.tensor(0.5)),
        "fp8 cache, [1, 1] descale_k": dict(k_cache=kc.to(FP8), descale_k=torch.full((1, 1), 0.5)),
        "fp8 cache, [b, h_kv] descale_k": dict(k_cache=kc.to(FP8), descale_k=torch.tensor([[0.5], [2.0]])),
        "fp8 cache, expanded descale_k": dict(k_cache=kc.to(FP8), descale_k=(ONE * 0.5).expand(2, 1)),
        "fp8 q and cache, [b, h_kv] descales": dict(q=a["q"].to(FP8), k_cache=kc.to(FP8),
                                                    descale_k=torch.tensor([[0.5], [2.0]]),
                                                    descale_q=torch.tensor([3.0, 0.25]).reshape(1, 2).t()),
        "fp8 q and cache": dict(q=a["q"].to(FP8), k_cache=kc.to(FP8), descale_k=ONE, descale_q=ONE * 2),
        "q in two parts": dict(q=q[..., :D_V], q_pe=q[..., D_V:]),
        "q in two parts, fp8 cache": dict(q=q[..., :D_V], q_pe=q[..., D_V:].clone(), k_cache=kc.to(FP8), descale_k=ONE),
    }
    return {**{k: (v, False) for k, v in bad.items() if v}, **{k: (v, True) for k, v in good.items()}}


MUTATIONS = _mutations()


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_fast_path_never_accepts_what_the_checks_refuse(name):
    """validate_decode_args first runs the DECODE table's fast path (accepts), then only if it says False the
    step-by-step checks (check), which raise the error naming the argument. Both are compiled from the same
    rows, so they must agree: accepts() is True exactly when check() raises nothing."""
    changes, valid = MUTATIONS[name]
    a = dict(args(), **changes)
    fast = validate.DECODE.accepts(**a)  # must not raise, whatever it is given
    refused = None
    try:
        validate.DECODE.check(**a)
    except (TypeError, ValueError, NotImplementedError) as e:
        refused = e
    assert not (fast and refused), f"fast path accepted what the checks refuse: {refused}"
    if valid:
        assert fast and refused is None, refused
    else:
        assert refused is not None, "a bad input: the step-by-step checks must refuse it"
        assert refused.rule.arg in str(refused), (refused.rule, refused)
        with pytest.raises(type(refused)):  # and the public entry point refuses it the same way
            call(**a)


def test_every_decode_rule_is_exercised():
    """Each row of the DECODE table refuses at least one of the mutations above (no dead or shadowed rule)."""
    fired = set()
    for changes, valid in MUTATIONS.values():
        if valid:
            continue
        try:
            validate.DECODE.check(**dict(args(), **changes))
        except (TypeError, ValueError, NotImplementedError) as e:
            fired.add(e.rule)
    missing = [r for r in validate.DECODE.rules if r not in fired]
    if not hasattr(torch, "float8_e4m3fn"):
        missing = [r for r in missing if r.exc is not NotImplementedError]
    assert not missing, "rules no mutation triggers:\n" + "\n".join(f"{r.arg}: {r.test}" for r in missing)


def test_rule_tables_name_their_arguments():
    for table in (validate.DECODE, validate.REFERENCE, validate.LAYOUT, validate.METADATA, validate.VALUES,
                  validate.LENGTHS, validate.DESCALES, validate.SCHEDULE, validate.DENSE_FLAGS, validate.SPARSE,
                  validate.SPARSE_REFERENCE, validate.SPARSE_VALUES):
        assert table.rules, table
        for rule in table.rules:
            assert rule.arg in table.params and issubclass(rule.exc, Exception), rule


def test_stale_metadata_in_checked_mode(monkeypatch):
    a = args()
    monkeypatch.setenv(validate.CHECK_ENV, "1")
    call(**a)  # fresh metadata passes
    stale = a["tile_scheduler_metadata"].clone()
    stale[0, 3] += PAGE
    expect(ValueError, r"do not match cache_seqlens", tile_scheduler_metadata=stale)


def test_stale_metadata_refused_on_cpu():
    """CPU tensors always get the value checks, the metadata's included (no checked mode needed)."""
    a = args()
    stale = a["tile_scheduler_metadata"].clone()
    stale[0, 3] += PAGE
    expect(ValueError, r"tile_scheduler_metadata/num_splits do not match cache_seqlens .*: recompute them with "
           r"get_mla_metadata", tile_scheduler_metadata=stale)
    # metadata of other lengths (same batch): the split counts or the rows differ
    old_meta, old_ns = fb.get_mla_metadata(torch.tensor([5000, 5], dtype=torch.int32), 32, 1)
    with pytest.raises(ValueError, match=r"do not match cache_seqlens.*recompute"):
        call(**dict(a, tile_scheduler_metadata=old_meta, num_splits=old_ns))
    # metadata for another head count: another number of parts
    other_meta, other_ns = fb.get_mla_metadata(a["cache_seqlens"], 2 * BLOCK_M * 16, 1)
    with pytest.raises(ValueError, match=r"tile_scheduler_metadata has 4 parts, but get_mla_metadata gives 132 for "
                                         r"seqlen_q=2, num_heads_q=16, num_heads_k=1 on cpu: recompute it with "
                                         r"get_mla_metadata\(cache_seqlens, 32, 1\)"):
        call(**dict(a, tile_scheduler_metadata=other_meta, num_splits=other_ns))


def test_metadata_argument_errors():
    s = torch.tensor([5, 6], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"cache_seqlens must have dtype torch.int32"):
        fb.get_mla_metadata(s.long(), 16, 1)
    with pytest.raises(ValueError, match=r"num_heads_k must be a positive int"):
        fb.get_mla_metadata(s, 16, 0)
    with pytest.raises(NotImplementedError, match=r"topk"):
        fb.get_mla_metadata(s, 16, 1, topk=2048)


def test_every_dense_flag_rule_fires():
    """Each row of DENSE_FLAGS (is_fp8_kvcache and the sparse-only arguments in a dense call) refuses something."""
    a = args()
    ds = torch.zeros(4, PAGE, 1, 656, dtype=torch.uint8)
    bad = [dict(is_fp8_kvcache="yes"), dict(is_fp8_kvcache=True, k_cache=ds), dict(is_fp8_kvcache=True)]
    bad += [{n: torch.zeros(2)} for n in validate.SPARSE_ONLY]
    fired = set()
    for changes in bad:
        flags = dict(dict.fromkeys(validate.DENSE_FLAG_PARAMS), k_cache=a["k_cache"], is_fp8_kvcache=False)
        flags.update(changes)
        assert not validate.DENSE_FLAGS.accepts(**flags)
        with pytest.raises((TypeError, ValueError)) as e:
            validate.DENSE_FLAGS.check(**flags)
        assert e.value.rule.arg in str(e.value)
        fired.add(e.value.rule)
    assert fired == set(validate.DENSE_FLAGS.rules)
    assert validate.DENSE_FLAGS.accepts(**dict(dict.fromkeys(validate.DENSE_FLAG_PARAMS), k_cache=a["k_cache"],
                                               is_fp8_kvcache=False))
    with pytest.raises(TypeError, match=r"is_fp8_kvcache must be a bool, got 'yes'"):
        fb.flash_mla_with_kvcache(**a, is_fp8_kvcache="yes")


@pytest.mark.parametrize("name", validate.SPARSE_ONLY)
def test_sparse_only_arguments_named_in_dense_decode(name):
    """attn_sink, topk_length and the extra_* arguments belong to sparse decode: without indices each is named."""
    a = args()
    value = {"attn_sink": torch.zeros(16), "extra_k_cache": a["k_cache"]}.get(name, torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=rf"{name} works in sparse decode only \(with indices\); dense decode takes "
                                         rf"{name}=None, got"):
        fb.flash_mla_with_kvcache(**a, **{name: value})


def test_empty_batch():
    case = Case(lengths=[5], s_q=1, h_q=16)
    a = args(case)
    empty = dict(a, q=a["q"][:0], block_table=a["block_table"][:0], cache_seqlens=a["cache_seqlens"][:0])
    meta, ns = fb.get_mla_metadata(empty["cache_seqlens"], 16, 1)
    out, lse = call(**dict(empty, tile_scheduler_metadata=meta, num_splits=ns))
    assert out.shape == (0, 1, 16, D_V) and lse.shape == (0, 16, 1)


# ---- device checks (need a CUDA device; the CPU cannot produce them) -------------------------------

@pytest.mark.gpu
def test_device_mismatch():
    a = args(device="cuda")
    expect(ValueError, r"block_table is on cpu but q is on cuda", **dict(a, block_table=a["block_table"].cpu()))


@pytest.mark.gpu
def test_misaligned_q_pointer():
    a = args(device="cuda")
    flat = torch.empty(a["q"].numel() + 1, dtype=a["q"].dtype, device="cuda")
    q = flat[1:].view(a["q"].shape)
    q.copy_(a["q"])
    with pytest.raises(ValueError, match=r"q's data pointer must be 16-byte aligned"):
        call(**dict(a, q=q))


@pytest.mark.gpu
def test_checked_mode_on_gpu(monkeypatch):
    a = args(device="cuda")
    monkeypatch.setenv(validate.CHECK_ENV, "1")
    with pytest.raises(ValueError, match=r"block_table is too short"):
        call(**dict(a, cache_seqlens=torch.tensor([1000, 5], dtype=torch.int32, device="cuda")))


@pytest.mark.gpu
def test_metadata_negative_length_on_gpu_in_checked_mode(monkeypatch):
    lengths = torch.tensor([5, -1], dtype=torch.int32, device="cuda")
    fb.get_mla_metadata(lengths, 16, 1)  # without the checked mode no host sync, no check
    monkeypatch.setenv(validate.CHECK_ENV, "1")
    with pytest.raises(ValueError, match=r"cache_seqlens must be >= 0, got negative lengths"):
        fb.get_mla_metadata(lengths, 16, 1)


@pytest.mark.gpu
def test_descale_values_on_gpu_in_checked_mode(monkeypatch):
    """On CUDA tensors a descale is read on the host only in the checked mode (like the other device values)."""
    a = args(device="cuda")
    monkeypatch.setenv(validate.CHECK_ENV, "1")
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"descale_k must be finite and positive .* got " + repr(bad)):
            call(**dict(a, k_cache=a["k_cache"].to(FP8), descale_k=torch.full((1,), bad, device="cuda")))


# ---- unsupported GPUs (the device properties are faked; needs the compiled module for its limits) ----

@pytest.mark.parametrize("major,minor,smem,name", [(8, 9, 101376, "NVIDIA GeForce RTX 4090"),
                                                   (7, 5, 65536, "Tesla T4")])
def test_unsupported_gpu_message_names_the_gpu(monkeypatch, major, minor, smem, name):
    from flashmla_backend import _ext, device

    if not _ext.available():
        pytest.skip("needs the compiled module (its shared-memory needs and build targets)")
    fake = device.DeviceProps(index=0, name=name, major=major, minor=minor, sm_count=128, smem_per_block_optin=smem)
    monkeypatch.setattr(device, "device_props", lambda index: fake)
    device._kernel_for.cache_clear()
    try:
        with pytest.raises(device.UnsupportedGPUError, match=rf"GPU 0 '{name}' \(sm_{major}{minor}.*Supported: Hopper"):
            device._kernel_for(0, "")
        with pytest.raises(device.UnsupportedGPUError, match=r"FLASHMLA_BACKEND_KERNEL=sm90"):
            device._kernel_for(0, "sm90")
    finally:
        device._kernel_for.cache_clear()


def test_supported_gpu_kernel_choice(monkeypatch):
    from flashmla_backend import _ext, device

    if not _ext.available():
        pytest.skip("needs the compiled module")
    C = _ext.ext()
    hopper = device.DeviceProps(index=0, name="NVIDIA H100", major=9, minor=0, sm_count=132,
                                smem_per_block_optin=232448)
    monkeypatch.setattr(device, "device_props", lambda index: hopper)
    device._kernel_for.cache_clear()
    try:
        assert device._kernel_for(0, "") == ("sm90" if C.sm90_compiled() else "portable")
        assert device._kernel_for(0, "portable") == "portable"
        with pytest.raises(ValueError, match=r"expected 'auto', 'portable' or 'sm90'"):
            device._kernel_for(0, "fast")
    finally:
        device._kernel_for.cache_clear()
