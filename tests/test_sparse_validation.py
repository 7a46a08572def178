"""Bad arguments to sparse decode (flash_mla_with_kvcache with indices, sparse_mla_decode_reference) get a Python
exception naming the argument and what is expected, from the SPARSE rule tables of flashmla_backend.validate."""
import numpy as np
import pytest
import torch

import flashmla_backend as fb
from flashmla_backend import validate
from flashmla_backend.reference import sparse_mla_decode_reference
from kit import D_K, D_V
from sparsekit import SparseCase, make_sparse_inputs

FP8 = torch.float8_e4m3fn


def args(case=None):
    inp = make_sparse_inputs(case or SparseCase(b=2, s_q=2, h_q=4, topk=16, num_pages=2, topk_length=[16, 5],
                                                sink=True))
    return dict(q=inp.q, k_cache=inp.k_cache, block_table=None, cache_seqlens=None, head_dim_v=D_V,
                tile_scheduler_metadata=fb.get_mla_metadata()[0], num_splits=None, softmax_scale=inp.scale,
                causal=False, is_fp8_kvcache=True, indices=inp.indices, attn_sink=inp.attn_sink, extra_k_cache=None,
                extra_indices_in_kvcache=None, topk_length=inp.topk_length, extra_topk_length=None, descale_q=None,
                descale_k=None, q_pe=None)


def call(**kw):
    public = {k: v for k, v in kw.items() if k not in ("descale_q", "descale_k", "q_pe")}
    return fb.flash_mla_with_kvcache(**public, descale_q=kw.get("descale_q"), descale_k=kw.get("descale_k"),
                                     q_pe=kw.get("q_pe"))


def expect(exc, match, **changes):
    with pytest.raises(exc, match=match):
        call(**dict(args(), **changes))


def _sixteen_bit():
    """The same call on a 16-bit cache (bf16 q and cache, is_fp8_kvcache False)."""
    a = args(SparseCase(b=2, s_q=2, h_q=4, topk=16, num_pages=2, cache="bf16"))
    return dict(q=a["q"], k_cache=a["k_cache"], is_fp8_kvcache=False, indices=a["indices"])


