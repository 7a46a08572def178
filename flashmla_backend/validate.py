"""The one validation layer: every public entry point checks its arguments here, against tables of rules.

A rule is (argument, test, exception type, message): `test` is a Python expression over the entry
point's arguments (and the names bound by earlier `Let` rows), `message` the body of an f-string over the
same names, formatted only when the test fails. Each table is compiled once, at import, into two
functions built from the same test expressions:

  accepts(...)  the fast path, on every decode call: True when every test holds, False at the first one
                that does not (or on any exception), without formatting anything;
  check(...)    the step-by-step path: raises the first failing rule's exception, whose message names
                its argument ("flashmla_backend: q must ...").

validate_decode_args runs accepts() and, only when it says False, check(); since both evaluate the same
expressions in the same order, the fast path cannot accept what the checks refuse. Rows are ordered so
that a test may rely on every earlier one (q.dim() only after q is known to be a tensor, and so on).

Tables: DECODE (flash_mla_with_kvcache's arguments), REFERENCE (the same rows for mla_decode_reference,
less the scheduler metadata, with float32/float64 inputs allowed as well), DENSE_FLAGS (is_fp8_kvcache and the
sparse-only arguments in a dense call), SPARSE (flash_mla_with_kvcache with indices: sparse decode),
SPARSE_REFERENCE (the same rows for sparse_mla_decode_reference), LAYOUT (the alignment the
kernels' 16-byte loads need), METADATA (get_mla_metadata's arguments), VALUES (lengths and page ids, host
copies of index tensors), LENGTHS (VALUES' length rows alone, for get_mla_metadata), DESCALES (every element of
descale_q / descale_k finite and positive), SPARSE_VALUES (topk_length within topk, attn_sink free of NaN) and
SCHEDULE (the tile-scheduler metadata matches the lengths and shapes). Which cache formats exist and which kernels
read them is flashmla_backend.kv_format's to say; the tables ask it.

Shape, dtype, device and layout checks read only tensor metadata (no host sync, traceable by
torch.compile). Checks of values that live on the GPU (lengths against the block table, page ids,
stale scheduler metadata, the FP8 descales) need a device-to-host copy, so on CUDA tensors they run only in
the opt-in checked mode, FLASHMLA_BACKEND_CHECK=1 (and never while a CUDA graph is being captured). On CPU
tensors they always run. Without the checked mode the kernels clamp lengths to [0, PAGE_SIZE * max_pages]
so that no read leaves the block table.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from . import _env, device, geometry, kv_format, scheduler
from .sched_meta import FlashMLASchedMeta

CHECK_ENV = "FLASHMLA_BACKEND_CHECK"
FLOAT_DTYPES = (torch.bfloat16, torch.float16)        # the kernels' q / k_cache / out dtypes
REFERENCE_DTYPES = FLOAT_DTYPES + (torch.float32, torch.float64)
FP8 = kv_format.E4M3                                  # the fp8_e4m3 KV cache (and fast-mode q) dtype
LOAD_ALIGN_BYTES = 16                                 # cp.async / TMA vector loads
LOAD_ALIGN_ELEMS = 8                                  # the same in 2-byte elements


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


def values_checked(dev: torch.device) -> bool:
    """Whether the value checks (which read tensors on the host) run for tensors on `dev`: always on CPU; on CUDA
    only in the checked mode, and never while a CUDA graph is being captured (a host sync is not capturable)."""
    return dev.type != "cuda" or (checked_mode() and not torch.cuda.is_current_stream_capturing())


# ---- the rule machinery ---------------------------------------------------------------------------

class Rule(NamedTuple):
    arg: str                    # the argument the message names (and the table filter's key)
    test: str                   # Python expression; true when the argument is acceptable
    exc: type[Exception]
    message: str                # f-string body, formatted only on failure


class Let(NamedTuple):
    arg: str                    # the argument it reads
    names: str                  # target of the assignment, e.g. "b, s_q, h_q, d"
    value: str                  # expression


class RuleSet:
    """A table of Rule / Let rows compiled into accepts() (fast path) and check() (raises)."""

    def __init__(self, name: str, params: tuple[str, ...], rows: list, env: dict | None = None):
        self.name, self.params = name, params
        self.rows = [r for r in rows if r.arg in params]      # rows about absent arguments do not apply
        self.rules = [r for r in self.rows if isinstance(r, Rule)]
        self.env = dict(_ENV, **(env or {}), _fail=self._exception)
        sig = ", ".join(params)
        fast, slow, i = [], [], 0
        for r in self.rows:
            if isinstance(r, Let):
                fast.append(f"        {r.names} = {r.value}")
                slow.append(f"    {r.names} = {r.value}")
            else:
                fast.append(f"        if not ({r.test}): return False")
                slow.append(f"    if not ({r.test}): raise _fail({i}, f'''{r.message}''')")
                i += 1
        self.source = (f"def accepts({sig}):\n    try:\n" + "\n".join(fast) + "\n        return True\n"
                       "    except Exception:\n        return False\n\n"
                       f"def check({sig}):\n" + "\n".join(slow) + "\n")
        code = compile(self.source, f"<flashmla_backend rules: {name}>", "exec")
        exec(code, self.env)  # noqa: S102  (our own table, compiled once at import)
        self.accepts, self.check = self.env["accepts"], self.env["check"]

    def _exception(self, index: int, message: str) -> Exception:
        """The exception check() raises for rule `index`; its `.rule` attribute is the row."""
        rule = self.rules[index]
        e = rule.exc(f"flashmla_backend: {message}")
        e.rule = rule
        return e

    def __repr__(self) -> str:
        return f"RuleSet({self.name!r}, {len(self.rules)} rules)"


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(t)
    return f"{tuple(t.shape)} {t.dtype} on {t.device} with strides {t.stride()}"


def _dtype_names(dtypes) -> str:
    return " or ".join(str(d) for d in dtypes)


_PY_REAL = (float, int)


def _is_int(v) -> bool:
    """Python ints and numpy integers (any numbers.Integral), never bools."""
    return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool))


def _is_real(v) -> bool:
    """Python floats/ints and numpy floating/integer scalars (numbers.Real), never bools."""
    return type(v) in _PY_REAL or (isinstance(v, numbers.Real) and not isinstance(v, bool))


def _pairs(values: torch.Tensor, mask: torch.Tensor, limit: int = 8) -> list:
    idx = torch.nonzero(mask).flatten()[:limit].tolist()
    return [(i, int(values[i])) for i in idx]


def _bad_pages(table: torch.Tensor, used: torch.Tensor, num_pages: int) -> str:
    bad = used & ((table < 0) | (table >= num_pages))
    i = int(torch.nonzero(bad.any(dim=1)).flatten()[0])
    ids = table[i][used[i]].tolist()
    return (f"block_table[{i}] holds page ids outside [0, {num_pages}) among the {len(ids)} pages request {i} "
            f"uses: {ids[:16]}")


_ENV = dict(torch=torch, Tensor=torch.Tensor, math=math, INF=math.inf, scheduler=scheduler, device=device,
            FLOAT_DTYPES=FLOAT_DTYPES, HEAD_DIM_K=geometry.HEAD_DIM_K, HEAD_DIM_V=geometry.HEAD_DIM_V,
            ROPE_DIM=geometry.ROPE_DIM, PAGE_SIZE=geometry.PAGE_SIZE, META_INTS=geometry.META_INTS,
            ALIGN_BYTES=LOAD_ALIGN_BYTES, ALIGN_ELEMS=LOAD_ALIGN_ELEMS, I32=torch.int32, FP8=FP8, F32=torch.float32,
            _describe=_describe, _dtype_names=_dtype_names, _is_int=_is_int, _is_real=_is_real,
            _PY_REAL=_PY_REAL, _pairs=_pairs, _bad_pages=_bad_pages,
            DS_MLA=kv_format.FP8_DS_MLA, DS_WIDTH=kv_format.FP8_DS_MLA.width, FlashMLASchedMeta=FlashMLASchedMeta,
            _DS_MLA_HINT=(f"; the {kv_format.FP8_DS_MLA.width}-byte fp8_ds_mla cache is read by sparse decode: pass "
                          "indices= (and is_fp8_kvcache=True)"))


def _none_or(name: str, optional: bool) -> str:
    """The prefix that makes a row's test hold for an optional argument that is None."""
    return f"{name} is None or " if optional else ""


