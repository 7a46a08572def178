"""flashmla_backend's sparse decode as the decode kernel of SGLang's DSA attention backend (DeepSeek-V3.2, GLM-5).

Selected with one environment variable, read in every SGLang process (they inherit the launcher's environment):

    FLASHMLA_BACKEND_DSA_DECODE=1 python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V3.2 \\
        --attention-backend dsa --kv-cache-dtype fp8_e4m3     # or bfloat16

(--attention-backend nsa is SGLang's older name of the same backend; SGLang also picks it for these models by
itself). Everything else of the backend stays SGLang's: the indexer choosing the top-k tokens, prefill / extend
with SGLang's --dsa-prefill-backend, the KV writes, the metadata, CUDA-graph handling.

Why a variable and not a value of --dsa-decode-backend: in SGLang 0.5.21 and 0.5.23 that option's choices are a
list written into its field (sglang.srt.arg_groups.fields.exec_), which SGLang's choices module says is not an
extension point (only the lists with an add_* function there are); the backend dispatches on the value with a
closed if / elif chain that ends in an assertion; and other modules compare the value to their own names (KV
layout, disaggregation, DCP). A new value would have to be patched into all of them. The variable leaves every
SGLang argument as SGLang resolves it and changes one thing inside the backend.

How (HookRegistry hooks on sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend, registered by
flashmla_backend.sglang.register only while the variable is set):
  INIT_TARGET    after SGLang's constructor, adopt() checks what this decode serves (refusing the rest at start-up,
                 naming what works) and sets the backend's decode implementation to STAND_IN, "flashmla_sparse":
                 SGLang's own bookkeeping for that value is what this decode needs (no FlashMLA tile-scheduler
                 metadata of SGLang's; top-k positions translated to KV-pool slots; per-row top-k lengths).
  DECODE_TARGET  marks forward_decode calls of adopted backends, so that
  KERNEL_TARGET  _forward_flashmla_sparse, SGLang's call of its FlashMLA sparse kernel, runs DSADecode instead
                 during decode; called from forward_extend (prefill with --dsa-prefill-backend flashmla_sparse)
                 it stays SGLang's.

The indices: SGLang's forward_decode hands _forward_flashmla_sparse `page_table_1` [tokens, topk] int32, the
indexer's top-k positions (within the request) already translated through req_to_token: by forward_decode
(transform_index_page_table_decode with page_size 1), or, with SGLang's fused top-k (SGLANG_DSA_FUSE_TOPK, on by
default in 0.5.17, 0.5.21 and 0.5.23), by the indexer's top-k kernel, whose output forward_decode passes on.
Entry = the KV-pool slot of that token, -1 where the indexer chose nothing. A slot of SGLang's paged pool is
page * page_size + offset (pool rows [slots, 1, width], pages of page_size consecutive rows), which is
flashmla_backend's sparse convention with the pool viewed as [slots / page_size, page_size, 1, width]: the entries
pass unchanged, -1 stays "skip". Alongside,
`topk_length` [tokens] int32 is the request's length clipped to topk (valid entries come first, -1 after),
passed on as SGLang passes it to its kernel (dropped, as SGLang drops it, when its rows do not match q's).

The caches: SGLang's DSA pool with --kv-cache-dtype fp8_e4m3 stores, for the backends that read scaled rows
(its flashmla_kv / flashmla_sparse / fa3 paths), 656 bytes a token: 512 e4m3 latent values, four float32 scales
(one per 128 channels, scale = max |x| / 448, value = e4m3 x scale) and 64 bf16 rope values, the byte layout of
flashmla_backend.fp8_ds_mla (read from SGLang's quantizer, sglang.kernels.ops.quantization.dsa_quant_k_cache,
and its kv-cache-dim rule, 0.5.21 and 0.5.23). With bfloat16 it stores 576 bf16 values a token. Both are read
in place. Raw fp8 rows without scales (what SGLang stores when both DSA backends are tilelang, or for trtllm) are
refused. SGLang's DSA pages are 64 tokens.

Refused at start-up, each with what works: query heads other than 64 or 128 per rank, caches other than the two
above, index_kpool > 1, decode context parallelism, HiSparse, speculative decoding (SGLang's target verification
would go to its own kernel with the stand-in value), a model other than kv_lora_rank 512 / rope 64, and a CUDA
device: the DSA decode does not run on GPUs yet (flashmla_backend's Hopper sparse kernel reads the 656-byte cache
through its API but has not been validated inside SGLang, and is slower than FlashMLA's at b = 1 and top-k 512),
unless FLASHMLA_BACKEND_SPARSE_GPU is set, the GPU a Hopper one and the cache fp8_e4m3's 656-byte rows
(engine_support.sparse_device_problem). An adopted
backend never runs SGLang's decode kernel instead. Where the hooks cannot be registered,
flashmla_backend.sglang.register raises; SGLang's plugin loader logs that as an error (in every process) and goes on,
so that server then decodes with SGLang's own kernel: read the log when the variable is set.

Versions: the hook targets and the attributes read here are those of SGLang 0.5.21 and 0.5.23 (checked by
tests/test_sglang_sparse_cpu.py in their CPU test environments) and of 0.5.17 (the same tests, run once on CPU with
0.5.17's package over the 0.5.21 environment's other packages). Differences handled: 0.5.17's backend has no
index_kpool (read as 1) and no attention sinks (_forward_flashmla_sparse and forward_decode take no attn_sink; the
hook passes SGLang's arguments on as given), and dispatches on self.dsa_decode_impl where 0.5.21 and 0.5.23
dispatch on the value after their index_kpool remap (the same value with index_kpool 1); dcp_size exists in 0.5.23
only (read as 1 where absent). Where the backend class is missing, register_hooks raises and says so.
"""
from __future__ import annotations

