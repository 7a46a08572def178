"""What the engine plugins accept: KV-cache dtypes, block sizes and the FP8 query mode.

The one statement of it: the vLLM adapter (flashmla_backend.vllm: backend, impl, the opt-in automatic
choice) and the SGLang adapter (flashmla_backend.sglang: backend, server-argument hook) read this module
and nothing else to decide what they serve and what they refuse, and the README's tables say the same.

KV-cache formats (`--kv-cache-dtype`):
  * the model's 16-bit dtype (bf16 or fp16): "auto", or the dtype's own name;
  * FP8 e4m3 with one per-tensor scale per layer (vLLM "fp8" / "fp8_e4m3", SGLang "fp8_e4m3"): the engine
    writes e4m3 values x / k_scale through its own store path, and the decode kernel reads them in place
    with descale_k = the layer's k scale, a device tensor (CUDA-graph replays read its current value).
Refused, with a message naming what works: fp8_e5m2, DeepSeek's packed fp8_ds_mla (sparse MLA), fp4 /
nvfp4 / mxfp8 / int8 formats, and anything else.

Sparse MLA (DeepSeek-V3.2 / GLM-5 attention with the engine's indexer choosing the tokens: vLLM through
flashmla_backend.vllm.sparse_backend, SGLang as the decode kernel of its DSA backend through
flashmla_backend.sglang.dsa) reads other caches: the model's 16-bit dtype (vLLM "auto", "bfloat16", "float16";
SGLang "auto", "bfloat16", "bf16", which its DSA backend serves in bf16 only) or DeepSeek's 656-byte
fp8_ds_mla token (vLLM "fp8_ds_mla", and "fp8" / "fp8_e4m3" as for vLLM's own FLASHMLA_SPARSE backend; SGLang
"fp8_e4m3", which its DSA backend stores in that layout), with 64 or 128 query heads per rank (SPARSE_HEADS).

FP8 query mode (FP8 caches only), chosen by FLASHMLA_BACKEND_FP8_MODE; unset, each engine's default
(DEFAULT_FP8_MODES):
  * "fast" (vLLM's default): q in e4m3 with descale_q (vLLM's FlashMLA-FP8 convention). vLLM quantizes q with
    the layer's q scale (its fused concat + quant); SGLang's backend quantizes it with the layer's k scale, as
    SGLang's own FlashMLA backend does with an FP8 cache;
  * "accurate" (SGLang's default): the engine hands the 16-bit query, which the kernel multiplies against the
    dequantized cache (no quantization of q; vLLM skips its concat + quant of q).
The README ("FP8 KV cache in the engines") says why each default is what it is.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from . import kv_format
from ._env import SPARSE_GPU_ENV, flag as env_flag
from .geometry import HEAD_DIM_K, HEAD_DIM_V, PAGE_SIZE, ROPE_DIM

FP8_DTYPE = kv_format.FP8_E4M3.dtypes[0]   # the fp8_e4m3 format's dtype (float8_e4m3fn)


@dataclass(frozen=True)
class KVCacheFormat:
    """One accepted spelling of --kv-cache-dtype: its torch dtype (None: the model's own) and whether FP8."""

    name: str
    dtype: Optional[torch.dtype]

    @property
    def fp8(self) -> bool:
        return self.dtype == FP8_DTYPE


def _formats(*pairs) -> dict[str, KVCacheFormat]:
    return {name: KVCacheFormat(name, dtype) for name, dtype in pairs}


# --kv-cache-dtype values each engine may pass, as the engine spells them.
KV_CACHE_DTYPES: dict[str, dict[str, KVCacheFormat]] = {
    "vllm": _formats(("auto", None), ("bfloat16", torch.bfloat16), ("float16", torch.float16),
                     ("fp8", FP8_DTYPE), ("fp8_e4m3", FP8_DTYPE)),
    # SGLang's --kv-cache-dtype choices (0.5.17-0.5.23) have no 16-bit float16 spelling: an fp16 model uses "auto".
    "sglang": _formats(("auto", None), ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
                       ("fp8_e4m3", FP8_DTYPE)),
}
# Model (activation) dtypes and the torch dtypes of a KV cache the decode kernel reads.
MODEL_DTYPES = (torch.bfloat16, torch.float16)
CACHE_TORCH_DTYPES = (torch.bfloat16, torch.float16, FP8_DTYPE)
# The decode kernel reads PAGE_SIZE-token pages; a KV block of any multiple is split into kernel blocks (vLLM).
BLOCK_SIZE_MULTIPLE = PAGE_SIZE

FP8_MODE_ENV = "FLASHMLA_BACKEND_FP8_MODE"
FP8_MODES = ("accurate", "fast")
# Each engine's mode when the variable is unset (vLLM's decided by its engine benchmark and fp32 judgment; SGLang's
# fast mode has so far run only in the layer tests on a GPU).
DEFAULT_FP8_MODES = {"vllm": "fast", "sglang": "accurate"}


def accepted_names(engine: str) -> tuple[str, ...]:
    return tuple(KV_CACHE_DTYPES[_engine(engine)])


def kv_cache_format(engine: str, kv_cache_dtype: Optional[str]) -> Optional[KVCacheFormat]:
    """The format of an engine's --kv-cache-dtype value (None -> "auto"), or None when refused."""
    return KV_CACHE_DTYPES[_engine(engine)].get("auto" if kv_cache_dtype is None else kv_cache_dtype)


def is_fp8(engine: str, kv_cache_dtype: Optional[str]) -> bool:
    fmt = kv_cache_format(engine, kv_cache_dtype)
    return fmt is not None and fmt.fp8


def kv_cache_dtype_problem(engine: str, kv_cache_dtype: Optional[str],
                           model_dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """None when the plugin serves this --kv-cache-dtype (with this model dtype), else why and what works."""
    fmt = kv_cache_format(engine, kv_cache_dtype)
    flag = "--kv-cache-dtype"
    if fmt is None:
        return (f"flashmla_backend does not support {flag} {kv_cache_dtype!r}; it serves "
                f"{', '.join(accepted_names(engine))} (FP8 is e4m3 with a per-tensor scale; fp8_e5m2, fp8_ds_mla "
                "and fp4 formats are not supported)")
    if fmt.dtype is not None and not fmt.fp8 and model_dtype is not None and fmt.dtype != model_dtype:
        return (f"flashmla_backend needs a 16-bit KV cache in the model dtype ({model_dtype}), got {flag} "
                f"{kv_cache_dtype!r}; use {flag} auto, or an FP8 cache ({', '.join(fp8_names(engine))})")
    return None


def fp8_names(engine: str) -> tuple[str, ...]:
    return tuple(n for n, f in KV_CACHE_DTYPES[_engine(engine)].items() if f.fp8)


def cache_dtype_problem(kv_dtype: torch.dtype, model_dtype: torch.dtype) -> Optional[str]:
    """The same statement for a resolved torch dtype (SGLang's model_runner.kv_cache_dtype)."""
    if model_dtype not in MODEL_DTYPES:
        return f"flashmla_backend serves bf16 and fp16 models, got model dtype {model_dtype}"
    if kv_dtype == FP8_DTYPE:
        return None
    if kv_dtype not in CACHE_TORCH_DTYPES:
        return (f"flashmla_backend does not support KV cache dtype {kv_dtype}; it reads the model's 16-bit dtype "
                "or float8_e4m3fn (--kv-cache-dtype fp8_e4m3)")
    if kv_dtype != model_dtype:
        return f"flashmla_backend needs a 16-bit KV cache in the model dtype ({model_dtype}), got {kv_dtype}"
    return None


def block_size_problem(block_size: Optional[int]) -> Optional[str]:
    if block_size is None or block_size % BLOCK_SIZE_MULTIPLE == 0:
        return None
    return (f"flashmla_backend needs a KV block size that is a multiple of {BLOCK_SIZE_MULTIPLE}: 64, 128 or 256 "
            f"work (larger blocks are split into {PAGE_SIZE}-token kernel blocks), {block_size} does not; use "
            f"--block-size {PAGE_SIZE} or leave --block-size unset")


def requested_fp8_mode() -> Optional[str]:
    """The mode FLASHMLA_BACKEND_FP8_MODE names ("accurate" or "fast"), None when it is unset or empty; any other
    value raises."""
    raw = os.environ.get(FP8_MODE_ENV, "").strip().lower()
    if raw == "":
        return None
    if raw not in FP8_MODES:
        unset = ", ".join(f"{mode} in {engine}" for engine, mode in DEFAULT_FP8_MODES.items())
        raise ValueError(f"{FP8_MODE_ENV}={os.environ[FP8_MODE_ENV]!r} is not a FP8 query mode; expected one of "
                         f"{', '.join(FP8_MODES)} (unset: {unset})")
    return raw


def fp8_mode(engine: str) -> str:
    """The engine's FP8 query mode: the one FLASHMLA_BACKEND_FP8_MODE names, else DEFAULT_FP8_MODES[engine]."""
    return requested_fp8_mode() or DEFAULT_FP8_MODES[_engine(engine)]


def default_scale_message(engine: str) -> str:
    """The start-up line logged when an FP8 cache runs with the default k scale 1.0."""
    how = {
        "vllm": ("the checkpoint carries no KV-cache scales. Calibrate them: `--calculate-kv-scales` (vLLM computes "
                 "them from the first batch) or a checkpoint with KV-cache scales (e.g. quantized with "
                 "llm-compressor's kv_cache_scheme)"),
        "sglang": ("the checkpoint carries no KV-cache scales (SGLang reads `k_scale` from FP8-quantized checkpoints "
                   "only). Calibrate them with a checkpoint that carries KV-cache scales"),
    }[_engine(engine)]
    return (f"flashmla_backend: FP8 KV cache with the default scale 1.0: {how}. Values whose magnitude is below "
            "2^-6 lose precision in e4m3 and above 448 saturate; README \"FP8 KV cache in the engines\" shows the "
            "accuracy with and without calibration.")


# Sparse MLA: --kv-cache-dtype values and what the cache holds. The FP8 spellings all mean the 656-byte
# fp8_ds_mla token (flashmla_backend.fp8_ds_mla); the 16-bit ones a 576-wide token in the model dtype.
SPARSE_DS_MLA = "fp8_ds_mla"
SPARSE_KV_CACHE_DTYPES: dict[str, tuple[str, ...]] = {
    "vllm": ("auto", "bfloat16", "float16", SPARSE_DS_MLA, "fp8", "fp8_e4m3"),
    # SGLang's DSA backend accepts bf16 / bfloat16 / fp8_e4m3 (and auto, which it resolves to one of them).
    "sglang": ("auto", "bfloat16", "bf16", "fp8_e4m3"),
}
SPARSE_FP8_ALIASES = ("fp8", "fp8_e4m3")   # stored as fp8_ds_mla
# Query heads per rank the sparse decode serves (FlashMLA's sparse kernels take 64 or 128).
SPARSE_HEADS = (64, 128)


def sparse_is_ds_mla(kv_cache_dtype: Optional[str]) -> bool:
    """True when a sparse MLA layer with this --kv-cache-dtype stores fp8_ds_mla tokens."""
    return kv_cache_dtype == SPARSE_DS_MLA or kv_cache_dtype in SPARSE_FP8_ALIASES


def sparse_kv_cache_dtype_problem(engine: str, kv_cache_dtype: Optional[str],
                                  model_dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """None when sparse MLA serves this --kv-cache-dtype (with this model dtype), else why and what works."""
    names = SPARSE_KV_CACHE_DTYPES.get(_engine(engine))
    flag, value = "--kv-cache-dtype", "auto" if kv_cache_dtype is None else kv_cache_dtype
    if not names:
        return f"flashmla_backend has no sparse MLA (DeepSeek-V3.2 indexer) decode for {engine}"
    if value not in names:
        return (f"flashmla_backend's sparse MLA decode does not support {flag} {value!r}; it serves "
                f"{', '.join(names)} (the FP8 names all store DeepSeek's 656-byte fp8_ds_mla token)")
    if model_dtype is not None and model_dtype not in MODEL_DTYPES:
        return f"flashmla_backend's sparse MLA decode serves bf16 and fp16 models, got model dtype {model_dtype}"
    if sparse_is_ds_mla(value) and model_dtype is not None and model_dtype != torch.bfloat16:
        return (f"flashmla_backend's sparse MLA decode reads the fp8_ds_mla cache with a bf16 query (its rope part "
                f"is bf16), got model dtype {model_dtype}; use a bf16 model or {flag} auto")
    wanted = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16}.get(value)
    if wanted is not None and model_dtype is not None and wanted != model_dtype:
        return (f"flashmla_backend's sparse MLA decode needs a 16-bit KV cache in the model dtype ({model_dtype}), "
                f"got {flag} {value!r}; use {flag} auto or {next(n for n in names if sparse_is_ds_mla(n))}")
    return None


def mla_dims_problem(kv_lora_rank, qk_rope_head_dim, model: str, head_size: Optional[int] = None) -> Optional[str]:
    """None when a model's MLA has the kernels' geometry (latent 512, rope 64; head 576 where head_size is given),
    else "needs ..., got ..." for the caller to put after what needs it. model: the architectures that have it."""
    if (kv_lora_rank, qk_rope_head_dim) == (HEAD_DIM_V, ROPE_DIM) and head_size in (None, HEAD_DIM_K):
        return None
    got = f"kv_lora_rank {kv_lora_rank}, qk_rope_head_dim {qk_rope_head_dim}"
    if head_size is not None:
        got += f", head size {head_size}"
    return f"needs kv_lora_rank {HEAD_DIM_V} and qk_rope_head_dim {ROPE_DIM} ({model} MLA), got {got}"


def sparse_device_problem(kernel_missing: str, *, cuda: bool, ds_mla: bool, capability=None,
                          device=None) -> Optional[str]:
    """None where sparse MLA decode may run on the layer's device, else why and what works.

    CPU tensors run the PyTorch reference. A CUDA device is refused with `kernel_missing` (the engine's message)
    unless FLASHMLA_BACKEND_SPARSE_GPU is set; then it must be a Hopper GPU: the sparse kernel reads the fp8_ds_mla
    cache there, and a 16-bit cache's tokens are gathered for the dense kernel (flashmla_backend.ops: the API runs
    that on any GPU with a dense kernel; the engines offer both on Hopper only, the GPUs they have run on). `ds_mla`
    names the cache in the message only. The GPU's capability: `capability` where the caller has
    it, else asked of `device` (only once the variable lets a GPU through), else not checked."""
    if not cuda:
        return None
    if not env_flag(SPARSE_GPU_ENV):
        return kernel_missing
    if capability is None and device is not None:
        capability = torch.cuda.get_device_capability(device)
    if capability is not None and tuple(capability)[:2] != (9, 0):
        major, minor = tuple(capability)[:2]
        cache = "the fp8_ds_mla cache" if ds_mla else "a 16-bit cache"
        return (f"{SPARSE_GPU_ENV}=1: flashmla_backend's sparse decode in the engines runs on Hopper GPUs (sm_90) "
                f"({cache}), this one is sm_{major}{minor}; unset {SPARSE_GPU_ENV} and serve with the engine's own "
                "sparse backend")
    return None


def sparse_heads_problem(num_heads: int) -> Optional[str]:
    """None when sparse MLA decode serves this many query heads per rank, else why and what works."""
    if num_heads in SPARSE_HEADS:
        return None
    return (f"flashmla_backend's sparse MLA decode serves {' or '.join(map(str, SPARSE_HEADS))} query heads per "
            f"rank, got {num_heads}; choose --tensor-parallel-size so that the model's attention heads divided by it "
            "is one of these (DeepSeek-V3.2 has 128 heads: tensor parallel size 1 or 2)")


def _engine(engine: str) -> str:
    if engine not in KV_CACHE_DTYPES:
        raise ValueError(f"engine must be one of {', '.join(KV_CACHE_DTYPES)}, got {engine!r}")
    return engine