def _mutations():
    """name -> (changes, valid): every mutation but the valid ones is a bad input."""
    a = args()
    q, kc, idx = a["q"], a["k_cache"], a["indices"]
    u8 = kc.view(torch.uint8)
    bf16 = _sixteen_bit()
    bad = {
        "q list": dict(q=[1.0]),
        "q float32": dict(q=q.float()),
        "q fp8": dict(q=q.to(FP8)),
        "q 3-D": dict(q=q[0]),
        "q strided last dim": dict(q=torch.empty(q.shape[:-1] + (2 * D_K,), dtype=q.dtype)[..., ::2]),
        "q last dim 512": dict(q=q[..., :D_V].contiguous()),
        "q fp16 with fp8_ds_mla": dict(q=q.half()),
        "q no heads": dict(q=q[:, :, :0], attn_sink=None),
        "q no tokens": dict(q=q[:, :0], indices=idx[:, :0]),
        "q on meta": {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in a.items()},
        "cache list": dict(k_cache=[0]),
        "cache 3-D": dict(k_cache=kc.squeeze(2)),
        "cache strided last dim": dict(k_cache=torch.zeros(kc.shape[:-1] + (2 * 656,), dtype=torch.uint8)[..., ::2]),
        "cache float32": dict(k_cache=u8.float()),
        "cache e5m2 656": dict(k_cache=u8.view(torch.float8_e5m2)),
        "cache uint8 576": dict(k_cache=u8[..., :576].contiguous()),
        "cache fp8_e4m3 576 (dense fp8)": dict(k_cache=u8[..., :576].contiguous().view(FP8)),
        "cache bf16 656": dict(k_cache=torch.zeros(kc.shape, dtype=torch.bfloat16), is_fp8_kvcache=False),
        "cache two kv heads": dict(k_cache=kc.expand(-1, -1, 2, -1)),
        "cache no pages": dict(k_cache=kc[:0]),
        "cache empty pages": dict(k_cache=kc[:, :0]),
        "cache on meta": dict(k_cache=kc.to("meta")),
        "16-bit cache in fp16 with a bf16 q": dict(bf16, k_cache=bf16["k_cache"].half()),
        "is_fp8_kvcache False with fp8_ds_mla": dict(is_fp8_kvcache=False),
        "is_fp8_kvcache True with bf16": dict(bf16, is_fp8_kvcache=True),
        "is_fp8_kvcache None": dict(is_fp8_kvcache=None),
        "is_fp8_kvcache string": dict(is_fp8_kvcache="yes"),
        "indices int64": dict(indices=idx.long()),
        "indices float": dict(indices=idx.float()),
        "indices 2-D": dict(indices=idx[:, 0]),
        "indices batch 1": dict(indices=idx[:1]),
        "indices seqlen_q 1": dict(indices=idx[:, :1]),
        "indices topk 0": dict(indices=idx[..., :0]),
        "indices strided last dim": dict(indices=idx.repeat(1, 1, 2)[..., ::2]),
        "indices list": dict(indices=[[[0]]]),
        "indices on meta": dict(indices=idx.to("meta")),
        "topk_length int64": dict(topk_length=a["topk_length"].long()),
        "topk_length [b, 1]": dict(topk_length=a["topk_length"][:, None]),
        "topk_length short": dict(topk_length=a["topk_length"][:1]),
        "topk_length strided": dict(topk_length=a["topk_length"].repeat(2)[::2]),
        "topk_length list": dict(topk_length=[16, 5]),
        "topk_length on meta": dict(topk_length=a["topk_length"].to("meta")),
        "attn_sink float64": dict(attn_sink=a["attn_sink"].double()),
        "attn_sink bf16": dict(attn_sink=a["attn_sink"].bfloat16()),
        "attn_sink [1, h_q]": dict(attn_sink=a["attn_sink"][None]),
        "attn_sink short": dict(attn_sink=a["attn_sink"][:2]),
        "attn_sink strided": dict(attn_sink=a["attn_sink"].repeat(2)[::2]),
        "attn_sink float": dict(attn_sink=0.5),
        "attn_sink on meta": dict(attn_sink=a["attn_sink"].to("meta")),
        "head_dim_v 576": dict(head_dim_v=576),
        "head_dim_v float": dict(head_dim_v=512.0),
        "metadata tensor": dict(tile_scheduler_metadata=torch.zeros(132, 8, dtype=torch.int32)),
        "metadata None": dict(tile_scheduler_metadata=None),
        "num_splits tensor": dict(num_splits=torch.zeros(3, dtype=torch.int32)),
        "scale negative": dict(softmax_scale=-1.0),
        "scale nan": dict(softmax_scale=float("nan")),
        "scale string": dict(softmax_scale="0.1"),
        "causal True": dict(causal=True),
        "causal int 0": dict(causal=0),
        "block_table list": dict(block_table=[[0]]),
        "cache_seqlens list": dict(cache_seqlens=[5, 5]),
        "descale_k": dict(descale_k=torch.ones(1)),
        "descale_q": dict(descale_q=torch.ones(1)),
        "q in two parts": dict(q=q[..., :D_V], q_pe=q[..., D_V:]),
        "q_pe beside a whole q": dict(q_pe=q[..., D_V:]),
        "extra_k_cache": dict(extra_k_cache=kc),
        "extra_indices_in_kvcache": dict(extra_indices_in_kvcache=idx),
        "extra_topk_length": dict(extra_topk_length=a["topk_length"]),
    }
    good = {
        "valid": {},
        "int8 bytes": dict(k_cache=u8.view(torch.int8)),
        "float8_e4m3fn bytes": dict(k_cache=u8.view(FP8)),
        "page size 1": dict(k_cache=kc.reshape(-1, 1, 1, 656)),
        "padded page stride": dict(k_cache=torch.cat([kc, kc[:, :1]], dim=1)[:, :64]),
        "no topk_length": dict(topk_length=None),
        "no attn_sink": dict(attn_sink=None),
        "scale None": dict(softmax_scale=None),
        "scale np.float32": dict(softmax_scale=np.float32(0.05)),
        "head_dim_v np.int64": dict(head_dim_v=np.int64(D_V)),
        "is_fp8_kvcache 1": dict(is_fp8_kvcache=1),
        "block_table and cache_seqlens tensors": dict(block_table=torch.zeros(2, 1, dtype=torch.int32),
                                                      cache_seqlens=torch.zeros(2, dtype=torch.int32)),
        "16-bit cache": bf16,
        "16-bit fp16 cache": dict(bf16, q=bf16["q"].half(), k_cache=bf16["k_cache"].half()),
    }
    return {**{k: (v, False) for k, v in bad.items()}, **{k: (v, True) for k, v in good.items()}}


MUTATIONS = _mutations()


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_fast_path_never_accepts_what_the_checks_refuse(name):
    """Both functions of the SPARSE table come from the same rows: accepts() is True exactly when check() raises
    nothing; a refusal names its argument; the public entry point refuses (or runs) the same way."""
    changes, valid = MUTATIONS[name]
    a = dict(args(), **changes)
    fast = validate.SPARSE.accepts(**a)  # must not raise, whatever it is given
    refused = None
    try:
        validate.SPARSE.check(**a)
    except (TypeError, ValueError, NotImplementedError) as e:
        refused = e
    assert not (fast and refused), f"fast path accepted what the checks refuse: {refused}"
    if valid:
        assert fast and refused is None, refused
        out, lse = call(**a)
        assert out.shape == (2, 2, 4, D_V) and lse.shape == (2, 4, 2)
    else:
        assert refused is not None, "a bad input: the step-by-step checks must refuse it"
        assert refused.rule.arg in str(refused), (refused.rule, refused)
        with pytest.raises(type(refused)):
            call(**a)


