"""DeepSeek-V3.2's FP8 cache token (vLLM calls the format fp8_ds_mla): its byte layout and a codec for it.

One token of the cache's one KV head is TOKEN_BYTES = 656 bytes, in this order:

    bytes   0 .. 511   latent (NoPE) channels 0..511: 512 float8_e4m3fn values, byte c holds channel c
    bytes 512 .. 527   four float32 scales, little-endian; scale g belongs to channels 128 g .. 128 g + 127
    bytes 528 .. 655   rope channels 512..575: 64 bfloat16 values, little-endian, not quantized

The true value of latent channel c is e4m3(byte c) x scale[c // 128] (the scale multiplies: a quantizer stores
x / scale, with scale = max |x| over the group / 448 here); rope channel 512 + j is bf16 value j. A page holds
its tokens one after another, 656 bytes apart (FlashMLA's sparse decode asks k_cache.stride(1) == 656); the
pages may lie at any stride. A k_cache of this format is [num_pages, page_size, 1, 656] of dtype uint8, int8
or float8_e4m3fn: the dtype only names the bytes, their meaning is the layout above.

Where this was confirmed: FlashMLA (deepseek-ai/FlashMLA at commit 9241ae3, and vLLM's fork of it,
vllm-project/FlashMLA at 46d64a8, whose kernel vLLM bundles): the docstring of flash_mla_with_kvcache and the
README give the three parts, their order and sizes; tests/quant.py writes and reads tokens that way (scales
viewed as float32 at byte 512, rope viewed as bf16 at byte 528, dequantization multiplies; the scale is
max |x| / 448 in the fork, rounded up to a power of two in the newer upstream: any positive scale is the same
format); the Hopper sparse kernel (csrc/sm90/decode/sparse_fp8) loads the four scales as one float4 at byte 512
and the rope at byte 512 + 16 of each token, and the interface checks bytes_per_token = 512 + 64 * 2 + 4 * 4.
That kernel dequantizes to bf16 before its bf16 matrix products: bf16(e4m3) x bf16(scale), rounded to bf16.
The dequantize() here multiplies in float32 (or float64) without rounding the scale or the product to bf16: it
is the format's exact value, the reference's oracle, not a model of that kernel's rounding.
"""
from __future__ import annotations

import torch

from .geometry import HEAD_DIM_K, HEAD_DIM_V, ROPE_DIM
from .kv_format import E4M3, FP8_DS_MLA

E4M3_MAX = 448.0                  # largest finite float8_e4m3fn
GROUP = 128                       # latent channels per scale
GROUPS = HEAD_DIM_V // GROUP      # 4 scales per token
SCALES_AT = HEAD_DIM_V            # byte offset of the scales: 512
ROPE_AT = SCALES_AT + 4 * GROUPS  # byte offset of the rope part: 528
TOKEN_BYTES = FP8_DS_MLA.bytes_per_token   # 656: the format's size, stated in flashmla_backend.kv_format
BYTE_DTYPES = FP8_DS_MLA.dtypes            # uint8, int8, float8_e4m3fn: FlashMLA's three
assert ROPE_AT + 2 * ROPE_DIM == TOKEN_BYTES == FP8_DS_MLA.width, "the layout must fill the format's token"


def as_bytes(tokens: torch.Tensor) -> torch.Tensor:
    """The same memory as uint8 (tokens of dtype uint8, int8 or float8_e4m3fn, last dimension TOKEN_BYTES)."""
    if tokens.dtype not in BYTE_DTYPES or tokens.shape[-1] != TOKEN_BYTES:
        raise ValueError(f"flashmla_backend: fp8_ds_mla tokens are [..., {TOKEN_BYTES}] of dtype uint8, int8 or "
                         f"float8_e4m3fn, got {tuple(tokens.shape)} {tokens.dtype}")
    return tokens if tokens.dtype == torch.uint8 else tokens.view(torch.uint8)


def dequantize(tokens: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8_ds_mla tokens [..., 656] (uint8, int8 or float8_e4m3fn bytes) -> their values [..., 576] in `dtype`.

    Latent channel c = e4m3 value x scale[c // 128], multiplied in `dtype` (float32 or float64 for the exact
    value: an e4m3 value has 4 significant bits, so the float64 product is exact and the float32 one is within
    2^-24 relative); rope channels as stored. NaN or inf bytes give NaN or inf values, nothing else."""
    raw = as_bytes(tokens)
    lead = raw.shape[:-1]
    raw = raw.reshape(-1, TOKEN_BYTES).contiguous()        # whole tokens in a row: the views below need it
    latent = raw[:, :SCALES_AT].view(E4M3).to(dtype)                     # [n, 512]
    scales = raw[:, SCALES_AT:ROPE_AT].view(torch.float32).to(dtype)     # [n, 4] (native order: little-endian)
    rope = raw[:, ROPE_AT:].view(torch.bfloat16).to(dtype)               # [n, 64]
    latent = (latent.view(-1, GROUPS, GROUP) * scales[:, :, None]).view(-1, HEAD_DIM_V)
    return torch.cat([latent, rope], dim=-1).view(*lead, HEAD_DIM_K)


def quantize(values: torch.Tensor) -> torch.Tensor:
    """Tokens [..., 576] (any float dtype) -> fp8_ds_mla tokens [..., 656] uint8 (view them as float8_e4m3fn or
    int8 at will: the bytes are the same).

    Per group of 128 latent channels: scale = max |x| / 448 in float32, stored e4m3(x / scale) (round to nearest
    even); a group of zeros gets scale 0 and zeros. The rope part is stored as bf16 (exact for bf16 input).
    A non-finite value makes its group's scale and bytes NaN (or its rope value inf / NaN): that is how tests
    poison slots, not a way to store data."""
    if values.shape[-1] != HEAD_DIM_K or not values.is_floating_point():
        raise ValueError(f"flashmla_backend: fp8_ds_mla quantize takes float tokens [..., {HEAD_DIM_K}], got "
                         f"{tuple(values.shape)} {values.dtype}")
    lead = values.shape[:-1]
    x = values.reshape(-1, HEAD_DIM_K)
    latent = x[:, :HEAD_DIM_V].to(torch.float32).view(-1, GROUPS, GROUP)
    scales = latent.abs().amax(dim=-1) / E4M3_MAX                              # [n, 4] float32
    scaled = torch.where(scales[:, :, None] == 0, 0.0, latent / scales[:, :, None])
    stored = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(-1, HEAD_DIM_V)
    rope = x[:, HEAD_DIM_V:].to(torch.bfloat16).contiguous()
    out = torch.cat([stored.view(torch.uint8), scales.contiguous().view(torch.uint8), rope.view(torch.uint8)], dim=-1)
    return out.view(*lead, TOKEN_BYTES)
