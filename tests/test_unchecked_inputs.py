"""Inputs the public API accepts without a check, and what they give: the behaviour README.md ("Inputs accepted
without a check") and the docstring of flash_mla_with_kvcache describe, shown on the CPU path (the reference).

- +inf / -inf in q: the row's out is NaN, like NaN in q; its lse is not finite (+inf, -inf or NaN);
- NaN in a cache slot a request reads: NaN in that request's rows, no other request touched;
- the 16-byte alignment of q / k_cache: checked on CUDA tensors only (the CPU reference reads any layout);
- a q that requires grad: the decode has no backward formula; what each path does with it.
"""
from __future__ import annotations

import math

import pytest
import torch

import flashmla_backend as fb
from flashmla_backend import ops, validate
from kit import D_V, PAGE, Case, make_inputs


def decode(inp, case, q=None, k_cache=None):
    meta, ns = fb.get_mla_metadata(inp.cache_seqlens, case.s_q * case.h_q // case.h_kv, case.h_kv)
    return fb.flash_mla_with_kvcache(inp.q if q is None else q, inp.k_cache if k_cache is None else k_cache,
                                     inp.block_table, inp.cache_seqlens, D_V, meta, ns, softmax_scale=inp.scale,
                                     causal=case.causal)


def row_mask(lse_shape, rows):
    """A [b, h_q, s_q] mask of the (request, token, head) rows."""
    mask = torch.zeros(lse_shape, dtype=torch.bool)
    for i, s, h in rows:
        mask[i, h, s] = True
    return mask


# ---- +inf / -inf in q ------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [math.inf, -math.inf], ids=["+inf", "-inf"])
def test_inf_in_q_gives_a_nan_row_with_non_finite_lse(value):
    case = Case(lengths=[100, 3, 0], s_q=4, h_q=8, h_kv=2, causal=True)
    inp = make_inputs(case)
    clean_out, clean_lse = decode(inp, case)
    q = inp.q.clone()
    rows = [(0, 1, 3), (1, 3, 0)]                 # rows that see keys
    q[0, 1, 3, 7] = value                         # one element (a latent column)
    q[1, 3, 0, 540] = value                       # one element of the rope part
    q[1, 0, 5, 2] = value                         # request 1, token 0 sees no key (3 keys, s_q 4)
    q[2, 2, 2, 9] = value                         # request 2 has no keys
    out, lse = decode(inp, case, q=q)
    for i, s, h in rows:
        assert torch.isnan(out[i, s, h]).all(), (i, s, h)
        assert not torch.isfinite(lse[i, h, s]), (i, s, h, lse[i, h, s])
    for i, s, h in [(1, 0, 5), (2, 2, 2)]:        # rows that see no key keep out 0, lse +inf
        assert (out[i, s, h] == 0).all() and torch.isposinf(lse[i, h, s])
    others = ~row_mask(lse.shape, rows)           # every other row is that of the clean q, bitwise
    assert torch.equal(lse[others], clean_lse[others])
    assert torch.equal(out.permute(0, 2, 1, 3)[others], clean_out.permute(0, 2, 1, 3)[others])


def test_inf_in_q_lse_is_inf_of_either_sign_or_nan():
    """lse follows the signs of the infinite scores: all -inf gives -inf, any +inf gives +inf, +inf and -inf in
    one score give NaN; out is NaN in all three. So lse = +inf does not mean 'no key' when out is NaN."""
    case = Case(lengths=[100], s_q=1, h_q=4, causal=False)
    inp = make_inputs(case)
    k_cache = inp.k_cache.clone()
    k_cache[..., 7] = -k_cache[..., 7].abs()      # column 7 negative in every key
    k_cache[..., 8] = k_cache[..., 8].abs()       # column 8 positive in every key
    q = inp.q.clone()
    q[0, 0, 0, 7] = math.inf                      # every score -inf
    q[0, 0, 1, 7] = -math.inf                     # every score +inf
    q[0, 0, 2, 7] = q[0, 0, 2, 8] = math.inf      # every score (-inf) + (+inf) = NaN
    out, lse = decode(inp, case, q=q, k_cache=k_cache)
    assert torch.isnan(out[0, 0, :3]).all()
    assert torch.isneginf(lse[0, 0, 0]) and torch.isposinf(lse[0, 1, 0]) and torch.isnan(lse[0, 2, 0])
    assert torch.isfinite(out[0, 0, 3]).all() and torch.isfinite(lse[0, 3, 0])


# ---- NaN in a cache slot a request reads -------------------------------------------------------------

def slot_index(inp, request: int, token: int):
    """(page, offset) of key `token` of `request` in the paged cache."""
    return int(inp.block_table[request, token // PAGE]), token % PAGE


@pytest.mark.parametrize("column", [5, 540], ids=["latent", "rope"])
@pytest.mark.parametrize("h_q", [8, 16])
def test_nan_in_a_read_cache_slot_spreads_to_that_request_only(column, h_q):
    case = Case(lengths=[100, 70], s_q=2, h_q=h_q, causal=True)
    inp = make_inputs(case)
    clean_out, clean_lse = decode(inp, case)
    k_cache = inp.k_cache.clone()
    page, off = slot_index(inp, 0, 50)             # key 50 of request 0: seen by both of its tokens
    k_cache[page, off, 0, column] = float("nan")
    out, lse = decode(inp, case, k_cache=k_cache)
    assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all()
    assert torch.equal(out[1], clean_out[1]) and torch.equal(lse[1], clean_lse[1])


def test_nan_in_one_kv_head_of_a_slot_reaches_that_heads_query_heads_only():
    case = Case(lengths=[100, 70], s_q=1, h_q=8, h_kv=2, causal=True)
    inp = make_inputs(case)
    clean_out, clean_lse = decode(inp, case)
    k_cache = inp.k_cache.clone()
    page, off = slot_index(inp, 0, 50)
    k_cache[page, off, 1, 5] = float("nan")      # KV head 1: query heads 4..7
    out, lse = decode(inp, case, k_cache=k_cache)
    assert torch.isnan(out[0, :, 4:]).all() and torch.isnan(lse[0, 4:]).all()
    assert torch.equal(out[0, :, :4], clean_out[0, :, :4]) and torch.equal(lse[0, :4], clean_lse[0, :4])
    assert torch.equal(out[1], clean_out[1]) and torch.equal(lse[1], clean_lse[1])


@pytest.mark.parametrize("column", [5, 540], ids=["latent", "rope"])
def test_nan_in_a_slot_hidden_by_the_causal_mask(column):
    """Key 99 of a 100-key request with s_q 2 is seen by token 1 only: token 1's out and lse are NaN. Token 0's lse is
    unchanged; its out too, except that the P V product multiplies the hidden key's value row by a probability of 0,
    and 0 x NaN = NaN: a NaN in the slot's first 512 columns (the value part) is NaN in that column of token 0's out."""
    case = Case(lengths=[100], s_q=2, h_q=8, causal=True)
    inp = make_inputs(case)
    clean_out, clean_lse = decode(inp, case)
    k_cache = inp.k_cache.clone()
    page, off = slot_index(inp, 0, 99)
    k_cache[page, off, 0, column] = float("nan")
    out, lse = decode(inp, case, k_cache=k_cache)
    assert torch.isnan(out[0, 1]).all() and torch.isnan(lse[0, :, 1]).all()
    assert torch.equal(lse[0, :, 0], clean_lse[0, :, 0])
    nan_columns = [column] if column < D_V else []
    assert torch.nonzero(torch.isnan(out[0, 0]).any(0)).flatten().tolist() == nan_columns
    keep = [d for d in range(D_V) if d not in nan_columns]
    assert torch.equal(out[0, 0][:, keep], clean_out[0, 0][:, keep])


def test_nan_in_slots_a_request_does_not_read_changes_nothing():
    """Past a request's length, in its last page and in pages it does not use (kit.make_inputs fills all of
    these with NaN already; here also the slot right after the last key)."""
    case = Case(lengths=[100, 64], s_q=2, h_q=8, causal=True)
    inp = make_inputs(case)
    clean_out, clean_lse = decode(inp, case)
    k_cache = inp.k_cache.clone()
    page, off = slot_index(inp, 0, 100)
    k_cache[page, off] = float("nan")
    out, lse = decode(inp, case, k_cache=k_cache)
    assert torch.equal(out, clean_out) and torch.equal(lse, clean_lse)
    assert not torch.isnan(out).any()


# ---- 16-byte alignment: a GPU check only ---------------------------------------------------------------

def misaligned(t: torch.Tensor, elements: int) -> torch.Tensor:
    """A copy of t whose data starts `elements` elements past an aligned allocation."""
    flat = torch.empty(t.numel() + elements, dtype=t.dtype)
    view = flat[elements:].view(t.shape)
    view.copy_(t)
    return view


def wide_rows(t: torch.Tensor) -> torch.Tensor:
    """A copy of t as a slice of rows one element wider (strides not a multiple of 8 elements)."""
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype)
    wide[..., :-1] = t
    return wide[..., :-1]


@pytest.mark.parametrize("what", ["q offset", "q strides", "k_cache offset"])
def test_alignment_is_checked_on_cuda_tensors_only(what, monkeypatch):
    case = Case(lengths=[100, 30], s_q=1, h_q=8)
    inp = make_inputs(case)
    q, k_cache = inp.q, inp.k_cache
    if what == "q offset":
        q = misaligned(q, 1)
    elif what == "q strides":
        q = wide_rows(q)
    else:
        k_cache = misaligned(k_cache, 3)
    # the CPU path takes it and gives the aligned tensors' result, bitwise
    want = decode(inp, case)
    got = decode(inp, case, q=q, k_cache=k_cache)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # the check the CUDA path runs refuses it, naming the argument
    name = what.split()[0]
    with pytest.raises(ValueError, match=rf"{name}'s (data pointer must be 16-byte aligned|strides must be multiples)"):
        validate.check_kernel_layout(q, k_cache)
    # a fresh contiguous copy meets it (.contiguous() alone keeps a contiguous tensor's misaligned start)
    validate.check_kernel_layout(q.clone(memory_format=torch.contiguous_format),
                                 k_cache.clone(memory_format=torch.contiguous_format))

    # and the CUDA path runs that check before anything else, while the CPU path never calls it
    class Checked(Exception):
        pass

    def refuse(*args, **kwargs):
        raise Checked

    monkeypatch.setattr(validate, "check_kernel_layout", refuse)
    decode(inp, case, q=q, k_cache=k_cache)
    shapes = validate.Shapes(case.b, 1, 8, 1, k_cache.shape[0], inp.block_table.shape[1], 1)
    with pytest.raises(Checked):
        ops._decode_cuda(q, k_cache, inp.block_table, inp.cache_seqlens, None, None, inp.scale, True, shapes)


# ---- a q that requires grad -----------------------------------------------------------------------------

def test_q_requiring_grad_on_the_cpu_path_runs_the_reference_with_autograd():
    """Eager CPU call: the result of a detached q, with the PyTorch reference's autograd history on it."""
    case = Case(lengths=[100, 30], s_q=2, h_q=8)
    inp = make_inputs(case)
    want = decode(inp, case)
    q = inp.q.clone().requires_grad_()
    out, lse = decode(inp, case, q=q)
    assert out.requires_grad and lse.requires_grad
    assert torch.equal(out.detach(), want[0]) and torch.equal(lse.detach(), want[1])
    out.float().sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape and bool(torch.isfinite(q.grad).all())
    assert bool((q.grad != 0).any())
    with torch.no_grad():
        out2, lse2 = decode(inp, case, q=q)
    assert not out2.requires_grad and not lse2.requires_grad and torch.equal(out2, want[0])
    with torch.inference_mode():
        out3, _ = decode(inp, case, q=q)
    assert not out3.requires_grad and torch.equal(out3, want[0])


def test_q_requiring_grad_through_the_custom_op_has_no_backward():
    """torch.ops.flashmla_backend.mla_decode (what torch.compile sees): the forward runs, backward raises."""
    case = Case(lengths=[100, 30], s_q=1, h_q=8)
    inp = make_inputs(case)
    meta, ns = fb.get_mla_metadata(inp.cache_seqlens, 8, 1)
    q = inp.q.clone().requires_grad_()
    out, lse = torch.ops.flashmla_backend.mla_decode(q, inp.k_cache, inp.block_table, inp.cache_seqlens, meta, ns,
                                                     inp.scale, True)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.float().sum().backward()


@pytest.mark.filterwarnings("ignore:Error detected in GeneratedBackward:UserWarning")  # autograd names the op
def test_q_requiring_grad_under_torch_compile_fails_to_compile():
    case = Case(lengths=[33, 100], s_q=1, h_q=8)
    inp = make_inputs(case)
    meta, ns = fb.get_mla_metadata(inp.cache_seqlens, 8, 1)

    def step(q):
        return fb.flash_mla_with_kvcache(q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, ns,
                                         softmax_scale=inp.scale, causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="no autograd formula"):
        compiled(inp.q.clone().requires_grad_())
    got = compiled(inp.q)                          # the same function on a q without grad compiles and runs
    want = step(inp.q)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_q_requiring_grad_on_the_kernel_path_gives_outputs_without_grad(monkeypatch):
    """The eager CUDA path allocates out and lse itself and has the kernel write them through pointers: they do not
    require grad, and no gradient reaches q. Run on the CPU as tests/test_build.py runs that path: the extension,
    the device queries and the layout check replaced by stand-ins, _decode_cuda called with CPU tensors."""
    import types

    calls = []
    fake = types.SimpleNamespace(DecodeArgs=types.SimpleNamespace, mla_decode=calls.append)
    monkeypatch.setattr(ops._ext, "ext", lambda: fake)
    monkeypatch.setattr(ops.device, "kernel_for", lambda dev: "sm90")
    monkeypatch.setattr(ops.device, "device_props", lambda index: types.SimpleNamespace(major=9, minor=0))
    monkeypatch.setattr(ops, "_raw_stream", lambda dev: 0)
    case = Case(lengths=[100, 30], s_q=1, h_q=8)
    inp = make_inputs(case)
    meta, ns = fb.get_mla_metadata(inp.cache_seqlens, 8, 1)
    q = inp.q.clone().requires_grad_()
    shapes = validate.shapes_of(q, inp.k_cache, inp.block_table, meta)
    out, lse = ops._decode_cuda(q, inp.k_cache, inp.block_table, inp.cache_seqlens, meta, ns, inp.scale, True, shapes)
    assert len(calls) == 1 and calls[0].q == q.data_ptr()
    assert not out.requires_grad and not lse.requires_grad and out.grad_fn is None
