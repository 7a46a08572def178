"""q in two parts (flash_mla_with_kvcache's q_pe): the latent part and the rope part read in place.

Engines hold the decode query as two tensors (vLLM: ql_nope, the transposed output of a batched matmul, and
q_pe, a slice of the projected query). The kernels read both through their own pointers and strides; the result
must be bitwise the one of the concatenated query, on every kernel and cache format.
"""
import pytest
import torch

import flashmla_backend as fb
from flashmla_backend import device as fdevice
from fp8kit import fp8_inputs, sm90_fp8_problem
from kit import D_K, D_V, Case, make_inputs

ROPE = D_K - D_V


def engine_layout(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, s_q, h, 576] -> (latent [b, s_q, h, 512], rope [b, s_q, h, 64]) in vLLM's memory layout: the latent
    part head-major (stride of a token 512, of a head T * 512), the rope part a slice of a wider buffer."""
    b, s_q, h, _ = q.shape
    t = b * s_q
    latent = torch.empty((h, t, D_V), dtype=q.dtype, device=q.device)
    latent.copy_(q[..., :D_V].reshape(t, h, D_V).transpose(0, 1))
    wide = torch.full((t, h, 128 + ROPE), float("nan"), dtype=torch.float32, device=q.device).to(q.dtype)
    wide[..., 128:] = q[..., D_V:].reshape(t, h, ROPE)
    return latent.transpose(0, 1).reshape(b, s_q, h, D_V), wide[..., 128:].reshape(b, s_q, h, ROPE)


def _run(inp, descale_q=None, descale_k=None, split=False):
    meta, splits = fb.get_mla_metadata(inp.cache_seqlens, inp.q.shape[1] * inp.q.shape[2] // inp.k_cache.shape[2],
                                       inp.k_cache.shape[2])
    q, q_pe = engine_layout(inp.q) if split else (inp.q, None)
    return fb.flash_mla_with_kvcache(q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, splits,
                                     softmax_scale=inp.scale, causal=True, descale_q=descale_q, descale_k=descale_k,
                                     q_pe=q_pe)


def test_engine_layout_is_not_contiguous():
    inp = make_inputs(Case(lengths=[70, 5], s_q=2, h_q=16))
    latent, rope = engine_layout(inp.q)
    assert not latent.is_contiguous() and not rope.is_contiguous()
    assert torch.equal(torch.cat([latent, rope], dim=-1), inp.q)


def test_two_parts_equal_one_query_on_cpu():
    inp = make_inputs(Case(lengths=[70, 5, 0, 300], s_q=2, h_q=16))
    one, two = _run(inp), _run(inp, split=True)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_q_pe_refused_with_a_sched_meta_object():
    inp = make_inputs(Case(lengths=[70, 5], h_q=16))
    meta, _ = fb.get_mla_metadata()
    q, q_pe = engine_layout(inp.q)
    with pytest.raises(TypeError, match="q_pe works with the tensors of get_mla_metadata"):
        fb.flash_mla_with_kvcache(q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, q_pe=q_pe)


def _misaligned(q_pe):
    wide = torch.zeros((*q_pe.shape[:-1], ROPE + 8), dtype=q_pe.dtype, device=q_pe.device)
    return wide[..., 4:4 + ROPE]  # 8 bytes past a 16-byte boundary


def _odd_stride(q_pe):
    wide = torch.zeros((*q_pe.shape[:-1], ROPE + 4), dtype=q_pe.dtype, device=q_pe.device)
    return wide[..., :ROPE]  # head stride 68 elements: not a multiple of 16 bytes


@pytest.mark.gpu
@pytest.mark.parametrize("make,match", [(_misaligned, "q_pe's data pointer must be 16-byte aligned"),
                                        (_odd_stride, "q_pe's strides must be multiples of 8 elements")])
def test_kernel_layout_of_q_pe_is_checked(make, match):
    inp = make_inputs(Case(lengths=[70, 5], h_q=16), "cuda")
    q, q_pe = engine_layout(inp.q)
    meta, splits = fb.get_mla_metadata(inp.cache_seqlens, inp.q.shape[1] * inp.q.shape[2], 1)
    with pytest.raises(ValueError, match=match):
        fb.flash_mla_with_kvcache(q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, splits,
                                  softmax_scale=inp.scale, causal=True, q_pe=make(q_pe))


def _kernels():
    if not torch.cuda.is_available():
        return ["portable", "sm90"]
    from flashmla_backend import _ext

    kernels = ["portable"]
    if fdevice.device_props(torch.cuda.current_device()).major == 9 and _ext.ext().sm90_compiled():
        kernels.append("sm90")
    return kernels


GPU_CASES = [
    Case(lengths=[1, 64, 65, 700, 3000], h_q=128),
    Case(lengths=[0, 16, 129, 2000], s_q=4, h_q=16, h_kv=2, seed=2),
    Case(lengths=[37 * i % 2100 for i in range(33)], s_q=2, h_q=32, seed=3, dtype=torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", _kernels())
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_two_parts_bitwise_equal_one_query(kernel, case, monkeypatch):
    monkeypatch.setenv(fdevice.KERNEL_ENV, kernel)
    inp = make_inputs(case, "cuda")
    one, two = _run(inp), _run(inp, split=True)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@pytest.mark.gpu
@pytest.mark.parametrize("q_fp8", [False, True], ids=["accurate", "fast"])
@pytest.mark.parametrize("case", GPU_CASES[:2], ids=str)
def test_two_parts_bitwise_equal_one_query_fp8_cache(case, q_fp8):
    problem = sm90_fp8_problem()
    if problem:
        pytest.skip(problem)
    inp, descale_q, descale_k = fp8_inputs(case, "cuda", q_fp8=q_fp8)
    one, two = _run(inp, descale_q, descale_k), _run(inp, descale_q, descale_k, split=True)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