def _tensor(name: str, ndim: int, dtypes: str, what: str, contiguous: bool = False,
            optional: bool = False) -> list[Rule]:
    """Rows for one tensor argument: a tensor, ndim-D, one of `dtypes` (an env name or an expression), unit last
    stride. optional: None is accepted too (every row then holds for None)."""
    guard = _none_or(name, optional)
    rows = [
        Rule(name, f"{guard}isinstance({name}, Tensor)", TypeError,
             f"{name} must be {'None or ' if optional else ''}a torch.Tensor, got {{type({name}).__name__}}"),
        Rule(name, f"{guard}{name}.dim() == {ndim}", ValueError,
             f"{name} must be {what} ({ndim}-D), got {{_describe({name})}}"),
        Rule(name, f"{guard}{name}.dtype in {dtypes}", TypeError,
             f"{name} must have dtype {{_dtype_names({dtypes})}}, got {{_describe({name})}}"),
        Rule(name, f"{guard}{name}.stride(-1) == 1 or {name}.numel() == 0", ValueError,
             f"{name} must have a contiguous last dimension (stride 1), got {{_describe({name})}}"),
    ]
    if contiguous:
        rows.append(Rule(name, f"{guard}{name}.is_contiguous()", ValueError,
                         f"{name} must be contiguous, got {{_describe({name})}}"))
    return rows


def _same_device(name: str, optional: bool = False) -> Rule:
    guard = _none_or(name, optional)
    return Rule(name, f"{guard}{name}.device == q.device", ValueError,
                f"{name} is on {{{name}.device}} but q is on {{q.device}}: all tensors must be on one device")


# ---- flash_mla_with_kvcache (and mla_decode_reference) -------------------------------------------

DECODE_PARAMS = ("q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata",
                 "num_splits", "softmax_scale", "causal", "descale_q", "descale_k", "q_pe")
REFERENCE_PARAMS = ("q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "softmax_scale", "causal",
                    "descale_q", "descale_k")


# The shapes a descale may have (descale_q / descale_k; b = batch, h_kv = num_heads_k), named by the messages.
DESCALE_SHAPES = ("(1,) (one scale for the tensor; any one-element tensor) or (batch, num_heads_k) = ({b}, {h_kv}) "
                  "(one per request and KV head, any strides: e.g. scale.expand({b}, {h_kv}))")


