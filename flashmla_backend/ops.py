"""Public API, drop-in compatible with FlashMLA's decode API: dense decode, and sparse decode (indices).

    tile_scheduler_metadata, num_splits = get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)
    out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, HEAD_DIM_V,
                                      tile_scheduler_metadata, num_splits, softmax_scale=None, causal=False)

    sched_meta, _ = get_mla_metadata()                                   # sparse decode (DeepSeek-V3.2)
    out, lse = flash_mla_with_kvcache(q, k_cache, None, None, HEAD_DIM_V, sched_meta, None, softmax_scale=scale,
                                      causal=False, is_fp8_kvcache=True, indices=indices,
                                      topk_length=topk_length, attn_sink=attn_sink)

Dense decode: CUDA tensors run the kernels; CPU tensors run the pure-PyTorch reference. Both functions are also
registered as torch custom ops (torch.ops.flashmla_backend.get_mla_metadata / .mla_decode), which
is what torch.compile sees; eager calls skip the dispatcher for lower launch overhead. Sparse decode: CUDA tensors
run the sm90 sparse kernel (fp8_ds_mla caches) or, for a 16-bit cache, gather the named tokens and run the dense
decode on them; CPU tensors run the reference.
"""
from __future__ import annotations

import functools
import math
import numbers

import torch

from . import _ext, device, kv_format, scheduler, validate
from .geometry import HEAD_DIM_K, HEAD_DIM_V, META_INTS, PAGE_SIZE
from .reference import reference_decode, reference_sparse_decode
from .sched_meta import FlashMLASchedMeta

_DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1}
_FP8 = kv_format.E4M3


def _out_dtype(q: torch.Tensor) -> torch.dtype:
    """The output dtype: q's, or bf16 for an FP8 q (the fast mode)."""
    return torch.bfloat16 if q.dtype == _FP8 else q.dtype


# ---- get_mla_metadata -------------------------------------------------------------------------

def _metadata_impl(cache_seqlens: torch.Tensor, num_sm_parts: int,
                   min_part_blocks: int = scheduler.MIN_PART_BLOCKS) -> tuple[torch.Tensor, torch.Tensor]:
    b = cache_seqlens.shape[0]
    if cache_seqlens.device.type != "cuda":
        return scheduler.schedule(cache_seqlens, num_sm_parts, min_part_blocks)
    meta = torch.empty((num_sm_parts, META_INTS), dtype=torch.int32, device=cache_seqlens.device)
    num_splits = torch.empty((b + 1,), dtype=torch.int32, device=cache_seqlens.device)
    if b == 0:
        meta.zero_()
        meta[:, 2] = -1
        num_splits.zero_()
        return meta, num_splits
    idx = cache_seqlens.device.index
    _ext.ext().tile_scheduler(cache_seqlens.data_ptr(), b, num_sm_parts, min_part_blocks, meta.data_ptr(),
                              num_splits.data_ptr(), idx, _raw_stream(cache_seqlens.device))
    return meta, num_splits