def test_every_sparse_rule_is_exercised():
    """Each row of the SPARSE table refuses at least one of the mutations above (no dead or shadowed rule)."""
    fired = set()
    for changes, valid in MUTATIONS.values():
        if not valid:
            try:
                validate.SPARSE.check(**dict(args(), **changes))
            except (TypeError, ValueError, NotImplementedError) as e:
                fired.add(e.rule)
    missing = [r for r in validate.SPARSE.rules if r not in fired]
    assert not missing, "rules no mutation triggers:\n" + "\n".join(f"{r.arg}: {r.test}" for r in missing)


@pytest.mark.parametrize("changes,exc,match", [
    (dict(is_fp8_kvcache=False), ValueError,
     r"is_fp8_kvcache=False does not match k_cache \(\(2, 64, 1, 656\) torch.uint8 .*\): True goes with the 656-byte "
     r"fp8_ds_mla cache, False with a 16-bit cache of 576 per token"),
    (dict(q=None), TypeError, r"q must be a torch.Tensor, got NoneType"),
    (dict(k_cache=torch.zeros(2, 64, 1, 576, dtype=FP8)), TypeError,
     r"k_cache must be the 656-byte fp8_ds_mla cache \[num_pages, page_size, 1, 656\] \(uint8, int8 or float8_e4m3fn "
     r"bytes\) or a 16-bit cache \[num_pages, page_size, 1, 576\] in q's dtype, got \(2, 64, 1, 576\) "
     r"torch.float8_e4m3fn .* \(the float8_e4m3fn cache with descale_k is read by dense decode only\)"),
    (dict(q=torch.zeros(2, 2, 4, 576, dtype=torch.float16)), TypeError,
     r"q must have dtype torch.bfloat16 with the fp8_ds_mla cache \(its rope part is bf16\)"),
    (dict(k_cache=torch.zeros(2, 64, 2, 656, dtype=torch.uint8)), ValueError,
     r"k_cache must have num_heads_k 1 \(dimension 2: sparse decode reads one latent KV head\)"),
    (dict(indices=torch.zeros(2, 1, 16, dtype=torch.int32)), ValueError,
     r"indices must be \[batch=2, seqlen_q=2, topk >= 1\] int32, got \(2, 1, 16\) torch.int32"),
    (dict(indices=torch.zeros(2, 2, 16, dtype=torch.int64)), TypeError, r"indices must have dtype torch.int32"),
    (dict(topk_length=torch.zeros(3, dtype=torch.int32)), ValueError, r"topk_length must be \[batch=2\] int32"),
    (dict(attn_sink=torch.zeros(5)), ValueError, r"attn_sink must be \[num_heads_q=4\] float32, got \(5,\)"),
    (dict(attn_sink=torch.zeros(4, dtype=torch.float64)), TypeError, r"attn_sink must have dtype torch.float32"),
    (dict(tile_scheduler_metadata=torch.zeros(1, 8, dtype=torch.int32)), TypeError,
     r"tile_scheduler_metadata must be the FlashMLASchedMeta of get_mla_metadata\(\) \(no arguments: FlashMLA's newer "
     r"convention\) in sparse decode \(indices\), got Tensor"),
    (dict(num_splits=torch.zeros(3, dtype=torch.int32)), TypeError, r"num_splits must be None in sparse decode"),
    (dict(causal=True), ValueError, r"causal must be False in sparse decode: indices name the keys each query token "
                                    r"sees, got True"),
    (dict(descale_k=torch.ones(1)), ValueError,
     r"descale_k must be None in sparse decode \(indices\): an fp8_ds_mla token carries its own scales"),
    (dict(extra_k_cache=torch.zeros(1)), NotImplementedError,
     r"extra_k_cache must be None in sparse decode \(indices\): a second cache .* is not supported"),
    (dict(head_dim_v=576), ValueError, r"head_dim_v must be 512 \(an int\), got 576"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_messages_name_the_argument_and_what_is_expected(changes, exc, match):
    expect(exc, match, **changes)


def test_reference_takes_float32_and_float64_and_checks_like_the_api():
    a = args()
    q, kc, idx = a["q"], a["k_cache"], a["indices"]
    base = sparse_mla_decode_reference(q, kc, idx, a["softmax_scale"], a["topk_length"], a["attn_sink"],
                                       compute_dtype=torch.float64)
    for dtype in (torch.float32, torch.float64):
        out, lse = sparse_mla_decode_reference(q.to(dtype), kc, idx, a["softmax_scale"], a["topk_length"],
                                               a["attn_sink"], compute_dtype=torch.float64)
        assert out.dtype == dtype and torch.allclose(out.float(), base[0].float(), atol=2e-2, rtol=2e-2)
        assert torch.allclose(lse, base[1], atol=1e-5)
    with pytest.raises(TypeError, match=r"q must have dtype torch.bfloat16 or torch.float32 or torch.float64 with "
                                        r"the fp8_ds_mla cache"):
        sparse_mla_decode_reference(q.half(), kc, idx)
    with pytest.raises(ValueError, match=r"indices must be \[batch=2, seqlen_q=2, topk >= 1\]"):
        sparse_mla_decode_reference(q, kc, idx[:1])
    for table in (validate.SPARSE_REFERENCE, validate.SPARSE_VALUES, validate.SPARSE, validate.DENSE_FLAGS):
        for rule in table.rules:
            assert rule.arg in table.params, rule
