"""The one validation layer: every public entry point checks its arguments here.

Shape, dtype, device and layout checks read only tensor metadata (no host sync, traceable by
torch.compile). Checks of VALUES that live on the GPU (lengths against the block table, page ids,
stale scheduler metadata) need a device-to-host copy, so on CUDA tensors they run only in the opt-in
checked mode, FLASHMLA_BACKEND_CHECK=1 (and never while a CUDA graph is being captured). On CPU
tensors they always run. Without the checked mode the kernels clamp lengths to [0, 64 * max_pages]
so that no read leaves the block table.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import _env, scheduler

HEAD_DIM_K = 576
HEAD_DIM_V = 512
PAGE_SIZE = scheduler.PAGE_SIZE
CHECK_ENV = "FLASHMLA_BACKEND_CHECK"
FLOAT_DTYPES = (torch.bfloat16, torch.float16)


class Shapes(NamedTuple):
    batch: int
    seqlen_q: int
    num_heads_q: int
    num_heads_kv: int
    num_pages: int
    max_pages: int
    num_sm_parts: int

    @property
    def q_rows(self) -> int:
        return self.seqlen_q * (self.num_heads_q // self.num_heads_kv)


def checked_mode() -> bool:
    return _env.flag(CHECK_ENV)


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device} with strides {t.stride()}"


def _require(cond: bool, exc: type[Exception], msg) -> None:
    """Raises exc("flashmla_backend: " + msg) unless cond. msg may be a callable returning the text, so
    that the message (tensor descriptions) is only formatted on failure: this runs on every decode call."""
    if not cond:
        raise exc(f"flashmla_backend: {msg() if callable(msg) else msg}")


def _tensor(name: str, t, ndim: int, dtypes: tuple, what: str) -> None:
    _require(isinstance(t, torch.Tensor), TypeError, lambda: f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _require(t.dim() == ndim, ValueError, lambda: f"{name} must be {what} ({ndim}-D), got {_describe(t)}")
    _require(t.dtype in dtypes, TypeError,
             lambda: f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {_describe(t)}")
    _require(t.numel() == 0 or t.stride(-1) == 1, ValueError,
             lambda: f"{name} must have a contiguous last dimension (stride 1), got {_describe(t)}")


def _same_device(name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str) -> None:
    _require(t.device == ref.device, ValueError,
             lambda: f"{name} is on {t.device} but {ref_name} is on {ref.device}: all tensors must be on one device")


def validate_metadata_args(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None,
                           is_fp8_kvcache=False, topk=None) -> None:
    _tensor("cache_seqlens", cache_seqlens, 1, (torch.int32,), "[batch] int32")
    for name, v in (("num_q_tokens_per_head_k", num_q_tokens_per_head_k), ("num_heads_k", num_heads_k)):
        _require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, ValueError,
                 lambda: f"{name} must be a positive int, got {v!r}")
    if num_heads_q is not None:
        _require(isinstance(num_heads_q, int) and num_heads_q >= 1 and num_heads_q % num_heads_k == 0, ValueError,
                 lambda: f"num_heads_q must be a positive multiple of num_heads_k={num_heads_k}, got {num_heads_q!r}")
    if is_fp8_kvcache:
        raise NotImplementedError("flashmla_backend: FP8 KV cache is not supported yet (bf16 and fp16 caches are)")
    if topk is not None:
        raise NotImplementedError("flashmla_backend: sparse attention (topk) is not supported; only dense decode")


_I32 = torch.int32


def _decode_args_ok(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                    softmax_scale, causal) -> bool:
    """Fast path of validate_decode_args, on every decode call: True only when every check below passes
    (it is stricter where that is simpler: any contiguous-last-dim test is stride(-1) == 1 even for empty
    tensors). False sends the call through the checks one by one, which raise the error that names the
    argument. Keeps an eager call's Python cost low (~4x cheaper than the step-by-step checks)."""
    meta = tile_scheduler_metadata
    try:
        if not (isinstance(q, torch.Tensor) and isinstance(k_cache, torch.Tensor)
                and isinstance(block_table, torch.Tensor) and isinstance(cache_seqlens, torch.Tensor)
                and isinstance(meta, torch.Tensor) and isinstance(num_splits, torch.Tensor)):
            return False
        dev = q.device
        qs, ks, bs, ms = q.shape, k_cache.shape, block_table.shape, meta.shape
        if not (len(qs) == 4 and len(ks) == 4 and len(bs) == 2 and len(ms) == 2 and cache_seqlens.dim() == 1
                and num_splits.dim() == 1):
            return False
        b, s_q, h_q, d = qs
        num_pages, page_size, h_kv, d_k = ks
        return bool(
            q.dtype in FLOAT_DTYPES and k_cache.dtype is q.dtype and block_table.dtype is _I32
            and cache_seqlens.dtype is _I32 and meta.dtype is _I32 and num_splits.dtype is _I32
            and q.stride(-1) == 1 and k_cache.stride(-1) == 1 and block_table.stride(-1) == 1
            and dev.type in ("cuda", "cpu") and k_cache.device == dev and block_table.device == dev
            and cache_seqlens.device == dev and meta.device == dev and num_splits.device == dev
            and d == HEAD_DIM_K and d_k == HEAD_DIM_K and head_dim_v == HEAD_DIM_V and page_size == PAGE_SIZE
            and h_kv >= 1 and h_q >= 1 and h_q % h_kv == 0 and s_q >= 1 and num_pages >= 1
            and bs[0] == b and bs[1] >= 1 and cache_seqlens.shape[0] == b and ms[0] >= 1
            and ms[1] == scheduler.META_INTS and num_splits.shape[0] == b + 1
            and meta.is_contiguous() and num_splits.is_contiguous() and cache_seqlens.is_contiguous()
            and (softmax_scale is None or (type(softmax_scale) in (float, int) and softmax_scale > 0))
            and type(causal) is bool)
    except Exception:  # anything unexpected: let the step-by-step checks say what is wrong
        return False