@torch.library.custom_op("flashmla_backend::get_mla_metadata", mutates_args=())
def _metadata_op(cache_seqlens: torch.Tensor, num_sm_parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _metadata_impl(cache_seqlens, num_sm_parts)


@_metadata_op.register_fake
def _(cache_seqlens, num_sm_parts):
    b = cache_seqlens.shape[0]
    return (cache_seqlens.new_empty((num_sm_parts, META_INTS)), cache_seqlens.new_empty((b + 1,)))


def get_mla_metadata(cache_seqlens: torch.Tensor | None = None, num_q_tokens_per_head_k: int | None = None,
                     num_heads_k: int | None = None, num_heads_q: int | None = None, is_fp8_kvcache: bool = False,
                     topk: int | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor] | tuple[FlashMLASchedMeta, None]:
    """Tile-scheduler metadata for one decode step, computed on cache_seqlens' device without a host sync.

    cache_seqlens: [batch] int32. num_q_tokens_per_head_k: s_q * h_q // h_kv. num_heads_k: h_kv.
    Returns (tile_scheduler_metadata [num_sm_parts, META_INTS] int32, num_splits [batch + 1] int32); reuse
    them in every layer of the step. The schedule does not depend on the cache format: metadata made with
    either value of is_fp8_kvcache serves bf16, fp16 and float8_e4m3fn caches alike. num_sm_parts = SMs // h_kv // ceil(num_q_tokens_per_head_k / BLOCK_M).
    The int arguments may be Python or numpy integers. Negative lengths are refused (on CUDA tensors only with
    FLASHMLA_BACKEND_CHECK=1, as in flash_mla_with_kvcache).

    Without arguments (FlashMLA's newer convention): returns (FlashMLASchedMeta(), None), an empty object
    that the first flash_mla_with_kvcache call fills (flashmla_backend.sched_meta).
    """
    if cache_seqlens is None and num_q_tokens_per_head_k is None and num_heads_k is None and num_heads_q is None:
        return FlashMLASchedMeta(), None
    validate.validate_metadata_args(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q,
                                    is_fp8_kvcache, topk)
    # Lengths >= 0, where the metadata is made: always on CPU tensors; on CUDA only in the checked mode (a host
    # sync), never in capture (the decode checks them again, against the block table).
    if not torch.compiler.is_compiling() and validate.values_checked(cache_seqlens.device):
        validate.check_lengths(cache_seqlens)
    parts = scheduler.num_sm_parts(device.sm_count(cache_seqlens.device), int(num_heads_k),
                                   int(num_q_tokens_per_head_k))
    if torch.compiler.is_compiling():
        return torch.ops.flashmla_backend.get_mla_metadata(cache_seqlens, parts)
    meta, num_splits = _metadata_impl(cache_seqlens, parts)
    # Code written for FlashMLA's newer convention may call with this argument list, keep only the first element
    # and pass num_splits=None (vLLM's own FLASHMLA backend does): the metadata tensor carries its num_splits
    # and what it was computed for, so that flash_mla_with_kvcache can take it from there (_attached_splits).
    setattr(meta, _SPLITS_ATTR, (num_splits, cache_seqlens.shape[0], int(num_q_tokens_per_head_k), int(num_heads_k)))
    return meta, num_splits


_SPLITS_ATTR = "_flashmla_backend_num_splits"


# ---- flash_mla_with_kvcache -------------------------------------------------------------------

def _raw_stream(dev: torch.device) -> int:
    """cudaStream_t of the current stream, as an int (torch's cheap accessor where it exists)."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get is not None:
        return get(dev.index)
    return torch.cuda.current_stream(dev).cuda_stream


def _descale_strides(descale: torch.Tensor | None) -> tuple[int, int]:
    """Element strides (request, KV head) of a descale: (0, 0) for one value (or none), else its [b, h_kv] strides."""
    if descale is None or descale.numel() == 1:
        return 0, 0
    st = descale.stride()
    return st[0], st[1]


def _decode_cuda(q, k_cache, block_table, cache_seqlens, meta, num_splits, scale, causal, shapes, descale_q=None,
                 descale_k=None, q_pe=None):
    validate.check_kernel_layout(q, k_cache, q_pe)
    kernel = device.kernel_for(q.device)
    fmt = kv_format.of(k_cache)
    problem = fmt.kernel_problem(kernel, sparse=False)
    if problem:
        props = device.device_props(q.device.index)
        readable = ", ".join(f.name for f in kv_format.read_by(kernel))
        where = "; ".join(f"the {k} kernel runs on {device.KERNEL_GPUS[k]}" for k in fmt.dense_kernels)
        raise NotImplementedError(
            f"flashmla_backend: {problem}. {q.device} has compute capability {props.major}.{props.minor} and runs "
            f"the {kernel} kernel, which reads {readable} caches ({where}; or convert the cache)")
    b, s_q, h_q, h_kv = shapes.batch, shapes.seqlen_q, shapes.num_heads_q, shapes.num_heads_kv
    parts, q_rows = shapes.num_sm_parts, shapes.q_rows
    out_dtype = _out_dtype(q)
    out = torch.empty((b, s_q, h_q, HEAD_DIM_V), dtype=out_dtype, device=q.device)
    lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=q.device)
    # Split accumulators (params.h), one allocation: o_accum [b + parts, h_kv, q_rows, HEAD_DIM_V] then
    # lse_accum [b + parts, h_kv, q_rows]; HEAD_DIM_V * 4 bytes keeps lse_accum 16-byte aligned.
    n_rows = (b + parts) * h_kv * q_rows
    accum = torch.empty((n_rows * (HEAD_DIM_V + 1),), dtype=torch.float32, device=q.device)
    o_accum, lse_accum = accum[: n_rows * HEAD_DIM_V], accum[n_rows * HEAD_DIM_V:]
    index = q.device.index
    qst, kst = q.stride(), k_cache.stride()

    C = _ext.ext()
    a = C.DecodeArgs()
    a.kernel = kernel
    a.dtype = _DTYPE_CODE[out_dtype]
    a.kv_format = fmt.code
    a.q_fp8 = q.dtype == _FP8
    a.descale_q = descale_q.data_ptr() if descale_q is not None else 0
    a.descale_k = descale_k.data_ptr() if descale_k is not None else 0
    a.descale_q_stride_b, a.descale_q_stride_h = _descale_strides(descale_q)
    a.descale_k_stride_b, a.descale_k_stride_h = _descale_strides(descale_k)
    a.device = index
    a.stream = _raw_stream(q.device)
    a.batch, a.seqlen_q, a.num_heads_q, a.num_heads_kv = b, s_q, h_q, h_kv
    a.num_pages, a.max_pages_per_seq, a.num_sm_parts = shapes.num_pages, shapes.max_pages, parts
    a.scale = scale
    a.causal = causal
    a.pdl = device.device_props(index).major >= 9
    a.skip_combine = False
    a.q = q.data_ptr()
    a.q_stride_b, a.q_stride_s, a.q_stride_h = qst[0], qst[1], qst[2]
    if q_pe is None:  # one [.., 576] q: its rope columns start HEAD_DIM_V elements into each row
        a.q_pe = q.data_ptr() + HEAD_DIM_V * q.element_size()
        a.q_pe_stride_b, a.q_pe_stride_s, a.q_pe_stride_h = qst[0], qst[1], qst[2]
    else:
        pst = q_pe.stride()
        a.q_pe = q_pe.data_ptr()
        a.q_pe_stride_b, a.q_pe_stride_s, a.q_pe_stride_h = pst[0], pst[1], pst[2]
    a.kv = k_cache.data_ptr()
    a.kv_stride_page, a.kv_stride_token, a.kv_stride_h = kst[0], kst[1], kst[2]
    a.block_table = block_table.data_ptr()
    a.block_table_stride_b = block_table.stride(0)
    a.seqlens = cache_seqlens.data_ptr()
    a.sched_meta = meta.data_ptr()
    a.num_splits = num_splits.data_ptr()
    a.out = out.data_ptr()  # out and lse are contiguous (allocated above)
    a.out_stride_b, a.out_stride_s, a.out_stride_h = s_q * h_q * HEAD_DIM_V, h_q * HEAD_DIM_V, HEAD_DIM_V
    a.lse = lse.data_ptr()
    a.lse_stride_b, a.lse_stride_h = h_q * s_q, s_q
    a.lse_accum = lse_accum.data_ptr()
    a.o_accum = o_accum.data_ptr()
    a.indices, a.indices_stride, a.num_kv_tokens, a.topk_length, a.sparse_seqlen_q = 0, 0, 0, 0, 0  # dense decode
    C.mla_decode(a)
    return out, lse


def _decode_impl(q, k_cache, block_table, cache_seqlens, meta, num_splits, scale, causal, descale_q=None,
                 descale_k=None, q_pe=None):
    shapes = validate.shapes_of(q, k_cache, block_table, meta)
    on_cuda = q.device.type == "cuda"
    # Value checks (lengths, page ids, metadata against the lengths and shapes, descale values): always on CPU
    # tensors; on CUDA only in the checked mode (a host sync), never in capture.
    if validate.values_checked(q.device):
        validate.check_values(k_cache, block_table, cache_seqlens)
        validate.check_schedule(q, k_cache, cache_seqlens, meta, num_splits)
        validate.check_descales(descale_q, descale_k)
    if shapes.batch == 0:
        return (q.new_empty((0, shapes.seqlen_q, shapes.num_heads_q, HEAD_DIM_V), dtype=_out_dtype(q)),
                q.new_empty((0, shapes.num_heads_q, shapes.seqlen_q), dtype=torch.float32))
    if not on_cuda:
        return reference_decode(q if q_pe is None else torch.cat([q, q_pe], dim=-1), k_cache, block_table,
                                cache_seqlens, HEAD_DIM_V, scale, causal, descale_q=descale_q, descale_k=descale_k)
    return _decode_cuda(q, k_cache, block_table, cache_seqlens, meta, num_splits, scale, causal, shapes, descale_q,
                        descale_k, q_pe)


@torch.library.custom_op("flashmla_backend::mla_decode", mutates_args=())
def _decode_op(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
               tile_scheduler_metadata: torch.Tensor, num_splits: torch.Tensor, softmax_scale: float,
               causal: bool, descale_q: torch.Tensor | None = None, descale_k: torch.Tensor | None = None,
               q_pe: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _decode_impl(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits,
                        softmax_scale, causal, descale_q, descale_k, q_pe)


@_decode_op.register_fake
def _(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits, softmax_scale, causal,
      descale_q=None, descale_k=None, q_pe=None):
    b, s_q, h_q, _ = q.shape
    return (q.new_empty((b, s_q, h_q, HEAD_DIM_V), dtype=_out_dtype(q)),
            q.new_empty((b, h_q, s_q), dtype=torch.float32))


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor | None,
                           cache_seqlens: torch.Tensor | None, head_dim_v: int,
                           tile_scheduler_metadata: torch.Tensor | FlashMLASchedMeta,
                           num_splits: torch.Tensor | None = None, softmax_scale: float | None = None,
                           causal: bool = False, is_fp8_kvcache: bool = False, indices: torch.Tensor | None = None,
                           attn_sink: torch.Tensor | None = None, extra_k_cache: torch.Tensor | None = None,
                           extra_indices_in_kvcache: torch.Tensor | None = None,
                           topk_length: torch.Tensor | None = None, extra_topk_length: torch.Tensor | None = None,
                           *, descale_q: torch.Tensor | None = None, descale_k: torch.Tensor | None = None,
                           q_pe: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode over a paged KV cache (FlashMLA's API: dense decode, and sparse decode with indices).

    The arguments after indices are FlashMLA's, in its order; with indices None (dense decode) attn_sink,
    topk_length and the extra_* arguments must be None. Sparse decode: see the last paragraph.

    Geometry (flashmla_backend.geometry): q [b, s_q, h_q, HEAD_DIM_K] bf16/fp16; k_cache [num_pages,
    PAGE_SIZE, h_kv, HEAD_DIM_K] (q's dtype); block_table [b, max_pages] int32; cache_seqlens [b] int32;
    head_dim_v = HEAD_DIM_V; metadata from get_mla_metadata for these cache_seqlens and shapes.
    softmax_scale: finite and positive (Python or numpy scalar), default HEAD_DIM_K ** -0.5 (engines pass
    the model's scale). causal: query token s of a request with n keys sees keys 0 .. n - s_q + s.
    Returns out [b, s_q, h_q, HEAD_DIM_V] (q's dtype) and lse [b, h_q, s_q] float32 (natural log); a row
    that sees no key gets out 0 and lse +inf; NaN in a row's scores (e.g. in q) gives NaN out and lse.
    Arguments are checked by the rule tables of flashmla_backend.validate; on CPU tensors also the values
    (lengths, page ids, metadata, descale_q / descale_k finite and positive), on CUDA tensors only with
    FLASHMLA_BACKEND_CHECK=1. The 16-byte alignment of q, k_cache and q_pe (data pointers, leading strides) is
    checked on CUDA tensors only, on every call; the CPU path reads any layout.

    Accepted without a check (README.md, "Inputs accepted without a check"; tests/test_unchecked_inputs.py):
    values of q and of the cache. +inf / -inf in q gives that row NaN out, like NaN, and an lse that is not finite
    (+inf, -inf or NaN); NaN in a cache slot a request reads gives NaN out and lse in every row that sees it (a
    row the causal mask hides it from gets NaN only in the out columns where the slot's value part is NaN);
    slots a request does not read are never read. There is no backward: with a q that requires grad, the CPU
    path returns the reference's result with its autograd history, the kernels return outputs that do not
    require grad, and backward through the custom op raises (torch.compile of such a call fails to compile).

    FlashMLA's newer convention is accepted too: tile_scheduler_metadata a FlashMLASchedMeta from
    get_mla_metadata() and num_splits None (flashmla_backend.sched_meta).

    FP8 KV cache: k_cache torch.float8_e4m3fn (same shape), true value = stored value x descale_k, a float32 tensor
    on the device (read by the kernel: it may change between CUDA-graph replays) of shape (1,) (one scale; any
    one-element tensor) or (b, h_kv) (request i's keys of KV head j scaled by descale_k[i, j]; any strides, so
    scale.expand(b, h_kv) works; descale_q likewise, for the query heads of KV head j). With a bf16/fp16
    q the output is that q's attention against the dequantized cache, in q's dtype (accurate mode); with a
    float8_e4m3fn q and descale_q (vLLM's FlashMLA-FP8 convention) the output is bf16 (fast mode). The kernel
    computes Q K^T on e4m3 tensor cores (a 16-bit q split row by row into two e4m3 terms under a power-of-two
    scale that follows the row's largest value, so q is not held to fp16's range) and P V on fp16 tensor cores with
    V converted exactly to fp16 (accurate mode) or on e4m3 ones with P rounded to e4m3 (fast mode). is_fp8_kvcache=True only asserts an FP8 cache of this layout.
    The kernels that read it: the fp8_e4m3 format of flashmla_backend.kv_format (a GPU whose kernel does not is
    refused, naming the one that does).

    q_pe (an extension of FlashMLA's API, for engines that hold q in two parts): q [b, s_q, h_q, HEAD_DIM_V] is the
    latent part and q_pe [b, s_q, h_q, ROPE_DIM] (q's dtype, its own strides) the rope part; the kernels read both
    in place, as if they were one [.., HEAD_DIM_K] q, saving the concatenation. Not with a FlashMLASchedMeta.

    Sparse decode (DeepSeek-V3.2's attention; indices not None), FlashMLA's sparse calling convention:
        sched_meta, _ = get_mla_metadata()
        out, lse = flash_mla_with_kvcache(q, k_cache, None, None, 512, sched_meta, None, softmax_scale=scale,
                                          causal=False, is_fp8_kvcache=True, indices=indices,
                                          topk_length=topk_length, attn_sink=attn_sink)
    q [b, s_q, h_q, 576] (bf16; fp16 too with a 16-bit cache); k_cache [num_pages, page_size, 1, width], any
    page_size, of one of two formats (flashmla_backend.kv_format): fp8_ds_mla, 656 bytes a token of dtype uint8,
    int8 or float8_e4m3fn, with is_fp8_kvcache=True (512 e4m3 latent values in four groups of 128 with a float32
    scale each, then 64 bf16 rope values; the byte layout is in flashmla_backend.fp8_ds_mla), or 16-bit in q's
    dtype, 576 a token, with is_fp8_kvcache=False. indices [b, s_q, topk] int32: entry v names the cache token
    k_cache[v // page_size, v % page_size, 0] (v = page * page_size + offset in the whole cache); an entry outside
    [0, num_pages * page_size), -1 by convention, is skipped and never read, and a token named twice counts twice.
    topk_length [b] int32 (optional): only the first topk_length[i] entries of request i count, 0 <= it <= topk.
    attn_sink [h_q] float32 (optional, not NaN): out of head h is multiplied by exp(lse) / (exp(lse) +
    exp(attn_sink[h])), lse is returned as it is (+inf: out 0; -inf: no effect). Returns out [b, s_q, h_q, 512] in
    q's dtype and lse [b, h_q, s_q] float32; a row whose entries are all skipped gets out 0 and lse +inf.
    tile_scheduler_metadata is a FlashMLASchedMeta (get_mla_metadata() without arguments) and num_splits None:
    the first call records its configuration (topk among it) and later calls must match it; block_table and
    cache_seqlens are not read (None, or any tensor); causal must be False; descale_q, descale_k, q_pe and the
    extra_* arguments (a second cache) are refused. Value checks (topk_length within [0, topk], attn_sink not NaN)
    run on CPU tensors, and on CUDA tensors with FLASHMLA_BACKEND_CHECK=1. CPU tensors run the pure-PyTorch
    reference (flashmla_backend.reference.sparse_mla_decode_reference, which dequantizes fp8_ds_mla tokens exactly
    in float32). CUDA tensors run the sm90 sparse kernel, which reads fp8_ds_mla caches stored token after token
    (a contiguous k_cache; a strided one raises ValueError) with a bf16 q; other GPUs raise NotImplementedError,
    naming what reads the cache, rather than run the reference on the GPU unannounced. Its schedule (the
    FlashMLASchedMeta's tensors, computed by the first call) takes every row at topk entries; the kernel reads
    topk_length itself, so the replays of a captured graph follow new values. A 16-bit cache (q's dtype) on CUDA
    tensors: each query token's counted tokens are copied, in index order, into a scratch cache of 64-token pages
    (at most GATHER_CHUNK_BYTES at a time) and the dense decode runs on them, on any GPU the dense decode runs on,
    out in q's dtype; its schedule is computed on the device in every call, so graph replays follow new indices and
    topk_length too. attn_sink is applied after the kernel, in float32.
    """
    if indices is not None:
        return _sparse_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                              softmax_scale, causal, is_fp8_kvcache, indices, attn_sink, extra_k_cache,
                              extra_indices_in_kvcache, topk_length, extra_topk_length, descale_q, descale_k, q_pe)
    validate.check_dense_flags(k_cache, is_fp8_kvcache, attn_sink, extra_k_cache, extra_indices_in_kvcache,
                               topk_length, extra_topk_length)
    if num_splits is None and isinstance(tile_scheduler_metadata, torch.Tensor):
        num_splits = _attached_splits(tile_scheduler_metadata, q, k_cache)
    if isinstance(tile_scheduler_metadata, FlashMLASchedMeta):
        if q_pe is not None:
            raise TypeError("flashmla_backend: q_pe works with the tensors of get_mla_metadata(cache_seqlens, ...), not "
                            "with a FlashMLASchedMeta; pass one [.., 576] q, or compute the metadata tensors")
        tile_scheduler_metadata, num_splits = _from_sched_meta(
            tile_scheduler_metadata, num_splits, q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale,
            causal, is_fp8_kvcache, descale_q, descale_k)
    validate.validate_decode_args(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                  num_splits, softmax_scale, causal, descale_q, descale_k, q_pe)
    scale = float(softmax_scale) if softmax_scale is not None else HEAD_DIM_K ** -0.5
    if torch.compiler.is_compiling():
        return torch.ops.flashmla_backend.mla_decode(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata,
                                                     num_splits, scale, causal, descale_q, descale_k, q_pe)
    return _decode_impl(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits, scale, causal,
                        descale_q, descale_k, q_pe)


