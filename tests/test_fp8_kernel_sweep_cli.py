"""benchmarks/fp8_kernel_sweep.py on the CPU: its options, the errors for bad ones, and the exit without a GPU."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fp8_kernel_sweep as sweep  # noqa: E402


def test_options_parse():
    a = sweep.parse_args(["--debug", "0,1,4", "--modes", "fast,accurate", "--rep", "7"])
    assert a.debug == [0, 1, 4]
    assert a.modes == ["fast", "accurate"] and a.rep == [7] and not a.power
    assert sweep.parse_args([]).debug == [0] and sweep.parse_args([]).rep == [50]
    a = sweep.parse_args(["--rep", "25,100,25", "--power"])
    assert a.rep == [25, 100, 25] and a.power and a.sustain == 0
    assert sweep.parse_args(["--sustain", "1000"]).sustain == 1000


@pytest.mark.parametrize("argv, words", [
    (["--debug", "tensorcore:1"], "not a comma-separated list of integers"),
    (["--debug", "0,x"], "not a comma-separated list of integers"),
    (["--debug", "-1"], "integers >= 0"),
    (["--debug", ","], "integers >= 0"),
    (["--modes", "quick"], "unknown ['quick']"),
    (["--rep", "25ms"], "--rep: '25ms' is not a comma-separated list of integers"),
    (["--rep", "0"], "whole milliseconds >= 1"),
    (["--rep", ","], "whole milliseconds >= 1"),
    (["--sustain", "-5"], "--sustain: -5 is negative"),
    (["--sustain", "1s"], "--sustain: invalid int value"),
])
def test_bad_options_name_the_option(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        sweep.parse_args(argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit on a machine without a GPU")
def test_exits_2_without_a_gpu(capsys):
    assert sweep.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