import importlib.util
import logging
from typing import Optional

import torch

import flashmla_backend
from flashmla_backend import engine_support
from flashmla_backend._env import DSA_DECODE_ENV, SPARSE_GPU_ENV, debug_break_scale_enabled, flag
from flashmla_backend.fp8_ds_mla import TOKEN_BYTES
from flashmla_backend.geometry import HEAD_DIM_K, HEAD_DIM_V, PAGE_SIZE

logger = logging.getLogger("sglang.flashmla_backend")

BACKEND_MODULE = "sglang.srt.layers.attention.dsa_backend"
BACKEND_CLASS = BACKEND_MODULE + ".DeepseekSparseAttnBackend"
INIT_TARGET = BACKEND_CLASS + ".__init__"
DECODE_TARGET = BACKEND_CLASS + ".forward_decode"
KERNEL_TARGET = BACKEND_CLASS + "._forward_flashmla_sparse"
# The decode implementation SGLang's backend is set to: its paths for this value hand the kernel call what
# DSADecode reads (see the module docstring).
STAND_IN = "flashmla_sparse"
# The attribute of an adopted backend that holds its DSADecode.
ATTR = "_flashmla_backend_dsa_decode"

KERNEL_MISSING = (
    "flashmla_backend: the DSA decode does not run on GPUs yet: flashmla_backend's Hopper sparse decode kernel (the "
    "fp8_e4m3 656-byte cache) has served only a tiny test model inside SGLang and is slower than FlashMLA's at short "
    "top-k (512), and a bfloat16 cache's tokens are gathered for the dense kernel at about a third of FlashMLA's "
    "speed. Unset "
    f"{DSA_DECODE_ENV} to serve this model with SGLang's own DSA decode (--dsa-decode-backend flashmla_kv / "
    f"flashmla_sparse / fa3); {SPARSE_GPU_ENV}=1 runs it anyway on a Hopper GPU (--kv-cache-dtype fp8_e4m3 or "
    "bfloat16), for testing")

_announced = False


def enabled() -> bool:
    """Whether FLASHMLA_BACKEND_DSA_DECODE asks for this decode."""
    return flag(DSA_DECODE_ENV)