def _descale(name: str, tensor: str, mode: str) -> list[Rule]:
    """Rows for descale_q / descale_k: required exactly when `tensor` is FP8, a float32 tensor on q's device of one
    element (per tensor) or of shape (b, h_kv) (per request and KV head, any strides, 0 included)."""
    return [
        Rule(name, f"{name} is None or isinstance({name}, Tensor)", TypeError,
             f"{name} must be None or a torch.Tensor, got {{type({name}).__name__}}"),
        Rule(name, f"{tensor}.dtype != FP8 or {name} is not None", ValueError,
             f"{tensor} is float8_e4m3fn ({mode}), which needs {name}: a float32 tensor on {{q.device}} of shape "
             f"{DESCALE_SHAPES} (true value = stored value x {name})"),
        Rule(name, f"{name} is None or {tensor}.dtype == FP8", ValueError,
             f"{name} is only used with a float8_e4m3fn {tensor}, but {tensor} is {{{tensor}.dtype}}: pass None"),
        Rule(name, f"{name} is None or {name}.dtype == F32", ValueError,
             f"{name} must be a float32 tensor, got {{_describe({name})}}"),
        Rule(name, f"{name} is None or {name}.numel() == 1 or tuple({name}.shape) == (b, h_kv)", ValueError,
             f"{name} must have shape {DESCALE_SHAPES}, got {{_describe({name})}}"),
        Rule(name, f"{name} is None or {name}.device == q.device", ValueError,
             f"{name} is on {{{name}.device}} but q is on {{q.device}}: all tensors must be on one device"),
    ]

DECODE_ROWS = [
    Rule("q", "isinstance(q, Tensor)", TypeError, "q must be a torch.Tensor, got {type(q).__name__}"),
    Rule("q", "q.dtype in Q_DTYPES or q.element_size() != 1", TypeError,
         "q has dtype {q.dtype}: of the FP8 types only float8_e4m3fn is supported (with descale_q, against a "
         "float8_e4m3fn k_cache)"),
    *_tensor("q", 4, "Q_DTYPES", "[batch, seqlen_q, num_heads_q, {HEAD_DIM_K}]")[1:],
    # q_pe (flash_mla_with_kvcache only): q's rope columns in a tensor of their own, q then holds the latent part.
    # The REFERENCE table has no q_pe argument: its env binds the name to None, so the shared rows below read it.
    *_tensor("q_pe", 4, "(q.dtype,)", "the rope part of q, [batch, seqlen_q, num_heads_q, {ROPE_DIM}] in q's dtype",
             optional=True),
    _same_device("q_pe", optional=True),
    Rule("k_cache", "isinstance(k_cache, Tensor)", TypeError,
         "k_cache must be a torch.Tensor, got {type(k_cache).__name__}"),
    Rule("k_cache", "k_cache.dtype in Q_DTYPES or k_cache.element_size() != 1", TypeError,
         "k_cache has dtype {k_cache.dtype}: the supported FP8 cache is float8_e4m3fn [num_pages, {PAGE_SIZE}, "
         "num_heads_k, {HEAD_DIM_K}] with descale_k{_DS_MLA_HINT if k_cache.shape[-1:] == (DS_WIDTH,) else ''} "
         "(float8_e5m2 is not supported)"),
    *_tensor("k_cache", 4, "Q_DTYPES", "[num_pages, page_size, num_heads_k, {HEAD_DIM_K}] (a 3-D vLLM-style "
             "cache needs .unsqueeze(-2))")[1:],
    *_tensor("block_table", 2, "(I32,)", "[batch, max_pages] int32"),
    *_tensor("cache_seqlens", 1, "(I32,)", "[batch] int32"),  # 1-D: a unit stride is contiguity
    *_tensor("tile_scheduler_metadata", 2, "(I32,)", "[num_sm_parts, {META_INTS}] int32", contiguous=True),
    *_tensor("num_splits", 1, "(I32,)", "[batch + 1] int32"),
    *[_same_device(n) for n in ("k_cache", "block_table", "cache_seqlens", "tile_scheduler_metadata", "num_splits")],
    Rule("q", "q.device.type in ('cuda', 'cpu')", ValueError, "q is on {q.device}; only CUDA and CPU tensors work"),
    Let("q", "b, s_q, h_q, d", "q.shape"),
    Let("k_cache", "num_pages, page_size, h_kv, d_k", "k_cache.shape"),
    Rule("q", "d == (HEAD_DIM_K if q_pe is None else HEAD_DIM_V)", ValueError,
         "q's last dimension must be {HEAD_DIM_K} ({HEAD_DIM_V} latent + {ROPE_DIM} rope), or {HEAD_DIM_V} when the "
         "rope part comes as q_pe; got {_describe(q)}{'' if q_pe is None else ' with q_pe'}"),
    Rule("q_pe", "q_pe is None or tuple(q_pe.shape) == (b, s_q, h_q, ROPE_DIM)", ValueError,
         "q_pe must be [batch={b}, seqlen_q={s_q}, num_heads_q={h_q}, {ROPE_DIM}] (q's first three dimensions), "
         "got {_describe(q_pe)}"),
    Rule("k_cache", "d_k == HEAD_DIM_K", ValueError,
         "k_cache's last dimension must be {HEAD_DIM_K}, got {_describe(k_cache)}"
         "{_DS_MLA_HINT if d_k == DS_WIDTH else ''}"),
    Rule("q", "q.dtype != FP8 or k_cache.dtype == FP8", TypeError,
         "a float8_e4m3fn q (the fast FP8 mode) needs a float8_e4m3fn k_cache, got k_cache {k_cache.dtype}"),
    Rule("k_cache", "k_cache.dtype == q.dtype or k_cache.dtype == FP8", TypeError,
         "q and k_cache must have the same dtype, or k_cache float8_e4m3fn (with descale_k), got q {q.dtype} and "
         "k_cache {k_cache.dtype}"),
    *_descale("descale_k", "k_cache", "an FP8 KV cache"),
    *_descale("descale_q", "q", "the fast FP8 mode"),
    Rule("head_dim_v", "(type(head_dim_v) is int or _is_int(head_dim_v)) and head_dim_v == HEAD_DIM_V", ValueError,
         "head_dim_v must be {HEAD_DIM_V} (an int), got {head_dim_v!r}"),
    Rule("k_cache", "page_size == PAGE_SIZE", ValueError,
         "k_cache has page size {page_size} (dimension 1 of {_describe(k_cache)}); only {PAGE_SIZE}-token pages are "
         "supported (engines: use block size {PAGE_SIZE}, or a multiple of it split into {PAGE_SIZE}-token kernel "
         "blocks)"),
    Rule("q", "h_q >= 1", ValueError,
         "q must have num_heads_q >= 1 (dimension 2: the count of query heads must be positive), got {_describe(q)}"),
    Rule("k_cache", "h_kv >= 1", ValueError,
         "k_cache must have num_heads_k >= 1 (dimension 2: the count of KV heads must be positive), got "
         "{_describe(k_cache)}"),
    Rule("k_cache", "h_q % h_kv == 0", ValueError,
         "num_heads_q ({h_q}) must be a multiple of num_heads_k ({h_kv}) (dimension 2 of q and of k_cache)"),
    Rule("q", "s_q >= 1", ValueError, "q must have seqlen_q >= 1, got {_describe(q)}"),
    Rule("k_cache", "num_pages >= 1", ValueError, "k_cache must have at least one page, got {_describe(k_cache)}"),
    Rule("block_table", "block_table.shape[0] == b and block_table.shape[1] >= 1", ValueError,
         "block_table must be [batch={b}, max_pages >= 1], got {_describe(block_table)}"),
    Rule("cache_seqlens", "cache_seqlens.shape[0] == b", ValueError,
         "cache_seqlens must be [batch={b}], got {_describe(cache_seqlens)}"),
    Rule("tile_scheduler_metadata",
         "tile_scheduler_metadata.shape[0] >= 1 and tile_scheduler_metadata.shape[1] == META_INTS", ValueError,
         "tile_scheduler_metadata must be [num_sm_parts, {META_INTS}] from get_mla_metadata, got "
         "{_describe(tile_scheduler_metadata)}"),
    Rule("num_splits", "num_splits.shape[0] == b + 1", ValueError,
         "num_splits must be [batch + 1 = {b + 1}] from get_mla_metadata for this batch, got {_describe(num_splits)}"),
    Rule("softmax_scale", "softmax_scale is None or ((type(softmax_scale) in _PY_REAL or _is_real(softmax_scale)) "
         "and 0 < softmax_scale < INF)", ValueError,
         "softmax_scale must be a finite positive float (or None for {HEAD_DIM_K} ** -0.5), got {softmax_scale!r}"),
    Rule("causal", "type(causal) is bool", TypeError, "causal must be a bool, got {causal!r}"),
]