def flash_mla_with_kvcache_fp8(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                               cache_seqlens: torch.Tensor, head_dim_v: int,
                               tile_scheduler_metadata: torch.Tensor | FlashMLASchedMeta,
                               num_splits: torch.Tensor | None = None, softmax_scale: float | None = None,
                               causal: bool = False, descale_q: torch.Tensor | None = None,
                               descale_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's FlashMLA-FP8 entry point, same argument order: flash_mla_with_kvcache with an FP8 k_cache.

    q float8_e4m3fn with descale_q (fast mode, bf16 output) or bf16/fp16 q without it (accurate mode).
    A k_cache that is not float8_e4m3fn is refused (a 16-bit cache goes to flash_mla_with_kvcache)."""
    if not (isinstance(k_cache, torch.Tensor) and k_cache.dtype == _FP8):
        raise TypeError(
            "flashmla_backend: flash_mla_with_kvcache_fp8 needs k_cache of dtype torch.float8_e4m3fn (with "
            f"descale_k), got k_cache {getattr(k_cache, 'dtype', type(k_cache).__name__)}; call "
            "flash_mla_with_kvcache for a bf16/fp16 cache")
    return flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                  num_splits, softmax_scale, causal, descale_q=descale_q, descale_k=descale_k)


def _sparse_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits, softmax_scale, causal,
                   is_fp8_kvcache, indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length,
                   extra_topk_length, descale_q, descale_k, q_pe):
    """flash_mla_with_kvcache with indices: check, refuse what no kernel reads, fill or check the FlashMLASchedMeta,
    run the kernel (CUDA tensors) or the reference (CPU tensors)."""
    validate.validate_sparse_args(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits, softmax_scale,
                                  causal, is_fp8_kvcache, indices, attn_sink, extra_k_cache, extra_indices_in_kvcache,
                                  topk_length, extra_topk_length, descale_q, descale_k, q_pe)
    if torch.compiler.is_compiling():
        raise RuntimeError("flashmla_backend: torch.compile does not trace sparse decode (indices) yet; call it "
                           "outside the compiled region")
    on_cuda = q.device.type == "cuda"
    fmt = kv_format.of(k_cache)
    gathered = fmt in kv_format.SIXTEEN_BIT
    if on_cuda:
        kernel = device.kernel_for(q.device)
        # A 16-bit cache is gathered into a paged scratch cache and read by the dense decode (_sparse_decode_gathered)
        problem = fmt.kernel_problem(kernel, sparse=not gathered)
        if problem:
            raise NotImplementedError(
                f"flashmla_backend: {problem}, so this sparse decode does not run on CUDA tensors; the pure-PyTorch "
                "reference runs it on CPU tensors (flash_mla_with_kvcache with CPU tensors, or "
                "flashmla_backend.reference.sparse_mla_decode_reference)")
    if validate.values_checked(q.device):
        validate.check_sparse_values(indices, topk_length, attn_sink)
    config = meta.config_of(q, k_cache, causal, bool(is_fp8_kvcache), indices.shape[-1])
    if meta.have_initialized:
        meta.check_matches(config)
    if not on_cuda:  # the reference needs no schedule: the object records the configuration, its tensors stay None
        meta.config, meta.have_initialized = config, True
        return reference_sparse_decode(q, k_cache, indices, softmax_scale, topk_length, attn_sink)
    scale = float(softmax_scale) if softmax_scale is not None else HEAD_DIM_K ** -0.5
    if gathered:  # the object records the configuration; the dense decode schedules each call's gathered tokens
        meta.config, meta.have_initialized = config, True
        return _sparse_decode_gathered(q, k_cache, scale, indices, topk_length, attn_sink)
    return _sparse_decode_cuda(q, k_cache, meta, config, scale, indices, topk_length, attn_sink)


# Bytes of gathered 16-bit tokens one dense call reads at most (_sparse_decode_gathered): rows beyond it go in
# further calls, so the scratch cache stays bounded for any count of rows (vLLM runs prefill tokens as rows too).
GATHER_CHUNK_BYTES = 256 << 20


def _sparse_decode_gathered(q, k_cache, scale, indices, topk_length, attn_sink):
    """Sparse decode of a 16-bit cache through the dense decode: each row's (query token's) counted entries that
    name a token are copied, in index order, into a scratch cache of 64-token pages, and the dense decode reads the
    rows as requests of one query token with those lengths (their page tables the scratch pages). Skipped entries
    (negative, past the cache, past topk_length) are never read; a row left with no entry gets out 0 and lse +inf,
    as the dense decode gives an empty request. Device-independent: on CUDA tensors the dense kernels run, on CPU
    tensors the dense reference (the tests compare this mapping with the sparse reference so). No host sync, so
    CUDA graphs capture it; the dense schedule is computed on the device in every call (get_mla_metadata). Costs
    a copy of the counted tokens (1152 bytes each) beyond what a gathering kernel would read."""
    b, s_q, h_q, d = q.shape
    topk = indices.shape[-1]
    rows = b * s_q
    page_size = k_cache.shape[1]
    num_tokens = k_cache.shape[0] * page_size
    dev = q.device
    idx = indices.reshape(rows, topk)
    valid = (idx >= 0) & (idx < num_tokens)
    if topk_length is not None:
        per_row = topk_length.to(device=dev, dtype=torch.int64).repeat_interleave(s_q)
        valid &= torch.arange(topk, device=dev)[None, :] < per_row[:, None]
    counts = valid.sum(dim=-1, dtype=torch.int32)
    pages = -(-topk // PAGE_SIZE)
    width = pages * PAGE_SIZE
    # Entry j of a row goes to slot (the number of counted entries before it); skipped ones to the spare last slot.
    slot = torch.where(valid, valid.cumsum(dim=-1) - 1, width)
    compact = torch.zeros((rows, width + 1), dtype=torch.int64, device=dev)
    compact.scatter_(1, slot, torch.where(valid, idx.long(), 0))
    compact = compact[:, :width]  # slots past a row's count name token 0: gathered, never read (past its length)
    q_rows = q.reshape(rows, 1, h_q, d)
    out = torch.empty((rows, 1, h_q, HEAD_DIM_V), dtype=q.dtype, device=dev)
    lse = torch.empty((rows, h_q, 1), dtype=torch.float32, device=dev)
    # Rows in chunks of at most GATHER_CHUNK_BYTES of scratch, of equal size (113 + 15 rows left a chunk too small to
    # fill the GPU: each chunk is a dense decode call of its own).
    most = max(1, GATHER_CHUNK_BYTES // (width * d * k_cache.element_size()))
    chunk = -(-rows // -(-rows // most)) if rows else 1
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        n = r1 - r0
        tok = compact[r0:r1]
        scratch = _gather_tokens(k_cache, tok.reshape(-1)).reshape(n * pages, PAGE_SIZE, 1, d)
        table = torch.arange(n * pages, dtype=torch.int32, device=dev).reshape(n, pages)
        lens = counts[r0:r1]
        md, splits = get_mla_metadata(lens, h_q, 1)
        o, l = flash_mla_with_kvcache(q_rows[r0:r1], scratch, table, lens, HEAD_DIM_V, md, splits,
                                      softmax_scale=scale, causal=False)
        out[r0:r1], lse[r0:r1] = o, l
    out = out.reshape(b, s_q, h_q, HEAD_DIM_V)
    lse = lse.reshape(b, s_q, h_q).transpose(1, 2).contiguous()
    return _with_attn_sink(out, lse, attn_sink)


def _gather_tokens(k_cache, tok):
    """Tokens `tok` (flat ids, 1-d int64) of a 16-bit cache [pages, page_size, 1, d], as [len(tok), d]. Where the
    tokens are evenly strided rows (any page stride that is page_size rows, as every engine's cache is) the rows are
    copied by index_select as 16-byte or 8-byte words: per-element advanced indexing of 2-byte values ran the
    gather at about 260 GB/s on an H200. Other layouts take advanced indexing."""
    pages, page_size, _, d = k_cache.shape
    st = k_cache.stride()
    if st[3] == 1 and st[0] == page_size * st[1]:
        rows = k_cache.as_strided((pages * page_size, d), (st[1], 1))
        for word in (torch.complex128, torch.int64):
            try:
                words = rows.view(word)  # needs the row stride, the row bytes and the offset in whole words
            except RuntimeError:
                continue
            return torch.index_select(words, 0, tok).view(k_cache.dtype)
        return torch.index_select(rows, 0, tok)
    return k_cache[tok // page_size, tok % page_size, 0]


def _with_attn_sink(out, lse, attn_sink):
    """out [b, s_q, h_q, 512] scaled by exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink), in float32; lse
    [b, h_q, s_q] as it is; rows with no key (lse +inf) stay 0."""
    if attn_sink is None:
        return out, lse
    factor = torch.where(lse == math.inf, 0.0, torch.sigmoid(lse - attn_sink.float()[None, :, None]))
    return (out.float() * factor.transpose(1, 2)[..., None]).to(out.dtype), lse


@functools.lru_cache(maxsize=1024)
def _sparse_schedule_splits(rows: int, topk: int, parts: int) -> bool:
    """Whether the sparse schedule of `rows` rows of topk entries on `parts` parts cuts a row in splits, from the tile
    scheduler's Python mirror (the same metadata as the GPU's, bit for bit; a few ms at 16k rows, once per shape).
    Where it cuts none (b >= 64 at top-k 2048 and h_q 128, say), every row is written by the decode kernel and the
    combine is not launched: its grid of CTAs that all return at once cost about 5 µs at b128 h_q 128."""
    if rows == 0:
        return False
    _, splits = scheduler.schedule(torch.full((rows,), topk, dtype=torch.int32), parts,
                                   scheduler.SPARSE_MIN_PART_BLOCKS)
    return bool((splits[1:] - splits[:-1]).max() > 1)


def _fill_sparse_schedule(meta: FlashMLASchedMeta, config, rows: int, topk: int, h_q: int, dev: torch.device) -> None:
    """The sparse schedule of `meta` on a CUDA device: rows of topk entries, h_q heads (one latent KV head)."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("flashmla_backend: a FlashMLASchedMeta is being filled during CUDA-graph capture; fill "
                           "it with one call before capture, or with fill_sparse_sched_meta (replays would otherwise "
                           "read the capture-time metadata)")
    # Every row is scheduled at topk entries; the kernel reads topk_length itself (csrc/params.h), so the schedule
    # holds for any topk_length, also in the replays of a captured graph.
    lengths = torch.full((rows,), topk, dtype=torch.int32, device=dev)
    parts = scheduler.sparse_num_sm_parts(device.sm_count(dev), rows, topk, h_q)
    tile_md, splits = _metadata_impl(lengths, parts, scheduler.SPARSE_MIN_PART_BLOCKS)
    meta.tile_scheduler_metadata, meta.num_splits, meta.sparse_lengths = tile_md, splits, lengths
    meta.sparse_split = _sparse_schedule_splits(rows, topk, parts)
    meta.config, meta.have_initialized = config, True


