"""FP8 test inputs: the kit's cases with the cache quantized like an engine does (per-tensor scale)."""
import torch

from kit import Case, Inputs, make_inputs

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (x / descale as float8_e4m3fn, descale [1] float32), descale = amax(|x|) / 448 over finite values."""
    finite = x.float()[torch.isfinite(x.float())]
    descale = (finite.abs().max() / E4M3_MAX).reshape(1).to(torch.float32)
    return (x.float() / descale.to(x.device)).to(FP8), descale.to(x.device)


def fp8_inputs(case: Case, device="cpu", q_fp8: bool = False, k_gain: float = 1.0):
    """(Inputs with an e4m3 k_cache (NaN stays NaN in the unused slots), descale_q or None, descale_k)."""
    inp = make_inputs(Case(**{**case.__dict__, "dtype": torch.float32}), device)
    k8, descale_k = quantize(inp.k_cache * k_gain)
    q = inp.q.to(case.dtype)
    descale_q = None
    if q_fp8:
        q, descale_q = quantize(q)
    return Inputs(q=q, k_cache=k8, block_table=inp.block_table, cache_seqlens=inp.cache_seqlens,
                  scale=inp.scale), descale_q, descale_k


def dequantized(inp: Inputs, descale_q, descale_k) -> Inputs:
    """The same inputs in float64, FP8 tensors times their descale (unused NaN slots stay NaN)."""
    q = inp.q.double() * (descale_q.double() if descale_q is not None else 1.0)
    k = inp.k_cache.double() * descale_k.double()
    return Inputs(q=q, k_cache=k, block_table=inp.block_table, cache_seqlens=inp.cache_seqlens, scale=inp.scale)
