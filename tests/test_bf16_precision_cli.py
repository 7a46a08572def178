"""benchmarks/bf16_precision.py on the CPU: its options, the errors for bad ones, its fp64 decode against the
package's reference, the paired report, and the exit without a GPU."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bf16_precision as bp  # noqa: E402

from flashmla_backend import flash_mla_with_kvcache, get_mla_metadata  # noqa: E402


def test_options_parse():
    a = bp.parse_args(["--heads", "16,128", "--temps", "1,2.5", "--lens", "7,64", "--repeat", "2", "--seeds", "3"])
    assert a.heads == [16, 128] and a.temps == [1.0, 2.5] and a.lens == [7, 64] and (a.repeat, a.seeds) == (2, 3)
    d = bp.parse_args([])
    assert d.heads == [16, 64, 128] and d.temps == [1.0, 3.0, 8.0] and d.lens[0] == 7 and d.lens[-1] == 6000
    assert d.scale == pytest.approx(192 ** -0.5)


@pytest.mark.parametrize("argv, words", [
    (["--heads", "16,x"], "not a comma-separated list of integers"),
    (["--heads", "0"], "every value must be a positive integer"),
    (["--temps", "-1"], "every value must be positive"),
    (["--lens", "1.5"], "not a comma-separated list of integers"),
    (["--seeds", "0"], "--repeat and --seeds must be at least 1"),
])
def test_bad_options_name_the_option(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        bp.parse_args(argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_fp64_decode_is_the_reference_on_the_same_values():
    lens = [7, 90, 130]
    q, k, table, seqlens = bp.make_batch(lens, 16, 3.0, 5, torch.device("cpu"))
    assert q.shape == (3, 1, 16, 576) and q.dtype == torch.bfloat16 and k.shape == (1 + 2 + 3, 64, 1, 576)
    assert sorted(table[table >= 0].unique().tolist()) == list(range(6))
    ref, ref_lse = bp.fp64_decode(q, k, table, lens, 192 ** -0.5)
    sched, splits = get_mla_metadata(seqlens, 16, 1)
    out, lse = flash_mla_with_kvcache(q, k, table, seqlens, 512, sched, splits, softmax_scale=192 ** -0.5, causal=True)
    # the package's reference computes in fp32 and rounds to bf16: within the output rounding of the fp64 decode
    err = bp.row_errors(out, ref)
    assert err.shape == (3 * 16,) and float(err.max()) < 4e-3
    assert float((lse.double() - ref_lse).abs().max()) < 1e-4
    # the floor: the fp64 output rounded to bf16 is as close as any bf16 output can be, on average
    assert float(bp.row_errors(ref.to(torch.bfloat16), ref).mean()) <= float(err.mean()) + 1e-6


def test_report_pairs_the_rows():
    e = {"ours": torch.tensor([1e-3, 2e-3, 4e-3, 1e-3], dtype=torch.float64),
         "flashmla": torch.tensor([2e-3, 2e-3, 2e-3, 1e-3], dtype=torch.float64),
         "floor": torch.full((4,), 5e-4, dtype=torch.float64)}
    line = bp.report(e)
    assert "ours closer on 25.0% of 4 rows" in line                # only the first row is strictly closer
    assert "mean log2(ours/flashmla) +0.000" in line               # (-1 + 0 + 1 + 0) / 4
    assert "floor mean 5.000e-04" in line


def test_without_a_gpu_it_exits_with_a_message(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        bp.main([])
    assert "needs a CUDA GPU" in str(e.value.code)