DECODE = RuleSet("flash_mla_with_kvcache", DECODE_PARAMS, DECODE_ROWS, dict(Q_DTYPES=FLOAT_DTYPES + (FP8,)))
REFERENCE = RuleSet("mla_decode_reference", REFERENCE_PARAMS, DECODE_ROWS,
                    dict(Q_DTYPES=REFERENCE_DTYPES + (FP8,), q_pe=None))


def validate_decode_args(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                         softmax_scale, causal, descale_q=None, descale_k=None, q_pe=None) -> None:
    # (torch.compile traces the step-by-step checks: its guards make them free after the first call)
    if not torch.compiler.is_compiling() and DECODE.accepts(
            q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits, softmax_scale,
            causal, descale_q, descale_k, q_pe):
        return
    DECODE.check(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                 softmax_scale, causal, descale_q, descale_k, q_pe)


def validate_reference_args(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal,
                            descale_q=None, descale_k=None) -> None:
    if not REFERENCE.accepts(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, descale_q,
                             descale_k):
        REFERENCE.check(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, descale_q,
                        descale_k)


def shapes_of(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
              tile_scheduler_metadata: torch.Tensor) -> Shapes:
    return Shapes(q.shape[0], q.shape[1], q.shape[2], k_cache.shape[2], k_cache.shape[0], block_table.shape[1],
                  tile_scheduler_metadata.shape[0])


# ---- dense decode's flags: is_fp8_kvcache, and the sparse-only arguments left None -----------------

SPARSE_ONLY = ("attn_sink", "extra_k_cache", "extra_indices_in_kvcache", "topk_length", "extra_topk_length")
DENSE_FLAG_PARAMS = ("k_cache", "is_fp8_kvcache") + SPARSE_ONLY
DENSE_FLAG_ROWS = [
    Rule("is_fp8_kvcache", "type(is_fp8_kvcache) in (bool, int)", TypeError,
         "is_fp8_kvcache must be a bool, got {is_fp8_kvcache!r}"),
    Rule("is_fp8_kvcache", "not (is_fp8_kvcache and isinstance(k_cache, Tensor) and DS_MLA.holds(k_cache))",
         ValueError,
         "is_fp8_kvcache=True with a k_cache of {DS_WIDTH}-byte fp8_ds_mla tokens ({_describe(k_cache)}) is sparse "
         "decode: pass indices [batch, seqlen_q, topk] int32 (block_table and cache_seqlens are not read then)"),
    Rule("is_fp8_kvcache", "not is_fp8_kvcache or (isinstance(k_cache, Tensor) and k_cache.dtype == FP8)",
         ValueError,
         "is_fp8_kvcache=True needs a float8_e4m3fn k_cache [num_pages, {PAGE_SIZE}, num_heads_k, {HEAD_DIM_K}] "
         "with descale_k in dense decode, or the {DS_WIDTH}-byte fp8_ds_mla cache with indices (sparse decode); got "
         "k_cache {_describe(k_cache)}"),
    *[Rule(n, f"{n} is None", ValueError,
           f"{n} works in sparse decode only (with indices); dense decode takes {n}=None, got "
           f"{{_describe({n})}}") for n in SPARSE_ONLY],
]
DENSE_FLAGS = RuleSet("dense decode flags", DENSE_FLAG_PARAMS, DENSE_FLAG_ROWS)


