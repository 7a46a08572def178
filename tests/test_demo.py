"""`python -m flashmla_backend` (the demo) on a machine without a GPU: what it compares, its options."""
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import flashmla_backend.__main__ as demo
from flashmla_backend import _ext, ops, reference

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--device", "cpu", "--batch", "3", "--seqlen", "100", "--heads", "4,20", "--seqlen-q", "2"]


def test_cpu_demo_compares_with_the_naive_decode(capsys):
    assert demo.main(SMALL) == 0
    out = capsys.readouterr().out
    assert "against the naive gather-matmul decode" in out
    for h in (4, 20):  # the shapes asked for, not the demo's own
        assert f"b=3 s_k=100 h_q={h} s_q=2 on cpu: vs naive decode: out rel err" in out
    assert out.rstrip().endswith("ok")


def test_cpu_demo_says_it_timed_nothing(capsys):
    assert demo.main(SMALL) == 0
    out = capsys.readouterr().out
    assert "timed nothing: on the CPU the demo checks results only" in out
    assert " us," not in out and "GB/s" not in out and "TFLOP/s" not in out


def test_cpu_demo_detects_a_wrong_reference(monkeypatch, capsys):
    """The second implementation is independent of the reference: a wrong reference (wherever it is called from:
    the API's CPU path and mla_decode_reference) must fail the demo."""
    right = ops.reference_decode

    def wrong(*args, **kwargs):
        out, lse = right(*args, **kwargs)
        return out * 1.1, lse

    monkeypatch.setattr(ops, "reference_decode", wrong)
    monkeypatch.setattr(reference, "reference_decode", wrong)
    assert demo.main(SMALL) == 1
    assert "error: relative error" in capsys.readouterr().err


def test_cpu_demo_caps_large_shapes_and_says_why(monkeypatch, capsys):
    monkeypatch.setattr(demo, "CPU_MAX_SCORES", 1000)
    assert demo.main(["--device", "cpu", "--batch", "4", "--seqlen", "100", "--heads", "4"]) == 0
    out = capsys.readouterr().out
    assert "note: on the CPU, batch x seqlen x seqlen_q x heads is capped at 1000 scores" in out
    assert "host memory" in out and "running b=4 s_k=62 instead of b=4 s_k=100" in out
    assert "b=4 s_k=62 h_q=4 s_q=1 on cpu" in out


def test_cpu_shapes():
    assert demo.cpu_shapes(32, 4096, 1, [128, 16]) == (32, 4096, "")   # the GPU defaults fit
    b, n, note = demo.cpu_shapes(10**6, 10**6, 4, [128])
    assert b * n * 4 * 128 <= demo.CPU_MAX_SCORES and b >= 1 and n >= 1 and note


@pytest.mark.parametrize("argv,option", [
    (["--batch", "-1"], "--batch"), (["--batch", "0"], "--batch"), (["--batch", "2.5"], "--batch"),
    (["--seqlen", "0"], "--seqlen"), (["--seqlen", "x"], "--seqlen"), (["--seqlen-q", "0"], "--seqlen-q"),
    (["--heads", "7x"], "--heads"), (["--heads", "0"], "--heads"), (["--heads", "-16"], "--heads"),
    (["--heads", "16,"], "--heads"), (["--heads", ""], "--heads"), (["--device", "tpu"], "--device"),
])
def test_bad_options_are_usage_errors(argv, option, capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m flashmla_backend") and f"argument {option}" in err
    assert "Traceback" not in err


def test_bad_option_from_the_command_line():
    res = subprocess.run([sys.executable, "-m", "flashmla_backend", "--heads", "7x"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "usage:" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_help_describes_every_option(capsys):
    ap = demo.parser()
    with pytest.raises(SystemExit) as e:
        ap.parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for action in ap._actions:
        assert action.help, f"{action.option_strings} has no help"
        for opt in action.option_strings:
            assert opt in text
    assert "naive_mla_decode" in text and "CPU_MAX_SCORES = " in text


@pytest.mark.parametrize("version,text", [(13000, "13.0"), (12080, "12.8"), (12090, "12.9"), (13010, "13.1")])
def test_cuda_version_text(version, text):
    assert demo.cuda_version_text(version) == text


def test_runtime_printed_as_major_minor(monkeypatch, capsys):
    fake = types.SimpleNamespace(__file__="_C.so", cuda_archs="80;90a", cuda_runtime_version=13000,
                                 sm90_compiled=lambda: True)
    monkeypatch.setattr(_ext, "available", lambda: True)
    monkeypatch.setattr(_ext, "ext", lambda: fake)
    if torch.cuda.is_available():
        pytest.skip("prints the real device")
    assert demo.main(["--device", "cpu", "--batch", "1", "--seqlen", "10", "--heads", "2"]) == 0
    out = capsys.readouterr().out
    assert "CUDA runtime 13.0," in out and "13000" not in out
