"""The reference (flashmla_backend.reference) against brute-force fp64 attention, on the CPU."""
import pytest
import torch

from flashmla_backend.reference import mla_decode_reference
from kit import Case, brute_force_fp64, compare, make_inputs

CASES = [
    Case(lengths=[1], s_q=1, h_q=1),
    Case(lengths=[20, 0, 65], s_q=1, h_q=16, causal=False),
    Case(lengths=[63, 64, 140], s_q=2, h_q=8, h_kv=2),
    Case(lengths=[3, 130], s_q=4, h_q=3, causal=True),             # causal rows with no visible key (n=3 < s_q)
    Case(lengths=[0, 0], s_q=2, h_q=4),                            # all empty
    Case(lengths=[200, 5], s_q=16, h_q=2, causal=True, dtype=torch.float16),
    Case(lengths=[129], s_q=3, h_q=6, h_kv=3, causal=False, dtype=torch.float16),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_brute_force(case):
    inp = make_inputs(case)
    out, lse = mla_decode_reference(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512, inp.scale,
                                    case.causal)
    assert out.dtype == case.dtype and lse.dtype == torch.float32
    ref_out, ref_lse = brute_force_fp64(inp, case.causal)
    compare(out, lse, ref_out, ref_lse, case.lengths, case.s_q, case.causal)


def test_reference_in_fp64_is_exact_to_brute_force():
    case = Case(lengths=[70, 1, 0], s_q=2, h_q=4, h_kv=2)
    inp = make_inputs(case)
    out, lse = mla_decode_reference(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512, inp.scale, True,
                                    compute_dtype=torch.float64)
    ref_out, ref_lse = brute_force_fp64(inp, True)
    seen = torch.isfinite(ref_lse)
    assert torch.allclose(lse.double()[seen], ref_lse[seen], rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))


def test_brute_force_detects_a_wrong_scale():
    """The comparison must fail when the attention is wrong (a check that cannot fail proves nothing)."""
    case = Case(lengths=[100, 37], s_q=1, h_q=8)
    inp = make_inputs(case)
    out, lse = mla_decode_reference(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512, inp.scale * 1.1,
                                    case.causal)
    ref_out, ref_lse = brute_force_fp64(inp, case.causal)
    with pytest.raises(AssertionError):
        compare(out, lse, ref_out, ref_lse, case.lengths, case.s_q, case.causal)