def check_dense_flags(k_cache, is_fp8_kvcache, attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None,
                      topk_length=None, extra_topk_length=None) -> None:
    """Dense decode (no indices): is_fp8_kvcache agrees with k_cache, and the arguments of sparse decode are None."""
    if not DENSE_FLAGS.accepts(k_cache, is_fp8_kvcache, attn_sink, extra_k_cache, extra_indices_in_kvcache,
                               topk_length, extra_topk_length):
        DENSE_FLAGS.check(k_cache, is_fp8_kvcache, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length,
                          extra_topk_length)


# ---- sparse decode: flash_mla_with_kvcache with indices (and sparse_mla_decode_reference) ----------
#
# indices [b, s_q, topk] int32 name cache tokens: entry v is token v % page_size of page v // page_size, i.e.
# k_cache[v // page_size, v % page_size, 0]. An entry outside [0, num_pages * page_size) (-1 by convention) is
# skipped, never read, so its value is not an error; only the first topk_length[i] entries of request i count.
# The cache is fp8_ds_mla (656 bytes a token, is_fp8_kvcache=True) or 16-bit in q's dtype (576, False); one KV head.

SPARSE_PARAMS = ("q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata",
                 "num_splits", "softmax_scale", "causal", "is_fp8_kvcache", "indices", "attn_sink", "extra_k_cache",
                 "extra_indices_in_kvcache", "topk_length", "extra_topk_length", "descale_q", "descale_k", "q_pe")
SPARSE_REFERENCE_PARAMS = ("q", "k_cache", "indices", "softmax_scale", "topk_length", "attn_sink")

_SPARSE_CACHES = ("the {DS_WIDTH}-byte fp8_ds_mla cache [num_pages, page_size, 1, {DS_WIDTH}] (uint8, int8 or "
                  "float8_e4m3fn bytes) or a 16-bit cache [num_pages, page_size, 1, {HEAD_DIM_K}] in q's dtype")


def _unused(name: str, why: str, exc: type[Exception] = ValueError) -> Rule:
    return Rule(name, f"{name} is None", exc,
                f"{name} must be None in sparse decode (indices): {why}; got {{_describe({name})}}")