def validate_decode_args(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                         softmax_scale, causal) -> None:
    # (torch.compile traces the step-by-step checks: its guards make them free after the first call)
    if not torch.compiler.is_compiling() and _decode_args_ok(
            q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits, softmax_scale, causal):
        return
    _tensor("q", q, 4, FLOAT_DTYPES, "[batch, seqlen_q, num_heads_q, 576]")
    if isinstance(k_cache, torch.Tensor) and k_cache.dtype not in FLOAT_DTYPES and k_cache.element_size() == 1:
        raise NotImplementedError(
            f"flashmla_backend: k_cache has dtype {k_cache.dtype}: FP8 KV caches are not supported yet "
            "(use a bf16 or fp16 cache)")
    _tensor("k_cache", k_cache, 4, FLOAT_DTYPES,
            "[num_pages, page_size, num_heads_k, 576] (a 3-D vLLM-style cache needs .unsqueeze(-2))")
    _tensor("block_table", block_table, 2, (torch.int32,), "[batch, max_pages] int32")
    _tensor("cache_seqlens", cache_seqlens, 1, (torch.int32,), "[batch] int32")
    _tensor("tile_scheduler_metadata", tile_scheduler_metadata, 2, (torch.int32,), "[num_sm_parts, 8] int32")
    _tensor("num_splits", num_splits, 1, (torch.int32,), "[batch + 1] int32")
    for name, t in (("k_cache", k_cache), ("block_table", block_table), ("cache_seqlens", cache_seqlens),
                    ("tile_scheduler_metadata", tile_scheduler_metadata), ("num_splits", num_splits)):
        _same_device(name, t, q, "q")
    _require(q.device.type in ("cuda", "cpu"), ValueError, lambda: f"q is on {q.device}; only CUDA and CPU tensors work")

    b, s_q, h_q, d = q.shape
    num_pages, page_size, h_kv, d_k = k_cache.shape
    _require(d == HEAD_DIM_K, ValueError, lambda: f"q's last dimension must be {HEAD_DIM_K} (512 latent + 64 rope), got {_describe(q)}")
    _require(d_k == HEAD_DIM_K, ValueError, lambda: f"k_cache's last dimension must be {HEAD_DIM_K}, got {_describe(k_cache)}")
    _require(k_cache.dtype == q.dtype, TypeError,
             lambda: f"q and k_cache must have the same dtype, got q {q.dtype} and k_cache {k_cache.dtype}")
    _require(head_dim_v == HEAD_DIM_V, ValueError, lambda: f"head_dim_v must be {HEAD_DIM_V}, got {head_dim_v!r}")
    _require(page_size == PAGE_SIZE, ValueError,
             lambda: f"k_cache has page size {page_size} (dimension 1 of {_describe(k_cache)}); only {PAGE_SIZE}-token pages "
             "are supported (engines: use block size 64, or a multiple of it split into 64-token kernel blocks)")
    _require(h_kv >= 1 and h_q >= 1 and h_q % h_kv == 0, ValueError,
             lambda: f"num_heads_q ({h_q}) must be a multiple of num_heads_k ({h_kv})")
    _require(s_q >= 1, ValueError, lambda: f"q must have seqlen_q >= 1, got {_describe(q)}")
    _require(num_pages >= 1, ValueError, lambda: f"k_cache must have at least one page, got {_describe(k_cache)}")
    _require(block_table.shape[0] == b and block_table.shape[1] >= 1, ValueError,
             lambda: f"block_table must be [batch={b}, max_pages >= 1], got {_describe(block_table)}")
    _require(cache_seqlens.shape[0] == b, ValueError, lambda: f"cache_seqlens must be [batch={b}], got {_describe(cache_seqlens)}")
    _require(tile_scheduler_metadata.shape[0] >= 1 and tile_scheduler_metadata.shape[1] == scheduler.META_INTS,
             ValueError, lambda: f"tile_scheduler_metadata must be [num_sm_parts, 8] from get_mla_metadata, got "
             f"{_describe(tile_scheduler_metadata)}")
    _require(num_splits.shape[0] == b + 1, ValueError,
             lambda: f"num_splits must be [batch + 1 = {b + 1}] from get_mla_metadata for this batch, got {_describe(num_splits)}")
    _require(tile_scheduler_metadata.is_contiguous() and num_splits.is_contiguous() and cache_seqlens.is_contiguous(),
             ValueError, "tile_scheduler_metadata, num_splits and cache_seqlens must be contiguous")
    _require(softmax_scale is None or (isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool)
                                       and softmax_scale > 0), ValueError,
             lambda: f"softmax_scale must be a positive float or None, got {softmax_scale!r}")
    _require(isinstance(causal, bool), TypeError, lambda: f"causal must be a bool, got {causal!r}")