def fill_sparse_sched_meta(meta: FlashMLASchedMeta, *, batch: int, s_q: int, num_heads_q: int, topk: int,
                           device: torch.device | str, is_fp8_kvcache: bool = True, page_block_size: int = PAGE_SIZE,
                           num_heads_k: int = 1) -> FlashMLASchedMeta:
    """Fill an empty FlashMLASchedMeta (get_mla_metadata() without arguments) for sparse decode before its first call.

    An extension of FlashMLA's convention, for engines whose metadata builder runs outside CUDA-graph capture while
    the decode calls are captured: the object's schedule is made here (on a CUDA device: the tile scheduler's kernel,
    no host sync), and the calls flash_mla_with_kvcache(q [batch, s_q, num_heads_q, 576], k_cache [pages,
    page_block_size, num_heads_k, row bytes], ..., causal=False, is_fp8_kvcache=is_fp8_kvcache, indices [batch,
    s_q, topk]) read it; a call with other shapes or flags raises ValueError naming them, as for an object its first
    call filled. Keep the object (and so its tensors) for as long as graphs captured with it are replayed. On a CPU
    device, and for a 16-bit cache (is_fp8_kvcache=False, whose decode schedules the tokens it gathers in every
    call), it records the configuration only. Returns `meta`.
    """
    if not isinstance(meta, FlashMLASchedMeta):
        raise TypeError(f"flashmla_backend: fill_sparse_sched_meta takes a FlashMLASchedMeta (get_mla_metadata() "
                        f"without arguments), got {type(meta).__name__}")
    if meta.have_initialized:
        raise ValueError("flashmla_backend: fill_sparse_sched_meta takes an empty FlashMLASchedMeta; this one was "
                         f"filled already (for {meta.config})")
    for name, value, least in (("batch", batch, 0), ("s_q", s_q, 1), ("num_heads_q", num_heads_q, 1),
                               ("topk", topk, 1), ("page_block_size", page_block_size, 1),
                               ("num_heads_k", num_heads_k, 1)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
            raise ValueError(f"flashmla_backend: fill_sparse_sched_meta: {name} must be an int >= {least}, got "
                             f"{value!r}")
    if num_heads_k != 1:
        raise ValueError(f"flashmla_backend: sparse decode reads one latent KV head, got num_heads_k {num_heads_k}")
    dev = torch.device(device)
    batch, s_q, num_heads_q, topk = int(batch), int(s_q), int(num_heads_q), int(topk)
    page_block_size = int(page_block_size)
    config = FlashMLASchedMeta.Config(batch, s_q, num_heads_q, page_block_size, int(num_heads_k), False,
                                      bool(is_fp8_kvcache), topk)
    if dev.type != "cuda" or not is_fp8_kvcache:  # a 16-bit cache's decode schedules its gathered tokens each call
        meta.config, meta.have_initialized = config, True
        return meta
    _fill_sparse_schedule(meta, config, batch * s_q, topk, num_heads_q, dev)
    return meta


def _sparse_decode_cuda(q, k_cache, meta, config, scale, indices, topk_length, attn_sink):
    """The sm90 sparse kernel through the dense decode's arguments (csrc/params.h: the sparse mapping): each query
    token is a row of its own (batch b * s_q, s_q 1, h_kv 1) whose keys are its index entries; the schedule is the
    tile scheduler's for rows of topk entries, computed by the first call of the FlashMLASchedMeta."""
    b, s_q, h_q, _ = q.shape
    topk = indices.shape[-1]
    rows = b * s_q
    kst = k_cache.stride()
    if kst[3] != 1 or kst[1] != k_cache.shape[3] or kst[0] != k_cache.shape[1] * k_cache.shape[3]:
        raise ValueError(
            "flashmla_backend: sparse decode on CUDA reads an fp8_ds_mla k_cache whose tokens lie one after another "
            f"(contiguous pages of {k_cache.shape[-1]}-byte tokens), got k_cache of shape {tuple(k_cache.shape)} with "
            f"strides {kst}; pass k_cache.contiguous() or the cache tensor itself")
    if meta.sparse_lengths is None:
        _fill_sparse_schedule(meta, config, rows, topk, h_q, q.device)
    tile_md, splits = meta.tile_scheduler_metadata, meta.num_splits
    parts = tile_md.shape[0]
    # Rows one after another: q [rows, h_q, 576] and indices [rows, topk] with one row stride each (that of s_q, or
    # of b where s_q is 1: a size-1 dimension's stride can be anything).
    def row_stride(st):
        return st[1] if s_q > 1 else st[0]

    qst = q.stride()
    if ((s_q > 1 and qst[0] != s_q * qst[1]) or qst[3] != 1 or qst[2] % 8 or row_stride(qst) % 8
            or q.data_ptr() % 16):
        q = q.contiguous()
        qst = q.stride()
    ist = indices.stride()
    if (s_q > 1 and ist[0] != s_q * ist[1]) or ist[2] != 1:
        indices = indices.contiguous()
        ist = indices.stride()
    out = torch.empty((b, s_q, h_q, HEAD_DIM_V), dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((b, s_q, h_q), dtype=torch.float32, device=q.device)
    n_rows = (rows + parts) * h_q
    accum = torch.empty((n_rows * (HEAD_DIM_V + 1),), dtype=torch.float32, device=q.device)
    o_accum, lse_accum = accum[: n_rows * HEAD_DIM_V], accum[n_rows * HEAD_DIM_V:]

    C = _ext.ext()
    a = C.DecodeArgs()
    a.kernel = "sm90"
    a.dtype = _DTYPE_CODE[torch.bfloat16]
    a.kv_format = kv_format.FP8_DS_MLA.code  # tokens that carry their scales: no descale
    a.q_fp8 = False
    a.descale_q = a.descale_k = 0
    a.descale_q_stride_b = a.descale_q_stride_h = a.descale_k_stride_b = a.descale_k_stride_h = 0
    a.block_table, a.block_table_stride_b = 0, 0
    a.device = q.device.index
    a.stream = _raw_stream(q.device)
    a.batch, a.seqlen_q, a.num_heads_q, a.num_heads_kv = rows, 1, h_q, 1
    a.num_pages, a.max_pages_per_seq, a.num_sm_parts = k_cache.shape[0], -(-topk // PAGE_SIZE), parts
    a.scale = scale
    a.causal = False
    a.pdl = True
    a.skip_combine = not meta.sparse_split
    a.q = q.data_ptr()
    a.q_stride_b, a.q_stride_s, a.q_stride_h = row_stride(qst), 0, qst[2]
    a.q_pe = q.data_ptr() + HEAD_DIM_V * q.element_size()
    a.q_pe_stride_b, a.q_pe_stride_s, a.q_pe_stride_h = row_stride(qst), 0, qst[2]
    a.kv = k_cache.data_ptr()
    a.kv_stride_page, a.kv_stride_token, a.kv_stride_h = kst[0], kst[1], kst[2]
    a.seqlens = meta.sparse_lengths.data_ptr()
    a.sched_meta = tile_md.data_ptr()
    a.num_splits = splits.data_ptr()
    a.out = out.data_ptr()
    a.out_stride_b, a.out_stride_s, a.out_stride_h = h_q * HEAD_DIM_V, 0, HEAD_DIM_V
    a.lse = lse.data_ptr()
    a.lse_stride_b, a.lse_stride_h = h_q, 1
    a.lse_accum = lse_accum.data_ptr()
    a.o_accum = o_accum.data_ptr()
    a.indices = indices.data_ptr()
    a.indices_stride = row_stride(ist)
    a.num_kv_tokens = k_cache.shape[0] * k_cache.shape[1]
    if topk_length is not None and (topk_length.dtype != torch.int32 or not topk_length.is_contiguous()):
        topk_length = topk_length.to(torch.int32).contiguous()
    a.topk_length = topk_length.data_ptr() if topk_length is not None else 0
    a.sparse_seqlen_q = s_q
    C.mla_decode(a)
    lse = lse.transpose(1, 2)
    if s_q > 1:
        lse = lse.contiguous()
    return _with_attn_sink(out, lse, attn_sink)


def _from_sched_meta(meta: FlashMLASchedMeta, num_splits, q, k_cache, block_table, cache_seqlens, head_dim_v,
                     softmax_scale, causal, is_fp8_kvcache, descale_q=None, descale_k=None):
    """The (tile_scheduler_metadata, num_splits) tensors of a FlashMLASchedMeta, filling it on its first call."""
    if num_splits is not None:
        raise TypeError("flashmla_backend: num_splits must be None when tile_scheduler_metadata is a FlashMLASchedMeta "
                        f"(from get_mla_metadata()), got {type(num_splits).__name__}")
    if torch.compiler.is_compiling():
        raise RuntimeError("flashmla_backend: torch.compile does not trace the FlashMLASchedMeta convention; pass the "
                           "tensors of get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv) instead")
    # The object is filled only from arguments that pass the checks; a reuse reads only q's and k_cache's shapes
    # (the decode's own checks follow), so it runs the checks only when those are not 4-D tensors, to name them.
    if not meta.have_initialized or not _both_4d(q, k_cache):
        validate.validate_reference_args(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal,
                                         descale_q, descale_k)
    # The recorded format is the cache's own (an FP8 cache with or without the is_fp8_kvcache flag).
    config = meta.config_of(q, k_cache, causal, bool(is_fp8_kvcache) or k_cache.dtype == _FP8, None)
    if meta.have_initialized:
        meta.check_matches(config)
        return meta.tile_scheduler_metadata, meta.num_splits
    if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("flashmla_backend: a FlashMLASchedMeta is being filled during CUDA-graph capture; fill it "
                           "with one call before capture (replays would otherwise read the capture-time metadata)")
    tile_md, splits = get_mla_metadata(cache_seqlens, config.s_q * config.h_q // config.h_k, config.h_k)
    meta.tile_scheduler_metadata, meta.num_splits = tile_md, splits
    meta.config, meta.have_initialized = config, True
    return tile_md, splits


def _attached_splits(meta: torch.Tensor, q, k_cache) -> torch.Tensor:
    """num_splits of a metadata tensor from get_mla_metadata(cache_seqlens, ...) passed with num_splits=None."""
    attached = getattr(meta, _SPLITS_ATTR, None)
    if attached is None:
        raise TypeError("flashmla_backend: num_splits is None but tile_scheduler_metadata is a tensor that does not "
                        "come from get_mla_metadata(cache_seqlens, ...): pass its num_splits, or use the object of "
                        "get_mla_metadata() (FlashMLA's newer convention)")
    num_splits, b, q_per_hk, h_k = attached
    if _both_4d(q, k_cache):  # otherwise the decode's checks name the argument
        h_kv = k_cache.shape[2]
        got = (q.shape[0], q.shape[1] * q.shape[2] // max(h_kv, 1), h_kv)
        if got != (b, q_per_hk, h_k):
            raise ValueError(
                "flashmla_backend: tile_scheduler_metadata was computed by get_mla_metadata for batch "
                f"{b}, num_q_tokens_per_head_k {q_per_hk}, num_heads_k {h_k}, but this call has {got[0]}, {got[1]}, "
                f"{got[2]}: recompute it for this batch")
    return num_splits


def _both_4d(q, k_cache) -> bool:
    return isinstance(q, torch.Tensor) and isinstance(k_cache, torch.Tensor) and q.dim() == 4 and k_cache.dim() == 4

