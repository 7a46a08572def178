"""FP8 KV cache kernels (sm_90a) against fp64 attention on the dequantized inputs (GPU only).

Accurate mode (bf16/fp16 q, e4m3 cache) and fast mode (e4m3 q and cache): NaN in every unused cache slot,
huge ids in unused block-table entries, lengths 0 and non-multiples of 64, s_q up to 16 causal, h_kv 1 and 2;
bitwise repeatability; CUDA-graph replays that read a descale_k changed after capture.
"""
import pytest
import torch

import flashmla_backend as fb
from flashmla_backend import device as fdevice
from fp8kit import dequantized, fp8_inputs
from kit import D_V, Case, brute_force_fp64

pytestmark = pytest.mark.gpu

ACCURATE_OUT = 1e-2   # ||out - ref|| / ||ref|| vs fp64 on the dequantized cache (measured ~1.7e-3: bf16 output)
ACCURATE_LSE = 2e-3   # relative norm of lse (measured ~4e-8)
FAST_OUT = 1e-2       # vs fp64 on the dequantized e4m3 q and cache (measured ~1.7e-3)

CASES = [
    Case(lengths=[100, 300], h_q=16),
    Case(lengths=[64, 1000, 0], h_q=128),
    Case(lengths=[1, 65, 700, 4000], s_q=2, h_q=128, h_kv=2),
    Case(lengths=[5, 16, 17, 640, 3000], s_q=16, h_q=32),
    Case(lengths=[0, 16, 129, 640, 3000], s_q=4, h_q=64, causal=False),
    Case(lengths=[8192], h_q=128),
    Case(lengths=[37 * i % 2100 for i in range(40)], h_q=16, seed=3),
]


@pytest.fixture(autouse=True)
def _sm90(monkeypatch):
    if fdevice.kernel_for(torch.device("cuda")) != "sm90":
        pytest.skip("the FP8 kernels are sm_90a only")


def _rel(a, b):
    m = torch.isfinite(b)
    return ((a.double().cpu()[m] - b[m]).norm() / b[m].norm().clamp_min(1e-30)).item()


def _run(inp, case, dq, dk):
    meta, splits = fb.get_mla_metadata(inp.cache_seqlens, case.s_q * case.h_q // case.h_kv, case.h_kv,
                                       is_fp8_kvcache=True)
    return fb.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, splits,
                                     softmax_scale=inp.scale, causal=case.causal, descale_q=dq, descale_k=dk)


@pytest.mark.parametrize("mode", ["bf16q", "fp16q", "e4m3q"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_fp8_decode_matches_fp64(case, mode):
    q_dtype = torch.float16 if mode == "fp16q" else torch.bfloat16
    case = Case(**{**case.__dict__, "dtype": q_dtype})
    inp, dq, dk = fp8_inputs(case, "cuda", q_fp8=mode == "e4m3q", k_gain=0.7)
    out, lse = _run(inp, case, dq, dk)
    out2, lse2 = _run(inp, case, dq, dk)
    assert torch.equal(out.view(torch.int16), out2.view(torch.int16)) and torch.equal(lse, lse2), "not deterministic"
    assert out.dtype == (torch.bfloat16 if mode == "e4m3q" else q_dtype)
    assert not torch.isnan(out).any()
    ref_out, ref_lse = brute_force_fp64(dequantized(inp, dq, dk), case.causal)
    e_out, e_lse = _rel(out, ref_out), _rel(lse, ref_lse)
    print(f"{case} {mode}: out {e_out:.2e} lse {e_lse:.2e}")
    assert e_out < (FAST_OUT if mode == "e4m3q" else ACCURATE_OUT)
    assert e_lse < ACCURATE_LSE
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(ref_lse))


def test_graph_replay_reads_the_current_descale():
    case = Case(lengths=[300, 1500], s_q=2, h_q=128)
    inp, _, dk = fp8_inputs(case, "cuda")
    descale = dk.clone()
    _run(inp, case, None, descale)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _run(inp, case, None, descale)
        with torch.cuda.graph(g, stream=s):
            out, lse = _run(inp, case, None, descale)
    torch.cuda.current_stream().wait_stream(s)
    descale.mul_(1.75)
    g.replay()
    torch.cuda.synchronize()
    want_out, want_lse = _run(inp, case, None, descale)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
