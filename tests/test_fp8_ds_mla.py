"""The fp8_ds_mla token (flashmla_backend.fp8_ds_mla): its byte layout against bytes written by hand, and the
quantizer and dequantizer against each other and against the test kit's own decoder (sparsekit.decode_token_fp64,
which reads the bytes with struct and its own e4m3 table)."""
import math
import struct

import pytest
import torch

from flashmla_backend import fp8_ds_mla, kv_format
from sparsekit import E4M3_TABLE, decode_token_fp64

E4M3_ONE = 0x38        # 0.0111.000: 1.0
E4M3_MINUS_HALF = 0xB0  # 1.0110.000: -0.5
E4M3_MAX_BYTE = 0x7E   # 0.1111.110: 448


def _bf16_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0] >> 16   # exact for values with 8 significant bits


def test_layout_constants():
    assert (fp8_ds_mla.SCALES_AT, fp8_ds_mla.ROPE_AT, fp8_ds_mla.TOKEN_BYTES) == (512, 528, 656)
    assert fp8_ds_mla.TOKEN_BYTES == kv_format.FP8_DS_MLA.bytes_per_token == kv_format.FP8_DS_MLA.width
    assert fp8_ds_mla.BYTE_DTYPES == (torch.uint8, torch.int8, torch.float8_e4m3fn)


def test_a_token_written_by_hand_decodes_channel_by_channel():
    """Latent byte c is channel c, scale g (float32, little-endian, at byte 512 + 4 g) multiplies channels
    128 g .. 128 g + 127, rope value j (bf16, little-endian, at byte 528 + 2 j) is channel 512 + j."""
    latent = bytearray([E4M3_ONE] * 512)
    latent[5] = E4M3_MINUS_HALF            # group 0
    latent[130] = E4M3_MAX_BYTE            # group 1
    latent[511] = 0x00                     # group 3: zero
    scales = [0.5, 2.0, 0.25, 8.0]
    rope = [1.5 * (j - 32) for j in range(64)]
    raw = bytes(latent) + struct.pack("<4f", *scales) + struct.pack("<64H", *[_bf16_bits(x) for x in rope])
    assert len(raw) == 656
    token = torch.tensor(list(raw), dtype=torch.uint8)
    got = fp8_ds_mla.dequantize(token, torch.float64)
    want = torch.tensor([scales[c // 128] for c in range(512)] + rope, dtype=torch.float64)
    want[5], want[130], want[511] = -0.5 * 0.5, 448 * 2.0, 0.0
    assert got.shape == (576,) and torch.equal(got, want)
    assert torch.equal(decode_token_fp64(raw), want)   # the kit's decoder reads the same layout


def test_latent_bytes_decode_as_e4m3():
    """All 256 byte values with scale 1 decode to the e4m3 values the kit computes from the bit fields."""
    raw = torch.zeros(2, 656, dtype=torch.uint8)
    raw[0, :256] = torch.arange(256, dtype=torch.uint8)
    raw[1, :256] = torch.arange(256, dtype=torch.uint8)
    raw[:, 512:528] = torch.tensor(list(struct.pack("<4f", 1.0, 1.0, 1.0, 1.0)), dtype=torch.uint8)
    got = fp8_ds_mla.dequantize(raw, torch.float64)[:, :256]
    want = E4M3_TABLE.expand(2, 256)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got[~torch.isnan(got)], want[~torch.isnan(want)])


def _spread_tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, 576), generator=g)
    x[:, :512] *= torch.exp2(torch.randint(-8, 9, (n, 4), generator=g).float()).repeat_interleave(128, dim=1)
    return x


def test_quantize_writes_the_layout():
    x = _spread_tokens(20).to(torch.bfloat16)
    raw = fp8_ds_mla.quantize(x)
    assert raw.shape == (20, 656) and raw.dtype == torch.uint8
    for t in range(20):
        token = bytes(raw[t].tolist())
        scales = struct.unpack("<4f", token[512:528])
        for grp in range(4):
            amax = float(x[t, grp * 128:(grp + 1) * 128].float().abs().max())
            want = struct.unpack("<f", struct.pack("<f", amax / 448.0))[0]  # max |x| / 448 in float32
            assert math.isclose(scales[grp], want, rel_tol=2**-23), (t, grp, scales[grp], want)
        rope = struct.unpack("<64H", token[528:656])
        assert list(rope) == [_bf16_bits(float(v)) for v in x[t, 512:].float()]   # bf16 input: stored exactly