SPARSE_ROWS = [
    Rule("q", "isinstance(q, Tensor)", TypeError, "q must be a torch.Tensor, got {type(q).__name__}"),
    *_tensor("q", 4, "Q_DTYPES", "[batch, seqlen_q, num_heads_q, {HEAD_DIM_K}]")[1:],
    Rule("k_cache", "isinstance(k_cache, Tensor)", TypeError,
         "k_cache must be a torch.Tensor, got {type(k_cache).__name__}"),
    Rule("k_cache", "k_cache.dim() == 4", ValueError,
         f"k_cache must be {_SPARSE_CACHES} (4-D), got {{_describe(k_cache)}}"),
    Rule("k_cache", "k_cache.stride(-1) == 1 or k_cache.numel() == 0", ValueError,
         "k_cache must have a contiguous last dimension (stride 1), got {_describe(k_cache)}"),
    *_tensor("indices", 3, "(I32,)", "[batch, seqlen_q, topk] int32"),
    *_tensor("topk_length", 1, "(I32,)", "[batch] int32", optional=True),
    *_tensor("attn_sink", 1, "(F32,)", "[num_heads_q] float32", optional=True),
    Rule("q", "q.device.type in ('cuda', 'cpu')", ValueError, "q is on {q.device}; only CUDA and CPU tensors work"),
    _same_device("k_cache"),
    _same_device("indices"),
    _same_device("topk_length", optional=True),
    _same_device("attn_sink", optional=True),
    Let("q", "b, s_q, h_q, d", "q.shape"),
    Let("k_cache", "num_pages, page_size, h_kv, width", "k_cache.shape"),
    Let("k_cache", "ds", "DS_MLA.holds(k_cache)"),
    Rule("k_cache", "ds or (k_cache.dtype in Q_DTYPES and width == HEAD_DIM_K)", TypeError,
         f"k_cache must be {_SPARSE_CACHES}, got {{_describe(k_cache)}}"
         "{' (the float8_e4m3fn cache with descale_k is read by dense decode only)' if k_cache.dtype == FP8 else ''}"),
    Rule("is_fp8_kvcache", "type(is_fp8_kvcache) in (bool, int)", TypeError,
         "is_fp8_kvcache must be a bool, got {is_fp8_kvcache!r}"),
    Rule("is_fp8_kvcache", "bool(is_fp8_kvcache) == ds", ValueError,
         "is_fp8_kvcache={is_fp8_kvcache!r} does not match k_cache ({_describe(k_cache)}): True goes with the "
         "{DS_WIDTH}-byte fp8_ds_mla cache, False with a 16-bit cache of {HEAD_DIM_K} per token"),
    Rule("q", "d == HEAD_DIM_K", ValueError,
         "q's last dimension must be {HEAD_DIM_K} ({HEAD_DIM_V} latent + {ROPE_DIM} rope), got {_describe(q)}"),
    Rule("q", "not ds or q.dtype in DS_Q_DTYPES", TypeError,
         "q must have dtype {_dtype_names(DS_Q_DTYPES)} with the fp8_ds_mla cache (its rope part is bf16), got "
         "{_describe(q)}"),
    Rule("k_cache", "ds or k_cache.dtype == q.dtype", TypeError,
         "q and a 16-bit k_cache must have the same dtype, got q {q.dtype} and k_cache {k_cache.dtype}"),
    Rule("k_cache", "h_kv == 1", ValueError,
         "k_cache must have num_heads_k 1 (dimension 2: sparse decode reads one latent KV head), got "
         "{_describe(k_cache)}"),
    Rule("k_cache", "num_pages >= 1 and page_size >= 1", ValueError,
         "k_cache must have at least one page of at least one token, got {_describe(k_cache)}"),
    Rule("q", "h_q >= 1", ValueError,
         "q must have num_heads_q >= 1 (dimension 2: the count of query heads must be positive), got {_describe(q)}"),
    Rule("q", "s_q >= 1", ValueError, "q must have seqlen_q >= 1, got {_describe(q)}"),
    Rule("indices", "tuple(indices.shape[:2]) == (b, s_q) and indices.shape[2] >= 1", ValueError,
         "indices must be [batch={b}, seqlen_q={s_q}, topk >= 1] int32, got {_describe(indices)}"),
    Rule("topk_length", "topk_length is None or topk_length.shape[0] == b", ValueError,
         "topk_length must be [batch={b}] int32, got {_describe(topk_length)}"),
    Rule("attn_sink", "attn_sink is None or attn_sink.shape[0] == h_q", ValueError,
         "attn_sink must be [num_heads_q={h_q}] float32, got {_describe(attn_sink)}"),
    Rule("head_dim_v", "(type(head_dim_v) is int or _is_int(head_dim_v)) and head_dim_v == HEAD_DIM_V", ValueError,
         "head_dim_v must be {HEAD_DIM_V} (an int), got {head_dim_v!r}"),
    Rule("tile_scheduler_metadata", "isinstance(tile_scheduler_metadata, FlashMLASchedMeta)", TypeError,
         "tile_scheduler_metadata must be the FlashMLASchedMeta of get_mla_metadata() (no arguments: FlashMLA's "
         "newer convention) in sparse decode (indices), got {type(tile_scheduler_metadata).__name__}"),
    Rule("num_splits", "num_splits is None", TypeError,
         "num_splits must be None in sparse decode (indices; the FlashMLASchedMeta holds the schedule), got "
         "{type(num_splits).__name__}"),
    Rule("softmax_scale", "softmax_scale is None or ((type(softmax_scale) in _PY_REAL or _is_real(softmax_scale)) "
         "and 0 < softmax_scale < INF)", ValueError,
         "softmax_scale must be a finite positive float (or None for {HEAD_DIM_K} ** -0.5), got {softmax_scale!r}"),
    Rule("causal", "causal is False", ValueError,
         "causal must be False in sparse decode: indices name the keys each query token sees, got {causal!r}"),
    Rule("block_table", "block_table is None or isinstance(block_table, Tensor)", TypeError,
         "block_table must be None or a tensor in sparse decode (not read: indices address the whole cache), got "
         "{type(block_table).__name__}"),
    Rule("cache_seqlens", "cache_seqlens is None or isinstance(cache_seqlens, Tensor)", TypeError,
         "cache_seqlens must be None or a tensor in sparse decode (not read: topk_length says how many indices "
         "count), got {type(cache_seqlens).__name__}"),
    _unused("descale_k", "an fp8_ds_mla token carries its own scales, and a 16-bit cache has none"),
    _unused("descale_q", "q is bf16 or fp16 in sparse decode"),
    _unused("q_pe", "pass q whole, [batch, seqlen_q, num_heads_q, 576]"),
    *[_unused(n, "a second cache (FlashMLA's extra_k_cache, extra_indices_in_kvcache and extra_topk_length, for "
              "DeepSeek's later models) is not supported", NotImplementedError)
      for n in ("extra_k_cache", "extra_indices_in_kvcache", "extra_topk_length")],
]

SPARSE = RuleSet("flash_mla_with_kvcache with indices", SPARSE_PARAMS, SPARSE_ROWS,
                 dict(Q_DTYPES=FLOAT_DTYPES, DS_Q_DTYPES=(torch.bfloat16,)))
SPARSE_REFERENCE = RuleSet("sparse_mla_decode_reference", SPARSE_REFERENCE_PARAMS, SPARSE_ROWS,
                           dict(Q_DTYPES=REFERENCE_DTYPES, DS_Q_DTYPES=(torch.bfloat16, torch.float32, torch.float64)))


def validate_sparse_args(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                         softmax_scale, causal, is_fp8_kvcache, indices, attn_sink=None, extra_k_cache=None,
                         extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None, descale_q=None,
                         descale_k=None, q_pe=None) -> None:
    a = (q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits, softmax_scale, causal,
         is_fp8_kvcache, indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length,
         descale_q, descale_k, q_pe)
    if not SPARSE.accepts(*a):
        SPARSE.check(*a)


