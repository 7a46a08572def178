"""FP8 test inputs: the kit's cases with the cache quantized like an engine does (per-tensor scale)."""
import torch

import flashmla_backend as fb
from flashmla_backend import device as fdevice, kv_format
from flashmla_backend.kv_format import E4M3 as FP8
from kit import D_V, Case, Inputs, make_inputs

E4M3_MAX = 448.0

# Error bounds of the FP8 tensor-core kernel against fp64 attention on the dequantized inputs (rel_norm below),
# shared by tests/test_fp8_gpu.py and tests/sanitize_smoke.py.
ACCURATE_OUT = 3e-3   # ||out - ref|| / ||ref|| with a 16-bit q: measured 1.7e-3 (bf16 output rounding 1.66e-3)
ACCURATE_LSE = 2e-3   # relative norm of lse
# The fast mode (e4m3 q) rounds P to e4m3 (as FlashMLA-FP8 does): 1-2e-2 against fp64 on the same dequantized
# inputs in a CPU simulation (2e-2 on short rows, where a few large probabilities dominate).
FAST_OUT = 4e-2


def out_tolerance(q_fp8: bool) -> float:
    """The output bound of one mode (e4m3 q: fast, else accurate)."""
    return FAST_OUT if q_fp8 else ACCURATE_OUT


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| over the finite entries of the fp64 reference b (lse is +inf for rows without keys)."""
    a, b = a.double().cpu(), b.double().cpu()
    m = torch.isfinite(b)
    return ((a[m] - b[m]).norm() / b[m].norm().clamp_min(1e-30)).item()


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


def descale_table(descale: torch.Tensor, b: int, h_kv: int, seed: int = 0) -> torch.Tensor:
    """A [b, h_kv] float32 descale whose entries differ per request and KV head: descale x 2^u, u in [-1.5, 1.5)
    (the cache or q read with other scales per request; not contiguous, to exercise the strides)."""
    g = torch.Generator().manual_seed(seed)
    gains = torch.exp2(3 * torch.rand((h_kv, b), generator=g) - 1.5).t()  # [b, h_kv], strides (1, b)
    return (descale.cpu().reshape(()) * gains).to(descale.device)


def dequantized(inp: Inputs, descale_q, descale_k) -> Inputs:
    """The same inputs in float64, FP8 tensors times their descale (unused NaN slots stay NaN). A descale is one value
    or [b, h_kv]: request i's pages of KV head j times descale_k[i, j], its query heads of KV head j times
    descale_q[i, j] (written out per request and head; every page belongs to one request, as make_inputs makes it).
    The tensors stay on the inputs' device, where brute_force_fp64 then runs."""
    b, _, h_q, _ = inp.q.shape
    h_kv = inp.k_cache.shape[2]
    q = inp.q.to(torch.float64, copy=True)
    k = inp.k_cache.to(torch.float64, copy=True)
    if descale_q is not None:
        dq = descale_q.double().to(q.device)
        if dq.numel() == 1:
            q = q * dq.reshape(())
        else:
            for i in range(b):
                for h in range(h_q):
                    q[i, :, h] *= dq[i, h // (h_q // h_kv)]
    dk = descale_k.double().to(k.device)
    if dk.numel() == 1:
        k = k * dk.reshape(())
    else:
        owner = {}
        for i, n in enumerate(inp.cache_seqlens.tolist()):
            for t in range(-(-n // k.shape[1])):
                page = int(inp.block_table[i, t])
                assert owner.setdefault(page, i) == i, f"page {page} is read by requests {owner[page]} and {i}"
                for j in range(h_kv):
                    k[page, :, j] *= dk[i, j]
    return Inputs(q=q, k_cache=k, block_table=inp.block_table, cache_seqlens=inp.cache_seqlens, scale=inp.scale)


def sm90_fp8_problem() -> str | None:
    """Why this GPU cannot run the FP8 cache's sm90 kernels, or None (the GPU tests skip with it)."""
    return kv_format.FP8_E4M3.kernel_problem(fdevice.kernel_for(torch.device("cuda")), sparse=False)


def run_fp8_decode(inp: Inputs, case: Case, descale_q, descale_k):
    """One decode of the case's FP8 inputs through the public API, metadata from get_mla_metadata."""
    meta, splits = fb.get_mla_metadata(inp.cache_seqlens, case.s_q * case.h_q // case.h_kv, case.h_kv,
                                       is_fp8_kvcache=True)
    return fb.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, D_V, meta, splits,
                                     softmax_scale=inp.scale, causal=case.causal, descale_q=descale_q,
                                     descale_k=descale_k)