def test_round_trip_error_is_e4m3_rounding():
    """dequantize(quantize(x)) differs from x by at most half an e4m3 step: 2^-4 relative for normal values, and
    2^-10 x scale in the subnormal range (steps of 2^-9 below 2^-6). The rope part is bf16-rounded."""
    x = _spread_tokens(64, seed=1)
    raw = fp8_ds_mla.quantize(x)
    y = fp8_ds_mla.dequantize(raw, torch.float64)
    scales = torch.tensor([struct.unpack("<4f", bytes(raw[t, 512:528].tolist())) for t in range(64)],
                          dtype=torch.float64).repeat_interleave(128, dim=1)
    xl = x[:, :512].double()
    bound = torch.maximum(xl.abs() * 2.0 ** -4, scales * 2.0 ** -10) * (1 + 1e-6)
    assert bool(((y[:, :512] - xl).abs() <= bound).all())
    assert torch.equal(y[:, 512:], x[:, 512:].to(torch.bfloat16).double())
    # each group's largest magnitude is stored as +-448 and comes back within float32 rounding
    for grp in range(4):
        cols = slice(grp * 128, (grp + 1) * 128)
        assert torch.allclose(y[:, cols].abs().amax(1), xl[:, cols].abs().amax(1), rtol=1e-6, atol=0)


def test_round_trip_is_exact_for_representable_tokens():
    """Tokens that are e4m3 values times a power of two, each group holding a +-448: bytes and values come back."""
    g = torch.Generator().manual_seed(2)
    finite = torch.tensor([v for v in range(256) if (v & 0x7F) != 0x7F], dtype=torch.uint8)
    latent = finite[torch.randint(0, len(finite), (8, 512), generator=g)]
    latent[:, ::128] = E4M3_MAX_BYTE                                      # the group maximum: 448
    scales = torch.exp2(torch.randint(-10, 4, (8, 4), generator=g).float())
    values = E4M3_TABLE[latent.long()] * scales.double().repeat_interleave(128, dim=1)
    rope = torch.randn((8, 64), generator=g).to(torch.bfloat16)
    tokens = torch.cat([values, rope.double()], dim=1)
    raw = fp8_ds_mla.quantize(tokens)
    assert torch.equal(raw[:, :512], latent)
    assert torch.equal(raw[:, 512:528].contiguous().view(torch.float32), scales)
    assert torch.equal(raw[:, 528:].contiguous().view(torch.bfloat16), rope)
    assert torch.equal(fp8_ds_mla.dequantize(raw, torch.float64), tokens)


@pytest.mark.parametrize("dtype", fp8_ds_mla.BYTE_DTYPES, ids=str)
def test_every_byte_dtype_and_strided_pages_decode_alike(dtype):
    """uint8, int8 and float8_e4m3fn views of the same bytes, with pages at a padded stride, decode alike."""
    x = _spread_tokens(3 * 5, seed=3)
    padded = torch.zeros(3, 6, 1, 656, dtype=torch.uint8)
    padded[:, :5, 0] = fp8_ds_mla.quantize(x).view(3, 5, 656)
    cache = padded[:, :5].view(dtype)                                   # page stride 6 tokens
    assert not cache.is_contiguous()
    got = fp8_ds_mla.dequantize(cache, torch.float64)
    assert got.shape == (3, 5, 1, 576)
    assert torch.equal(got.reshape(15, 576), fp8_ds_mla.dequantize(fp8_ds_mla.quantize(x), torch.float64))


def test_zero_and_nan_tokens():
    raw = fp8_ds_mla.quantize(torch.zeros(2, 576))
    assert torch.equal(fp8_ds_mla.dequantize(raw), torch.zeros(2, 576))
    poison = fp8_ds_mla.quantize(torch.full((1, 576), float("nan")))   # how the tests poison a slot
    assert bool(torch.isnan(fp8_ds_mla.dequantize(poison)).all())
    assert bool(torch.isnan(fp8_ds_mla.dequantize(torch.full((1, 656), 0xFF, dtype=torch.uint8))).all())


def test_wrong_arguments_are_named():
    with pytest.raises(ValueError, match=r"fp8_ds_mla tokens are \[\.\.\., 656\] of dtype uint8, int8 or "
                                         r"float8_e4m3fn, got \(2, 576\) torch.uint8"):
        fp8_ds_mla.dequantize(torch.zeros(2, 576, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"got \(2, 656\) torch.bfloat16"):
        fp8_ds_mla.dequantize(torch.zeros(2, 656, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"quantize takes float tokens \[\.\.\., 576\], got \(2, 512\)"):
        fp8_ds_mla.quantize(torch.zeros(2, 512))
