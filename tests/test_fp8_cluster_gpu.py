"""The FP8 tensor-core kernel's 2-CTA cluster plans (sm_90a, GPU only), chosen with FLASHMLA_BACKEND_FP8_DEBUG while
they are measured, both in the fast mode: bit 8, two M tiles of a request as one cluster, each CTA transposing one V^T
half and copying it to the other (csrc/sm90/decode_fp8/producer.cuh, Traits::kShareVt); bit 8192, pairs of M tiles as
clusters whose KV blocks are TMA-multicast into both CTAs (Traits::kMulticastKv). The accurate mode has no cluster
plan (its 2-CTA plan sharing the V widening was measured 1.4x slower and removed: docs/kernel-design.md).

The plans change who writes the V^T halves or the KV stages, not a value in them or the order of any sum, so their
output and lse must be bitwise those of the one-CTA plan (which tests/test_fp8_gpu.py holds against fp64) on every
shape they serve: one query token at h_q / h_kv = 128, a non-causal s_q 2 at 64 heads, h_kv 2, lengths 0, 1, 63, 64,
65 (odd block counts: the virtual block), many requests per scheduler part, and the 8192-key request (the multicast
plan also four M tiles: a causal s_q 2 at 128 heads, each pair within one query token); and the kernel that ran must
be the cluster one (its name in the profiler carries the plan's traits).
"""
import re

import pytest
import torch

from fp8kit import fp8_inputs, run_fp8_decode, sm90_fp8_problem
from kit import Case

pytestmark = pytest.mark.gpu

CLUSTER_FLAG = "8"   # kDebugClusterPlan in csrc/sm90/decode_fp8/decode.h
MULTICAST_FLAG = "8192"   # kDebugMulticastKv
PLAN_FLAGS = {"shared_vt": CLUSTER_FLAG, "multicast": MULTICAST_FLAG}
# The last four Traits arguments (kShareVt, kPvF16, kStackedTerms, kMulticastKv) in the profiler's kernel name, after
# the producer's 88 registers.
PLAN_TRAITS = {CLUSTER_FLAG: r"88,\s*true,\s*false,\s*false,\s*false\s*>",
               MULTICAST_FLAG: r"88,\s*false,\s*false,\s*false,\s*true\s*>"}
# The accurate mode's 64-row tile (producer on 56 registers, kPvF16 true, one CTA).
ACCURATE_ONE_CTA = r"56,\s*false,\s*true,\s*false,\s*false\s*>"

CASES = [
    Case(lengths=[64, 1000, 0], h_q=128),
    Case(lengths=[8192], h_q=128),
    Case(lengths=[1, 63, 64, 65, 129, 3000], h_q=128, seed=1),
    Case(lengths=[37 * i % 2100 for i in range(40)], h_q=128, seed=3),
    Case(lengths=[100, 700, 2500], s_q=2, h_q=64, causal=False, seed=2),
    Case(lengths=[300, 5000], h_q=256, h_kv=2, seed=4),
]
# Four M tiles, pairs within one query token: the multicast plan only.
MULTICAST_ONLY = [
    Case(lengths=[1, 65, 700, 4100], s_q=2, h_q=128, seed=5),
    Case(lengths=[3000], s_q=4, h_q=128, seed=6),
]


@pytest.fixture(autouse=True)
def _sm90():
    problem = sm90_fp8_problem()
    if problem:
        pytest.skip(problem)


def _kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages() if "fp8_decode_kernel" in e.key]


@pytest.mark.parametrize("flag, case", [pytest.param(f, c, id=f"{name}-{c}") for name, f in PLAN_FLAGS.items()
                                         for c in CASES]
                         + [pytest.param(MULTICAST_FLAG, c, id=f"multicast-{c}") for c in MULTICAST_ONLY])
def test_cluster_plan_is_bitwise_the_one_cta_plan(flag, case, monkeypatch):
    inp, dq, dk = fp8_inputs(case, "cuda", q_fp8=True, k_gain=0.7)
    monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", "0")
    out, lse = run_fp8_decode(inp, case, dq, dk)
    one_cta = _kernel_names(lambda: run_fp8_decode(inp, case, dq, dk))
    monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", flag)
    out_c, lse_c = run_fp8_decode(inp, case, dq, dk)
    out_c2, lse_c2 = run_fp8_decode(inp, case, dq, dk)
    cluster = _kernel_names(lambda: run_fp8_decode(inp, case, dq, dk))
    print(f"{case}: one-CTA kernel {one_cta}, cluster kernel {cluster}")
    # The one-CTA plan's traits have no true argument; the cluster plan's kShareVt or kMulticastKv is true.
    assert one_cta and all("true" not in k for k in one_cta), one_cta
    assert cluster and all(re.search(PLAN_TRAITS[flag], k) for k in cluster), cluster
    assert not torch.isnan(out_c).any()
    assert torch.equal(out_c.view(torch.int16), out_c2.view(torch.int16)) and torch.equal(lse_c, lse_c2)
    assert torch.equal(out_c.view(torch.int16), out.view(torch.int16)), (
        f"max |diff| {(out_c.float() - out.float()).abs().max().item():.3g}")
    assert torch.equal(lse_c, lse)


@pytest.mark.parametrize("flag", PLAN_FLAGS.values(), ids=PLAN_FLAGS.keys())
def test_cluster_flag_leaves_other_shapes_on_their_plan(flag, monkeypatch):
    """One M tile (16 heads) and two tiles of different query tokens (s_q 2 causal at 64 heads) take neither cluster
    plan; four M tiles (s_q 2 causal at 128 heads) do not take the shared transposition's."""
    monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", flag)
    cases = [Case(lengths=[300, 1500], h_q=16), Case(lengths=[300, 1500], s_q=2, h_q=64)]
    if flag == CLUSTER_FLAG:
        cases.append(Case(lengths=[300, 1500], s_q=2, h_q=128))
    for case in cases:
        inp, dq, dk = fp8_inputs(case, "cuda", q_fp8=True)
        names = _kernel_names(lambda: run_fp8_decode(inp, case, dq, dk))
        assert names and all("true" not in k for k in names), (str(case), names)


def test_cluster_flag_leaves_the_accurate_mode_on_one_cta(monkeypatch):
    """Bit 8 in the accurate mode: two and four M tiles (h_q 128, s_q 1 and 2) run the one-CTA 64-row tile."""
    monkeypatch.setenv("FLASHMLA_BACKEND_FP8_DEBUG", CLUSTER_FLAG)
    for case in [Case(lengths=[300, 1500], h_q=128), Case(lengths=[300, 1500], s_q=2, h_q=128)]:
        inp, _, dk = fp8_inputs(case, "cuda", q_fp8=False)
        names = _kernel_names(lambda: run_fp8_decode(inp, case, None, dk))
        assert names and all(re.search(ACCURATE_ONE_CTA, k) for k in names), (str(case), names)