def shapes_of(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
              tile_scheduler_metadata: torch.Tensor) -> Shapes:
    return Shapes(q.shape[0], q.shape[1], q.shape[2], k_cache.shape[2], k_cache.shape[0], block_table.shape[1],
                  tile_scheduler_metadata.shape[0])


def check_kernel_layout(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Alignment the kernels' 16-byte loads (cp.async, TMA) need. Pointer values: call with real tensors."""
    qst, kst = q.stride(), k_cache.stride()
    if not (q.data_ptr() % 16 or k_cache.data_ptr() % 16 or qst[0] % 8 or qst[1] % 8 or qst[2] % 8
            or kst[0] % 8 or kst[1] % 8 or kst[2] % 8):
        return  # fast path (stricter: size-1 dimensions' strides are checked too); else the messages below
    for name, t in (("q", q), ("k_cache", k_cache)):
        _require(t.data_ptr() % 16 == 0, ValueError, lambda: f"{name}'s data pointer must be 16-byte aligned (got "
                 f"{t.data_ptr() % 16} bytes past a 16-byte boundary; storage offset {t.storage_offset()})")
        bad = [st for st, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1 and st % 8 != 0]
        _require(not bad, ValueError, lambda: f"{name}'s strides must be multiples of 8 elements (16 bytes) for the kernels' "
                 f"vector loads, got {_describe(t)}")


def check_values(block_table: torch.Tensor, cache_seqlens: torch.Tensor, num_pages: int,
                 tile_scheduler_metadata: torch.Tensor | None = None, num_splits: torch.Tensor | None = None) -> None:
    """Value checks (host copies of the small index tensors; CPU path always, CUDA path in checked mode)."""
    lens = cache_seqlens.cpu().tolist()
    neg = [(i, n) for i, n in enumerate(lens) if n < 0]
    _require(not neg, ValueError, lambda: f"cache_seqlens must be >= 0, got negative lengths at (index, length) {neg[:8]}")
    max_pages = block_table.shape[1]
    short = [(i, n) for i, n in enumerate(lens) if -(-n // PAGE_SIZE) > max_pages]
    _require(not short, ValueError,
             lambda: f"block_table is too short: it has {max_pages} pages ({max_pages * PAGE_SIZE} tokens) per request but "
             f"cache_seqlens needs more at (index, length) {short[:8]}")
    table = block_table.cpu()
    for i, n in enumerate(lens):
        used = table[i, : -(-n // PAGE_SIZE)]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
            raise ValueError(f"flashmla_backend: block_table[{i}] holds page ids outside [0, {num_pages}) among the "
                             f"{used.numel()} pages request {i} uses: {used.tolist()[:16]}")
    if tile_scheduler_metadata is not None and num_splits is not None:
        want_meta, want_splits = scheduler.schedule(cache_seqlens.cpu(), tile_scheduler_metadata.shape[0])
        _require(torch.equal(want_meta, tile_scheduler_metadata.cpu()) and torch.equal(want_splits, num_splits.cpu()),
                 ValueError, "tile_scheduler_metadata/num_splits do not match cache_seqlens: recompute them with "
                 "get_mla_metadata whenever the lengths change (stale metadata, e.g. in a CUDA graph replay)")