def validate_sparse_reference_args(q, k_cache, indices, softmax_scale=None, topk_length=None, attn_sink=None) -> None:
    if not SPARSE_REFERENCE.accepts(q, k_cache, indices, softmax_scale, topk_length, attn_sink):
        SPARSE_REFERENCE.check(q, k_cache, indices, softmax_scale, topk_length, attn_sink)


# ---- kernel layout (CUDA tensors, after DECODE) ---------------------------------------------------

def _strides_test(name: str, stride: str) -> str:
    """Strides of the three leading dimensions multiples of ALIGN_BYTES bytes (size-1 dimensions exempt)."""
    return " and ".join(f"(({stride}[{i}] * {name}.element_size()) % ALIGN_BYTES == 0 or {name}.shape[{i}] == 1)"
                        for i in range(3))


def _layout_rules(name: str, st: str, optional: bool = False) -> list:
    guard = _none_or(name, optional)
    return [
        Rule(name, f"{guard}{name}.data_ptr() % ALIGN_BYTES == 0", ValueError,
             f"{name}'s data pointer must be {{ALIGN_BYTES}}-byte aligned (got {{{name}.data_ptr() % ALIGN_BYTES}} "
             f"bytes past a {{ALIGN_BYTES}}-byte boundary; storage offset {{{name}.storage_offset()}})"),
        Rule(name, f"{guard}({_strides_test(name, st)})", ValueError,
             f"{name}'s strides must be multiples of {{ALIGN_BYTES // {name}.element_size()}} elements "
             f"({{ALIGN_BYTES}} bytes) for the kernels' vector loads, got {{_describe({name})}}"),
    ]


LAYOUT_ROWS = [
    Let("q", "qst", "q.stride()"),
    Let("k_cache", "kst", "k_cache.stride()"),
    Let("q_pe", "pst", "None if q_pe is None else q_pe.stride()"),
    *_layout_rules("q", "qst"),
    *_layout_rules("k_cache", "kst"),
    *_layout_rules("q_pe", "pst", optional=True),
]
LAYOUT = RuleSet("kernel layout", ("q", "k_cache", "q_pe"), LAYOUT_ROWS)


def check_kernel_layout(q: torch.Tensor, k_cache: torch.Tensor, q_pe: torch.Tensor | None = None) -> None:
    """Alignment the kernels' 16-byte loads (cp.async, TMA) need. Pointer values: call with real tensors."""
    if not LAYOUT.accepts(q, k_cache, q_pe):
        LAYOUT.check(q, k_cache, q_pe)


# ---- get_mla_metadata --------------------------------------------------------------------------------

METADATA_PARAMS = ("cache_seqlens", "num_q_tokens_per_head_k", "num_heads_k", "num_heads_q", "is_fp8_kvcache", "topk")
METADATA_ROWS = [
    *_tensor("cache_seqlens", 1, "(I32,)", "[batch] int32"),
    *[Rule(n, f"(type({n}) is int or _is_int({n})) and {n} >= 1", ValueError,
           f"{n} must be a positive int, got {{{n}!r}}")
      for n in ("num_q_tokens_per_head_k", "num_heads_k")],
    Rule("num_heads_q", "num_heads_q is None or (_is_int(num_heads_q) and num_heads_q >= 1 "
         "and num_heads_q % num_heads_k == 0)", ValueError,
         "num_heads_q must be a positive multiple of num_heads_k={num_heads_k}, got {num_heads_q!r}"),
    Rule("is_fp8_kvcache", "type(is_fp8_kvcache) in (bool, int)", TypeError,
         "is_fp8_kvcache must be a bool, got {is_fp8_kvcache!r}"),
    Rule("topk", "topk is None", NotImplementedError,
         "topk (metadata tensors for sparse decode, the older argument list) is not supported: sparse decode takes the "
         "FlashMLASchedMeta of get_mla_metadata() without arguments (FlashMLA's newer convention), got topk={topk!r}"),
]
METADATA = RuleSet("get_mla_metadata", METADATA_PARAMS, METADATA_ROWS)


def validate_metadata_args(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None,
                           is_fp8_kvcache=False, topk=None) -> None:
    if not METADATA.accepts(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q, is_fp8_kvcache, topk):
        METADATA.check(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q, is_fp8_kvcache, topk)


# ---- values (host copies; CPU always, CUDA in the checked mode) -------------------------------------

LENGTH_ROWS = [
    Let("cache_seqlens", "lens", "cache_seqlens.detach().cpu().long()"),
    Rule("cache_seqlens", "not bool((lens < 0).any())", ValueError,
         "cache_seqlens must be >= 0, got negative lengths at (index, length) {_pairs(lens, lens < 0)}"),
]
LENGTHS = RuleSet("lengths", ("cache_seqlens",), LENGTH_ROWS)

VALUE_ROWS = [
    *LENGTH_ROWS,
    Let("block_table", "max_pages", "block_table.shape[1]"),
    Let("cache_seqlens", "need", "(lens + (PAGE_SIZE - 1)) // PAGE_SIZE"),
    Rule("block_table", "not bool((need > max_pages).any())", ValueError,
         "block_table is too short: it has {max_pages} pages ({max_pages * PAGE_SIZE} tokens) per request but "
         "cache_seqlens needs more at (index, length) {_pairs(lens, need > max_pages)}"),
    Let("block_table", "table", "block_table.detach().cpu()"),
    Let("block_table", "used", "torch.arange(max_pages)[None, :] < need[:, None]"),
    Let("k_cache", "num_pages", "k_cache.shape[0]"),
    Rule("block_table", "not bool((used & ((table < 0) | (table >= num_pages))).any())", ValueError,
         "{_bad_pages(table, used, num_pages)}"),
]
VALUES = RuleSet("values", ("k_cache", "block_table", "cache_seqlens"), VALUE_ROWS)

