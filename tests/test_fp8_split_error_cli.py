"""benchmarks/fp8_split_error.py on the CPU: its options, the errors for bad ones, the piece-length count it prints,
and the exit without a GPU."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fp8_split_error as split_error  # noqa: E402

from flashmla_backend import ops  # noqa: E402


def test_options_parse():
    a = split_error.parse_args(["--parts", "1,4", "--modes", "fast,accurate"])
    assert a.parts == [1, 4] and a.modes == ["fast", "accurate"]
    assert split_error.parse_args(["--parts", "0.5,0.25,2"]).parts == [0.5, 0.25, 2]  # fewer parts: longer pieces
    d = split_error.parse_args([])
    assert d.parts == [1, 2, 4, 8] and d.modes == ["accurate"]


@pytest.mark.parametrize("argv, words", [
    (["--parts", "1,x"], "not a comma-separated list of numbers"),
    (["--parts", "0"], "factors must be positive"),
    (["--parts", "-1"], "factors must be positive"),
    (["--kernels", "tensorcore"], "unrecognized arguments: --kernels"),
    (["--modes", "quick"], "choose from accurate, fast"),
])
def test_bad_options_name_the_option(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        split_error.parse_args(argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("lengths, parts, expected", [
    ([8192] * 128, 66, 128),     # whole requests: two a part
    ([8192] * 128, 264, 64),     # each request in two pieces
    ([8192] * 128, 528, 32),
    ([8192], 66, 2),             # b = 1: two-block pieces
    ([8192], 33, 4),             # b = 1 with half the parts (--parts 0.5)
    ([100, 0, 5000], 4, None),   # mixed lengths and an empty request: checked against a brute-force count
])
def test_longest_piece_follows_the_scheduler(lengths, parts, expected):
    meta, _ = ops._metadata_impl(torch.tensor(lengths, dtype=torch.int32), parts)
    got = split_error.longest_piece_blocks(meta.tolist(), lengths)
    if expected is None:   # every key of every request must lie in exactly one piece: count blocks per piece
        pieces = []
        for row in meta.tolist():
            for r in range(row[0], row[2] + 1):
                start = row[1] if r == row[0] else 0
                end = row[3] if r == row[2] else lengths[r]
                pieces.append(len(range(start // 64, -(-end // 64))))
        expected = max(pieces)
    assert got == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit on a machine without a GPU")
def test_exits_2_without_a_gpu(capsys):
    assert split_error.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