def _cache_name(dtype: torch.dtype) -> str:
    """SGLang's --kv-cache-dtype name of a DSA pool's element dtype."""
    return {torch.float8_e4m3fn: "fp8_e4m3", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(
        dtype, str(dtype).replace("torch.", ""))


def serving_problem(*, num_heads: int, kv_cache_dtype: torch.dtype, model_dtype: Optional[torch.dtype],
                    kv_cache_dim: int, store_fp8: bool, kv_lora_rank: int, qk_rope_head_dim: int, page_size: int,
                    index_kpool: int = 1, dcp_size: int = 1, hisparse: bool = False, speculative: bool = False,
                    device: torch.device | str = "cpu") -> Optional[str]:
    """None when this decode serves SGLang's DSA backend so configured, else why and what works."""
    prefix = f"{DSA_DECODE_ENV}=1 (flashmla_backend's sparse decode in SGLang's DSA backend): "
    dims = engine_support.mla_dims_problem(kv_lora_rank, qk_rope_head_dim, "DeepSeek-V3.2 / GLM-5")
    if dims is not None:
        return prefix + dims
    problem = engine_support.sparse_heads_problem(num_heads)
    if problem is not None:
        return prefix + problem
    name = _cache_name(kv_cache_dtype)
    problem = engine_support.sparse_kv_cache_dtype_problem("sglang", name, model_dtype)
    if problem is not None:
        return prefix + problem
    if engine_support.sparse_is_ds_mla(name):
        if not store_fp8 or kv_cache_dim != TOKEN_BYTES:
            return (prefix + f"SGLang stores this fp8_e4m3 cache as {kv_cache_dim}-byte rows without per-tile scales "
                    f"(its layout when both --dsa-prefill-backend and --dsa-decode-backend are tilelang, or with "
                    f"trtllm); flashmla_backend reads the {TOKEN_BYTES}-byte scaled token SGLang stores for "
                    "flashmla_kv / flashmla_sparse / fa3: choose one of those for --dsa-prefill-backend (or leave it "
                    "unset), or use --kv-cache-dtype bfloat16")
    elif kv_cache_dim != HEAD_DIM_K:
        return prefix + f"a 16-bit DSA cache must hold {HEAD_DIM_K} values a token, SGLang's pool holds {kv_cache_dim}"
    if page_size != PAGE_SIZE:
        return prefix + f"SGLang's DSA pages are {PAGE_SIZE} tokens, got --page-size {page_size}; use {PAGE_SIZE}"
    if index_kpool != 1:
        return (prefix + f"index_kpool {index_kpool} (the model config's index_kpool): SGLang then appends tail tokens "
                "that only its fa3 / tilelang / trtllm decode reads; served with index_kpool 1")
    if dcp_size != 1:
        return prefix + f"--dcp-size {dcp_size}: decode context parallelism is not served; use --dcp-size 1"
    if hisparse:
        return prefix + "--enable-hisparse is not served (its swapped-in pages are SGLang's own); leave it off"
    if speculative:
        return (prefix + "speculative decoding (MTP / EAGLE) is not served: target verification and draft extend run "
                "SGLang's decode path for the backend's decode implementation; serve without "
                "--speculative-algorithm")
    dev = torch.device(device)
    return engine_support.sparse_device_problem(
        KERNEL_MISSING, cuda=dev.type == "cuda", ds_mla=engine_support.sparse_is_ds_mla(name), device=dev)


class DSADecode:
    """The kernel call of an adopted backend: SGLang's _forward_flashmla_sparse arguments in, its output out."""

    def __init__(self, page_size: int, fp8: bool, draft: bool = False):
        self.page_size = page_size
        self.fp8 = fp8
        self.draft = draft
        self.active = False   # True while the backend's forward_decode runs
        # The kernel's schedule for each call shape (tokens, heads, top-k), filled once (flashmla_backend.
        # fill_sparse_sched_meta) and kept: every layer of every step with that shape reads it, and so do the CUDA
        # graphs SGLang captures after its eager warm-up runs of the same batch size (filling is refused during
        # capture, and a graph's replays read the tensors it captured). One small object a batch size.
        self._sched_metas: dict[tuple[int, int, int], object] = {}

    def __call__(self, q_all: torch.Tensor, kv_cache: torch.Tensor, v_head_dim: int, page_table_1: torch.Tensor,
                 sm_scale: float, topk_length: Optional[torch.Tensor] = None,
                 attn_sink: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q_all [tokens, heads, 576]; kv_cache the layer's pool rows [slots, 1, 656] uint8 (fp8_e4m3) or
        [slots, 1, 576] bf16; page_table_1 [tokens, topk] int32 KV-pool slots (-1 = none); topk_length [tokens]
        int32 or None; attn_sink [heads] or None. Returns o [tokens, heads, 512] in q's dtype."""
        if v_head_dim != HEAD_DIM_V:
            raise ValueError(f"flashmla_backend: v_head_dim must be {HEAD_DIM_V} for sparse decode, got {v_head_dim}")
        if q_all.dim() != 3 or page_table_1.dim() != 2 or page_table_1.shape[0] != q_all.shape[0]:
            raise ValueError(f"flashmla_backend: q_all must be [tokens, heads, {HEAD_DIM_K}] and page_table_1 [tokens, "
                             f"topk] for the same tokens, got {tuple(q_all.shape)} and {tuple(page_table_1.shape)}")
        tokens, heads = q_all.shape[0], q_all.shape[1]
        if tokens == 0:
            return q_all.new_empty((0, heads, v_head_dim))
        slots, width = kv_cache.shape[0], kv_cache.shape[-1]
        if slots % self.page_size != 0:
            raise ValueError(f"flashmla_backend: the KV pool has {slots} rows, not whole pages of {self.page_size}; "
                             "the sparse indices address it as pages")
        k_cache = kv_cache.view(slots // self.page_size, self.page_size, 1, width)  # slot = page * 64 + offset
        if topk_length is not None and topk_length.shape[0] != tokens:
            topk_length = None  # SGLang's own kernel call drops mismatched rows the same way
        if attn_sink is not None and attn_sink.dtype != torch.float32:
            attn_sink = attn_sink.float()
        scale = float(sm_scale) * (1.5 if debug_break_scale_enabled(self.draft) else 1.0)
        key = (tokens, heads, page_table_1.shape[1])
        sched_meta = self._sched_metas.get(key)
        if sched_meta is None:
            sched_meta = flashmla_backend.fill_sparse_sched_meta(
                flashmla_backend.get_mla_metadata()[0], batch=tokens, s_q=1, num_heads_q=heads,
                topk=page_table_1.shape[1], device=q_all.device, is_fp8_kvcache=self.fp8,
                page_block_size=self.page_size)
            self._sched_metas[key] = sched_meta
        out, _ = flashmla_backend.flash_mla_with_kvcache(
            q_all.unsqueeze(1), k_cache, None, None, v_head_dim, sched_meta, None, softmax_scale=scale, causal=False,
            is_fp8_kvcache=self.fp8, indices=page_table_1.unsqueeze(1), topk_length=topk_length, attn_sink=attn_sink)
        return out.squeeze(1)


def _speculative(model_runner) -> bool:
    algorithm = getattr(model_runner, "spec_algorithm", None)
    running = algorithm is not None and not algorithm.is_none()
    return bool(running or getattr(model_runner, "is_draft_worker", False))


def adopt(backend, model_runner) -> DSADecode:
    """After SGLang's DeepseekSparseAttnBackend constructor: check, then route its decode kernel to DSADecode.

    Reads the attributes SGLang's constructor sets (0.5.17, 0.5.21, 0.5.23): num_q_heads, kv_cache_dtype,
    dsa_kv_cache_store_fp8, kv_cache_dim, kv_lora_rank, qk_rope_head_dim, dsa_index_kpool (0.5.21, 0.5.23; 1 where
    absent), dcp_size (0.5.23; 1 where absent), hisparse_coordinator, device, token_to_kv_pool.page_size,
    dsa_decode_impl. Raises NotImplementedError naming what works, or RuntimeError on a CUDA device."""
    problem = serving_problem(
        num_heads=backend.num_q_heads, kv_cache_dtype=backend.kv_cache_dtype,
        model_dtype=getattr(model_runner, "dtype", None), kv_cache_dim=backend.kv_cache_dim,
        store_fp8=bool(backend.dsa_kv_cache_store_fp8), kv_lora_rank=backend.kv_lora_rank,
        qk_rope_head_dim=backend.qk_rope_head_dim, page_size=backend.token_to_kv_pool.page_size,
        index_kpool=getattr(backend, "dsa_index_kpool", 1), dcp_size=getattr(backend, "dcp_size", 1),
        hisparse=backend.hisparse_coordinator is not None, speculative=_speculative(model_runner),
        device=backend.device)
    if problem == KERNEL_MISSING:
        raise RuntimeError(problem)
    if problem is not None:
        raise NotImplementedError(problem)
    fp8 = backend.kv_cache_dtype == torch.float8_e4m3fn
    decoder = DSADecode(backend.token_to_kv_pool.page_size, fp8)
    replaced = backend.dsa_decode_impl
    backend.dsa_decode_impl = STAND_IN
    setattr(backend, ATTR, decoder)
    global _announced
    if not _announced:
        _announced = True
        on_gpu = torch.device(backend.device).type == "cuda"
        logger.info("flashmla_backend: SGLang's DSA decode runs on flashmla_backend %s sparse decode (%s; SGLang's "
                    "resolved --dsa-decode-backend %s is not used), %d heads per rank, KV cache %s.",
                    flashmla_backend.__version__,
                    (f"the Hopper sparse decode kernel, so far run inside SGLang with a tiny test model only: "
                     f"{SPARSE_GPU_ENV} is set" if fp8 else
                     f"the dense decode kernel on the gathered tokens, so far run inside SGLang with a tiny test model "
                     f"only: {SPARSE_GPU_ENV} is set")
                    if on_gpu else "the PyTorch reference, no CUDA device", replaced, backend.num_q_heads,
                    "fp8_e4m3 (656-byte fp8_ds_mla tokens)" if fp8 else "bfloat16")
    return decoder


def init_hook(original, self, model_runner, *args, **kwargs):
    """AROUND hook of DeepseekSparseAttnBackend.__init__."""
    original(self, model_runner, *args, **kwargs)
    adopt(self, model_runner)


def decode_hook(original, self, *args, **kwargs):
    """AROUND hook of DeepseekSparseAttnBackend.forward_decode: marks the call for kernel_hook."""
    decoder = getattr(self, ATTR, None)
    if decoder is None:
        return original(self, *args, **kwargs)
    decoder.active = True
    try:
        return original(self, *args, **kwargs)
    finally:
        decoder.active = False


def kernel_hook(original, self, *args, **kwargs):
    """AROUND hook of DeepseekSparseAttnBackend._forward_flashmla_sparse: DSADecode inside decode, else SGLang's."""
    decoder = getattr(self, ATTR, None)
    if decoder is None or not decoder.active:
        return original(self, *args, **kwargs)
    return decoder(*args, **kwargs)


def unsupported_reason() -> Optional[str]:
    """None when the installed SGLang has the backend class the hooks patch, else why."""
    try:
        found = importlib.util.find_spec(BACKEND_MODULE) is not None
    except ImportError:
        found = False
    if found:
        return None
    from . import _compat

    version = _compat.installed_sglang_version() or "(not installed)"
    return (f"flashmla_backend: {DSA_DECODE_ENV} is set, but SGLang {version} has no {BACKEND_MODULE} (SGLang's DSA "
            f"attention backend, DeepseekSparseAttnBackend), which flashmla_backend's DSA decode hooks (SGLang 0.5.17, "
            f"0.5.21 and 0.5.23 have it). Unset {DSA_DECODE_ENV} or install one of those releases.")


def register_hooks() -> bool:
    """Register the three hooks with SGLang's HookRegistry when FLASHMLA_BACKEND_DSA_DECODE is set (False when not).
    Raises RuntimeError when it is set and this SGLang lacks the backend class."""
    if not enabled():
        return False
    reason = unsupported_reason()
    if reason is not None:
        raise RuntimeError(reason)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(INIT_TARGET, init_hook, HookType.AROUND)
    HookRegistry.register(DECODE_TARGET, decode_hook, HookType.AROUND)
    HookRegistry.register(KERNEL_TARGET, kernel_hook, HookType.AROUND)
    return True