def _bad_descale(values: torch.Tensor) -> str:
    """The first descale that is not finite and positive, and where it is when the tensor has several."""
    flat = values.reshape(-1)
    i = int(torch.nonzero(~((flat > 0) & (flat < math.inf))).flatten()[0])
    where = "" if flat.numel() == 1 else f" at [request {i // values.shape[-1]}, kv head {i % values.shape[-1]}]"
    return f"{float(flat[i])!r}{where}"


DESCALE_ROWS = [
    *[r for name in ("descale_q", "descale_k") for r in (
        Let(name, f"{name}_values", f"None if {name} is None else {name}.detach().cpu()"),
        Rule(name, f"{name}_values is None or bool((({name}_values > 0) & ({name}_values < INF)).all())", ValueError,
             f"{name} must be finite and positive (true value = stored value x {name}), got "
             f"{{_bad_descale({name}_values)}}"),
    )],
]
DESCALES = RuleSet("descale values", ("descale_q", "descale_k"), DESCALE_ROWS, dict(_bad_descale=_bad_descale))

def _nan_heads(values: torch.Tensor) -> list:
    return torch.nonzero(torch.isnan(values)).flatten()[:8].tolist()


SPARSE_VALUE_ROWS = [
    Let("indices", "topk", "indices.shape[2]"),
    Let("topk_length", "n_values", "None if topk_length is None else topk_length.detach().cpu().long()"),
    Rule("topk_length", "n_values is None or not bool(((n_values < 0) | (n_values > topk)).any())", ValueError,
         "topk_length must be in [0, topk={topk}] (topk: dimension 2 of indices), got (index, value) "
         "{_pairs(n_values, (n_values < 0) | (n_values > topk))}"),
    Let("attn_sink", "sink_values", "None if attn_sink is None else attn_sink.detach().cpu()"),
    Rule("attn_sink", "sink_values is None or not bool(torch.isnan(sink_values).any())", ValueError,
         "attn_sink must not be NaN (+inf makes a head's output 0, -inf leaves it as without a sink), got NaN at "
         "heads {_nan_heads(sink_values)}"),
]
SPARSE_VALUES = RuleSet("sparse decode values", ("indices", "topk_length", "attn_sink"), SPARSE_VALUE_ROWS,
                        dict(_nan_heads=_nan_heads))


SCHEDULE_ROWS = [
    Let("q", "b, s_q, h_q, _", "q.shape"),
    Let("k_cache", "h_kv", "k_cache.shape[2]"),
    Let("q", "q_per_hk", "s_q * h_q // h_kv"),
    Let("q", "parts", "scheduler.num_sm_parts(device.sm_count(q.device), h_kv, q_per_hk)"),
    Rule("tile_scheduler_metadata", "tile_scheduler_metadata.shape[0] == parts", ValueError,
         "tile_scheduler_metadata has {tile_scheduler_metadata.shape[0]} parts, but get_mla_metadata gives {parts} "
         "for seqlen_q={s_q}, num_heads_q={h_q}, num_heads_k={h_kv} on {q.device}: recompute it with "
         "get_mla_metadata(cache_seqlens, {q_per_hk}, {h_kv}) for these shapes"),
    Let("cache_seqlens", "want_meta, want_splits", "scheduler.schedule(cache_seqlens.detach().cpu(), parts)"),
    Rule("num_splits", "torch.equal(want_splits, num_splits.detach().cpu())", ValueError,
         "tile_scheduler_metadata/num_splits do not match cache_seqlens (num_splits differs): {_STALE}"),
    Rule("tile_scheduler_metadata", "torch.equal(want_meta, tile_scheduler_metadata.detach().cpu())", ValueError,
         "tile_scheduler_metadata/num_splits do not match cache_seqlens (the rows differ): {_STALE}"),
]
SCHEDULE = RuleSet("scheduler metadata", ("q", "k_cache", "cache_seqlens", "tile_scheduler_metadata", "num_splits"),
                   SCHEDULE_ROWS, dict(_STALE="recompute them with get_mla_metadata whenever the lengths change "
                                       "(stale metadata, e.g. in a CUDA graph replay)"))


def check_values(k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor) -> None:
    """Lengths >= 0, covered by the block table, page ids in [0, num_pages) where a request reads them."""
    VALUES.check(k_cache, block_table, cache_seqlens)


def check_lengths(cache_seqlens: torch.Tensor) -> None:
    """Lengths >= 0: get_mla_metadata's value check (check_values makes it again, with the block table)."""
    LENGTHS.check(cache_seqlens)


def check_descales(descale_q: torch.Tensor | None, descale_k: torch.Tensor | None) -> None:
    """descale_q / descale_k, where given, finite and positive (every element, read on the host)."""
    DESCALES.check(descale_q, descale_k)


def check_schedule(q: torch.Tensor, k_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                   tile_scheduler_metadata: torch.Tensor, num_splits: torch.Tensor) -> None:
    """The metadata is what get_mla_metadata gives for these lengths and shapes on this device."""
    SCHEDULE.check(q, k_cache, cache_seqlens, tile_scheduler_metadata, num_splits)


def check_sparse_values(indices: torch.Tensor, topk_length: torch.Tensor | None,
                        attn_sink: torch.Tensor | None) -> None:
    """topk_length in [0, topk] and attn_sink free of NaN (read on the host). The indices' values need no check:
    an entry outside the cache is skipped."""
    SPARSE_VALUES.check(indices, topk_length, attn_sink)
