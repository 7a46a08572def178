"""The two-term e4m3 split of a 16-bit q (csrc/sm90/decode_fp8/q_tile.cuh: split_e4m3x2), modeled on the CPU.

Both FP8 kernels that take a 16-bit q (the dense accurate mode and the sparse kernel) write y = q / s as
hi = e4m3(y) and lo = e4m3(y - hi). The kernels take y - hi in fp16 instead of fp32 (fewer instructions), which the
header says gives the same lo for every bf16 and fp16 value at every power-of-two scale, but for the sign of a zero
lo. This test plays both forms with torch's round-to-nearest e4m3 and 16-bit conversions over every finite 16-bit
value and scale.
"""
import pytest
import torch

E4M3_MAX = 448.0


def _mismatches(dtype: torch.dtype, detour: torch.dtype) -> tuple[int, int]:
    """(values x scales compared, lo terms that differ beyond a zero's sign) between the fp32 difference and the
    difference taken in `detour` (y and hi rounded to it, subtracted there)."""
    x = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(dtype).float()
    x = x[torch.isfinite(x) & (x != 0)]
    compared = wrong = 0
    for k in range(-140, 141):  # every power-of-two scale under which some 16-bit value lands in [-448, 448]
        y = x * 2.0 ** k
        y = y[y.abs() <= E4M3_MAX]
        if y.numel() == 0:
            continue
        hi = y.to(torch.float8_e4m3fn).float()
        a = (y - hi).to(torch.float8_e4m3fn).view(torch.uint8)
        b = (y.to(detour) - hi.to(detour)).float().to(torch.float8_e4m3fn).view(torch.uint8)
        zero_sign_only = ((a & 0x7F) == 0) & ((b & 0x7F) == 0)
        wrong += int(((a != b) & ~zero_sign_only).sum())
        compared += y.numel()
    return compared, wrong


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp16_difference_gives_the_fp32_difference_lo_term(dtype):
    compared, wrong = _mismatches(dtype, torch.float16)
    assert compared > 9_000_000
    assert wrong == 0


def test_a_detour_that_loses_bits_is_seen():
    """The control: the difference taken in bf16 (8 significant bits) cannot hold an fp16 q's 11, and the
    comparison above finds the lo terms that change."""
    _, wrong = _mismatches(torch.float16, torch.bfloat16)
    assert wrong > 1000

