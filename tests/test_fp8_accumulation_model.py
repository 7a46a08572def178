"""benchmarks/fp8_accumulation_model.py (CPU): the accumulator model behaves as its docstring says."""
import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fp8_accumulation_model.py"


@pytest.fixture(scope="module")
def mod():
    spec = importlib.util.spec_from_file_location("fp8_accumulation_model", SCRIPT)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_keep_bits_truncates_toward_zero(mod):
    x = torch.tensor([1.0 + 2.0 ** -10, -(1.0 + 2.0 ** -10), 3.0, 0.0], dtype=torch.float64)
    assert mod.keep_bits(x, 24).tolist() == x.tolist()
    assert mod.keep_bits(x, 8).tolist() == [1.0, -1.0, 3.0, 0.0]


def test_q_split_recovers_q(mod):
    q = torch.randn(4, mod.D, dtype=torch.float64)
    inv, (hi, lo) = mod.split_rows(q)
    assert torch.all((q.abs().amax(-1, keepdim=True) * inv > 224) & (q.abs().amax(-1, keepdim=True) * inv <= 448))
    # two e4m3 terms: about 8 bits of precision (each term 4), against 4 for one term
    two, one = ((hi + lo) / inv - q).abs().max(), (hi / inv - q).abs().max()
    assert two < 2.0 ** -7 * q.abs().max() and two < one / 4


def _errors(mod, bits, keys=256, rows=8):
    q, k, dk, scale, ref = mod.make_inputs(keys, rows, 0)
    return [((mod.model(q, k, dk, scale, bits, pv, qk) - ref).norm() / ref.norm()).item()
            for pv, qk in ((False, False), (True, False), (True, True))]


def test_fewer_accumulator_bits_cost_accuracy_and_promotion_recovers_it(mod):
    full, short = _errors(mod, 24), _errors(mod, 12)
    assert max(full) < 2e-3                      # the two-term split with exact accumulation
    assert short[0] > 3 * full[0]                # a 12-bit accumulator chain is visibly worse
    assert short[1] < short[0] and short[2] <= short[1] * 1.01


def test_fp16_p_v_removes_the_p_v_losses_and_q_k_promotion_the_rest(mod):
    q, k, dk, scale, ref = mod.make_inputs(512, 8, 0)

    def err(bits, pv, qk, f16):
        return ((mod.model(q, k, dk, scale, bits, pv, qk, 1, f16) - ref).norm() / ref.norm()).item()

    chain_full, f16_full = err(24, False, False, False), err(24, False, False, True)
    assert f16_full < chain_full        # fp16 P (11 bits) against the two-term e4m3 P (about 8)
    f16_short, f16_qk_short, chain_short = err(12, False, False, True), err(12, False, True, True), err(12, False,
                                                                                                       False, False)
    assert f16_short < chain_short        # P V no longer loses to the short accumulator
    assert f16_qk_short < f16_short / 2   # what is left is mostly Q K^T's chain: promoted per q term it halves


def test_promoting_less_often_lies_between(mod):
    q, k, dk, scale, ref = mod.make_inputs(512, 8, 0)
    err = {n: ((mod.model(q, k, dk, scale, 12, True, False, n) - ref).norm() / ref.norm()).item() for n in (1, 4, 8)}
    chain = ((mod.model(q, k, dk, scale, 12, False, False) - ref).norm() / ref.norm()).item()
    assert err[1] < err[4] < chain and abs(err[8] - chain) < 1e-12   # every 8 blocks = the whole 512-key split


def test_cli_refuses_bad_arguments(mod, capsys):
    for argv, message in ((["--promote-every", "0"], "--promote-every must be positive"),
                          (["--keys", "100"], "--keys must be a positive multiple of 64"),
                          (["--rows", "0"], "--rows must be positive"),
                          (["--bits", "x"], "--bits must be comma-separated integers"),
                          (["--bits", "60"], "--bits: each between 4 and 52")):
        with pytest.raises(SystemExit) as e:
            mod.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
