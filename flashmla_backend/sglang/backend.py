"""The SGLang attention backend: MLA decode on flashmla_backend's kernels, prefill on SGLang's Triton backend.

FlashMLAPluginBackend subclasses SGLang's TritonAttnBackend (sglang.srt.layers.attention.triton_backend)
and takes over the batches the decode kernel serves:

  ForwardMode.DECODE / IDLE        one query token per request
  ForwardMode.TARGET_VERIFY        MTP / EAGLE verification: num_draft_tokens per request, causal
  ForwardMode.DRAFT_EXTEND_V2      the draft model's fixed window of num_draft_tokens per request

Everything else (EXTEND, MIXED, ...) goes to the Triton parent unchanged, and DeepSeek models pick the
same attention form as under `--attention-backend triton` (flashmla_backend.sglang.hooks). For each
batch the metadata (page table from req_to_token, key lengths, tile-scheduler plan) is built once, in
`init_forward_metadata` (eager) or `init_forward_metadata_out_graph` (before CUDA-graph capture and
each replay, into persistent buffers), and every layer reads SGLang's MLA KV pool in place. The batch's
DecodeMetadata is kept in `forward_metadata`, the attribute SGLang's metadata glue graph snapshots and
reinstalls per replay key (`decode_metadata` reads it). New tokens are written through the pool's own
`set_kv_buffer`, with a `KVWriteLoc` on SGLang 0.5.22+ (flashmla_backend.sglang._compat).

FP8 KV cache (`--kv-cache-dtype fp8_e4m3`, or an FP8 checkpoint's KV-cache scheme with `auto`): SGLang's
MLATokenToKVPool stores e4m3 bytes (a uint8 buffer) and `get_key_buffer` returns them viewed as float8_e4m3fn;
the decode kernel reads that view in place with descale_k = the layer's `k_scale` (a one-element float32
device tensor, read by the kernel, so CUDA-graph replays see its value), or a ones tensor this backend holds
for layers without one. Queries: FLASHMLA_BACKEND_FP8_MODE (engine_support.fp8_mode; SGLang's default accurate)
keeps them in the model's 16-bit dtype (accurate), or (fast) quantizes them to e4m3 with the layer's k scale,
saturating at e4m3's largest value, as SGLang's own FlashMLA backend does with an FP8 cache (its
scaled_fp8_quant with q_scale = k_scale), and the kernel reads them with descale_q = that scale.
New tokens are stored as SGLang's Triton backend stores them for MLA: k / k_scale when the layer has a
k_scale (in place in decode, on a copy in target-verify / draft-extend, as Triton's forward_extend does),
cast to e4m3 by the pool's set_kv_buffer. What is accepted: flashmla_backend.engine_support.

FlashMLAPluginMultiStepDraftBackend is the speculative draft decoder (speculative_num_steps - 1 steps,
topk 1): step i reads the i + 1 draft tokens written after seq_len.
"""
from __future__ import annotations

import logging
import math
from typing import Optional

import torch

from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode

import flashmla_backend
from flashmla_backend import engine_support
from flashmla_backend.geometry import HEAD_DIM_K, HEAD_DIM_V, PAGE_SIZE, ROPE_DIM

from .._env import debug_break_scale_factor
from . import _compat
from .metadata import MODE_DECODE, MODE_DRAFT_EXTEND, MODE_TARGET_VERIFY, DecodeMetadata, DecodeMetadataBuilder

logger = logging.getLogger("sglang.flashmla_backend")

# SGLang's DCP merge reads the lse of backends other than its own flashmla as base 2.
LOG2_E = 1.0 / math.log(2.0)
FP8_MAX = torch.finfo(engine_support.FP8_DTYPE).max  # 448

_announced = False
_default_scale_noted = False  # an FP8 cache with the default k scale 1.0: one line per process


def decode_mode_of(forward_mode) -> Optional[str]:
    """The decode-kernel mode of a ForwardMode, or None for batches the Triton parent serves."""
    if forward_mode.is_decode_or_idle():
        return MODE_DECODE
    if forward_mode.is_target_verify():
        return MODE_TARGET_VERIFY
    if forward_mode.is_draft_extend_v2():
        return MODE_DRAFT_EXTEND
    return None


def kv_write_loc_of(version: str):
    """`fn(forward_batch)`: what this SGLang's `set_kv_buffer` takes as the write location of the batch.

    0.5.22+: `KVWriteLoc.for_batch(forward_batch)` (out_cache_loc with the batch's physical mark, which
    the unified pools require); before: the bare `forward_batch.out_cache_loc`.
    """
    if _compat.writes_take_kv_write_loc(version):
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        return KVWriteLoc.for_batch
    return lambda forward_batch: forward_batch.out_cache_loc


def _runtime():
    from sglang.srt.runtime_context import get_parallel, get_spec

    return get_parallel(), get_spec()


def kv_cache_dtype_name(model_runner) -> Optional[str]:
    """The runner's own KV-cache format name, `kv_cache_dtype_str` (0.5.17-0.5.23: the --kv-cache-dtype value,
    the draft's --speculative-draft-kv-cache-dtype on 0.5.21+ draft runners, or the format an FP8 checkpoint's
    "auto" resolved to), or None where the runner has none."""
    name = getattr(model_runner, "kv_cache_dtype_str", None)
    return name if isinstance(name, str) else None


def dcp_size_and_rank(parallel) -> tuple[int, int]:
    """This rank's decode-context-parallel group size and rank (1, 0 without --dcp-size)."""
    size = int(getattr(parallel, "attn_dcp_size", 1) or 1)
    return size, (int(getattr(parallel, "attn_dcp_rank", 0) or 0) if size > 1 else 0)


def dcp_problems(model_runner, parallel, spec) -> list[str]:
    """Why this runner cannot serve decode context parallelism (empty without DCP or when it can).

    Served under --dcp-size N: decode (one query token) with a 16-bit KV cache, on this rank's share of the
    KV slots, returning the lse for SGLang's cross-rank merge. Refused: FP8 caches (SGLang's own flashmla
    refuses them under DCP as well) and speculative decoding (target verify under DCP needs a per-row
    local key frontier the causal kernel cannot express)."""
    size, _ = dcp_size_and_rank(parallel)
    if size <= 1:
        return []
    problems = []
    what_works = (f"flashmla_backend serves --dcp-size {size} for decode with a 16-bit KV cache "
                  "(--kv-cache-dtype auto) and no speculative decoding")
    if model_runner.kv_cache_dtype == engine_support.FP8_DTYPE:
        problems.append(f"decode context parallelism (--dcp-size {size}) with an FP8 KV cache is not supported "
                        f"(SGLang's own flashmla backend refuses it too); {what_works}")
    draft_tokens = int(getattr(spec, "speculative_num_draft_tokens", 0) or 0)
    algorithm = getattr(spec, "speculative_algorithm", None)
    speculative = draft_tokens > 0 or bool(getattr(model_runner, "is_draft_worker", False)) or (
        algorithm is not None and not (hasattr(algorithm, "is_none") and algorithm.is_none()))
    if speculative:
        problems.append(f"decode context parallelism (--dcp-size {size}) with speculative decoding (MTP / EAGLE) "
                        f"is not supported; {what_works}")
    return problems


def check_model_runner(model_runner, *, skip_prefill: bool) -> list[str]:
    """Reasons this runner's configuration cannot use the plugin (empty when it can)."""
    reasons = []
    cfg = model_runner.model_config
    if not getattr(model_runner, "use_mla_backend", False):
        reasons.append("flashmla_backend serves only MLA models (DeepSeek-V2/V3 architecture)")
        return reasons
    dims = engine_support.mla_dims_problem(getattr(cfg, "kv_lora_rank", None), getattr(cfg, "qk_rope_head_dim", None),
                                           "DeepSeek-V2/V3")
    if dims is not None:
        reasons.append(f"flashmla_backend's decode kernel {dims}")
    if model_runner.page_size != PAGE_SIZE:
        reasons.append(f"flashmla_backend needs --page-size {PAGE_SIZE} (got {model_runner.page_size}); the "
                       "plugin sets it when --attention-backend/--decode-attention-backend names it")
    problem = engine_support.cache_dtype_problem(model_runner.kv_cache_dtype, model_runner.dtype)
    if problem is None:
        # Formats that share a torch dtype with a served one (mxfp8 also resolves to float8_e4m3fn) are told
        # apart by the server argument; the server-argument hook refuses them first.
        name = kv_cache_dtype_name(model_runner)
        if name is not None:
            problem = engine_support.kv_cache_dtype_problem("sglang", name, model_runner.dtype)
    if problem is not None:
        reasons.append(problem)
    parallel, spec = _runtime()
    reasons.extend(dcp_problems(model_runner, parallel, spec))
    translator = getattr(model_runner, "kv_index_translator", None)
    if translator is not None and getattr(translator, "is_translating", False):
        reasons.append("flashmla_backend reads req_to_token as physical KV slots; the unified KV pool "
                       "(translated locations) is not supported")
    topk = getattr(spec, "speculative_eagle_topk", None) or 0
    if topk > 1:
        reasons.append(f"flashmla_backend supports speculative decoding with topk 1 only (got topk {topk})")
    return reasons


class FlashMLAPluginBackend(TritonAttnBackend):
    """SGLang AttentionBackend: decode / target-verify / draft-extend on flashmla_backend, the rest Triton."""

    def __init__(self, model_runner, skip_prefill: bool = False, kv_indptr_buf: Optional[torch.Tensor] = None,
                 step_offset: int = 0):
        reasons = check_model_runner(model_runner, skip_prefill=skip_prefill)
        if reasons:
            raise ValueError("flashmla_backend cannot serve this model configuration: " + "; ".join(reasons))
        super().__init__(model_runner, skip_prefill=skip_prefill, kv_indptr_buf=kv_indptr_buf)
        parallel, spec = _runtime()
        self.num_q_heads = model_runner.model_config.num_attention_heads // parallel.attn_tp_size
        self.num_draft_tokens = int(spec.speculative_num_draft_tokens or 0)
        # Decode context parallelism: the kernel attends this rank's share of the KV slots with the query heads
        # of the whole DCP group (gathered by the model), so it plans for num_q_heads * dcp_size heads.
        self.dcp_size, self.dcp_rank = dcp_size_and_rank(parallel)
        self.decode_builder = DecodeMetadataBuilder(
            req_to_token=model_runner.req_to_token_pool.req_to_token, num_q_heads=self.num_q_heads * self.dcp_size,
            num_draft_tokens=self.num_draft_tokens, step_offset=step_offset, dcp_size=self.dcp_size,
            dcp_rank=self.dcp_rank)
        if self.dcp_size > 1:
            from .hooks import route_dcp_decode

            route_dcp_decode()
        self.decode_metadata = None
        self.kv_write_loc = kv_write_loc_of(_compat.installed_sglang_version())
        self.is_draft_runner = bool(getattr(model_runner, "is_draft_worker", False))

        device = torch.device(model_runner.device)
        # An invalid FLASHMLA_BACKEND_FP8_MODE fails here, at start-up, whatever the cache.
        fp8_mode = engine_support.fp8_mode("sglang")
        self.kv_cache_fp8 = model_runner.kv_cache_dtype == engine_support.FP8_DTYPE
        self.fp8_mode = fp8_mode if self.kv_cache_fp8 else None
        # descale_k of layers without a k_scale: one tensor per backend, allocated here, so that CUDA graphs
        # capture a fixed address (never a per-call allocation).
        self.unit_descale_k = (torch.ones(1, dtype=torch.float32, device=device) if self.kv_cache_fp8 else None)
        self._scales_checked: set[int] = set()
        if device.type == "cuda":
            ok, kernel_or_reason = flashmla_backend.is_supported(device)
            if not ok:
                raise RuntimeError(kernel_or_reason)
            where = f"kernel '{kernel_or_reason}' on {torch.cuda.get_device_name(device)}"
        else:
            where = "the PyTorch reference (no CUDA device)"
        self.decode_scale_factor = debug_break_scale_factor(
            "the draft model's decode attention" if self.is_draft_runner else "the decode attention", logger,
            draft_runner=self.is_draft_runner)
        global _announced
        if not _announced:
            _announced = True
            queries = ("16-bit queries" if self.fp8_mode == "accurate"
                       else "queries quantized to e4m3 with the k scale")
            cache = (f"FP8 (e4m3) KV cache read in place with each layer's k scale, {queries} (mode {self.fp8_mode}, "
                     f"{engine_support.FP8_MODE_ENV})" if self.kv_cache_fp8
                     else f"{model_runner.kv_cache_dtype} KV cache")
            logger.info("flashmla_backend: MLA decode attention runs on flashmla_backend %s (%s), %d heads per "
                        "rank, %s; prefill and extend stay with SGLang's Triton backend.",
                        flashmla_backend.__version__, where, self.num_q_heads, cache)

    # ---- metadata -------------------------------------------------------------------------------

    @property
    def decode_metadata(self) -> Optional[DecodeMetadata]:
        """This batch's DecodeMetadata (None for batches the Triton parent serves).

        Stored as `forward_metadata`: SGLang's metadata glue graph (decode_cuda_graph_runner) snapshots
        that attribute after capturing `init_forward_metadata_out_graph` and reinstalls it on each replay
        of the same key, whose device ops refresh the buffers it points to.
        """
        md = getattr(self, "forward_metadata", None)
        return md if isinstance(md, DecodeMetadata) else None

    @decode_metadata.setter
    def decode_metadata(self, md: Optional[DecodeMetadata]) -> None:
        self.forward_metadata = md

    def _build_decode_metadata(self, forward_batch, mode: str, *, graph: bool) -> None:
        bs = forward_batch.batch_size
        hint = None
        seq_lens_cpu = getattr(forward_batch, "seq_lens_cpu", None)
        if not graph and seq_lens_cpu is not None and bs > 0:
            hint = int(seq_lens_cpu[:bs].max())
        self.decode_metadata = self.decode_builder.build(
            mode, bs, forward_batch.req_pool_indices, forward_batch.seq_lens, graph=graph, max_kv_len_hint=hint)

    def init_forward_metadata(self, forward_batch):
        """Eager batches: fresh metadata tensors."""
        mode = decode_mode_of(forward_batch.forward_mode)
        if mode is None:
            self.decode_metadata = None
            return super().init_forward_metadata(forward_batch)
        self._build_decode_metadata(forward_batch, mode, graph=False)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """CUDA-graph capture and replay: metadata into the persistent buffers (same addresses each time)."""
        mode = decode_mode_of(forward_batch.forward_mode)
        if mode is None:
            self.decode_metadata = None
            return super().init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        self._build_decode_metadata(forward_batch, mode, graph=True)

    def init_forward_metadata_in_graph(self, forward_batch):
        # Nothing recorded in the graph: out_graph writes everything the captured kernels read.
        if decode_mode_of(forward_batch.forward_mode) is None:
            return super().init_forward_metadata_in_graph(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        # The Triton parent's graph buffers (split-KV logits for every token, head and split) serve only
        # the modes this class takes over, so they are not allocated.
        self.decode_builder.init_graph_buffers(max_bs)
        self._verify_mask = None
        if self.num_draft_tokens:
            try:
                from sglang.srt.layers.attention.verify_mask import maybe_create_verify_mask
            except ImportError:
                return
            # The EAGLE worker writes its tree mask here when the target backend owns one; the decode
            # kernel never reads it (topk 1: causal window), so the small query-length-only form.
            self._verify_mask = maybe_create_verify_mask(
                is_draft_runner=self.is_draft_runner, skip_prefill=self.skip_prefill, max_bs=max_bs,
                max_context_len=self.max_context_len, num_draft_tokens=self.num_draft_tokens,
                device=self.device, is_read=False)

    def get_cuda_graph_seq_len_fill_value(self):
        # Padded requests: one key (page 0 via req_pool_indices 0), never an empty plan.
        return 1

    # ---- KV-cache scales -------------------------------------------------------------------------

    def _check_layer_scale(self, layer) -> None:
        """At a layer's first forward (SGLang's start-up warm-up or CUDA-graph capture): host values only.

        An FP8 cache with the default scale (no k_scale, or k_scale 1.0: no checkpoint scale) logs
        engine_support.default_scale_message once per process. A 16-bit cache of a layer that carries a k_scale
        other than 1 is refused: SGLang's Triton prefill stores k / k_scale there too, which this kernel would
        read as k (it scales only FP8 caches).
        """
        value = getattr(layer, "k_scale_float", None)  # a Python float set at weight loading: no device read
        if not self.kv_cache_fp8:
            if layer.k_scale is not None and value is not None and value != 1.0:
                raise ValueError(
                    f"flashmla_backend: layer {layer.layer_id} carries a KV-cache scale (k_scale {value}) but the KV "
                    f"cache is {self.token_to_kv_pool.dtype}: SGLang stores k / k_scale in it, which the decode kernel "
                    "reads unscaled from a 16-bit cache. Serve this checkpoint with --kv-cache-dtype fp8_e4m3")
        else:
            global _default_scale_noted
            if (layer.k_scale is None or value == 1.0) and not _default_scale_noted:
                _default_scale_noted = True
                logger.warning(engine_support.default_scale_message("sglang"))
        self._scales_checked.add(layer.layer_id)

    def _descale_k(self, layer, q: torch.Tensor) -> Optional[torch.Tensor]:
        """descale_k of the decode kernel: None for a 16-bit cache; the layer's k_scale as a one-element view (the
        kernel reads its current value), or the backend's ones tensor for a layer without one."""
        if not self.kv_cache_fp8:
            return None
        scale = layer.k_scale
        if scale is None:
            return self.unit_descale_k
        if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != q.device:
            raise ValueError(
                f"flashmla_backend: layer {layer.layer_id}'s k_scale must be one float32 value on {q.device} (a "
                f"per-tensor KV-cache scale), got a {scale.dtype} tensor of shape {tuple(scale.shape)} on "
                f"{scale.device}")
        return scale.reshape(1)

    def _store_new_tokens(self, k, v, layer, forward_batch, mode: str) -> None:
        """The step's new latent rows into the pool, as SGLang's Triton backend writes them for MLA: k / k_scale
        when the layer has a k_scale (the pool's set_kv_buffer then casts to the cache dtype), divided in place in
        decode (k is not read afterwards) and on a copy in target-verify / draft-extend (Triton's forward_extend).
        16-bit caches: only layers whose k_scale is 1.0 get here (_check_layer_scale), so k is stored as it is."""
        if self.kv_cache_fp8 and layer.k_scale is not None:
            k = k.div_(layer.k_scale) if mode == MODE_DECODE else k.clone().div_(layer.k_scale)
        self.token_to_kv_pool.set_kv_buffer(layer, self.kv_write_loc(forward_batch), k, v)

    # ---- forward --------------------------------------------------------------------------------

    def _run_decode_kernel(self, q, k, v, layer, forward_batch, save_kv_cache: bool, mode: str):
        md = self.decode_metadata
        if md is None or md.mode != mode:
            raise RuntimeError(
                f"flashmla_backend: {mode} forward without {mode} metadata (init_forward_metadata was not run "
                f"for this batch; have {md.mode if md else None})")
        descale_k = self._descale_k(layer, q)  # before the write: an unusable k_scale is named, not broadcast
        if k is not None and save_kv_cache:
            assert v is not None
            self._store_new_tokens(k, v, layer, forward_batch, mode)
        bs, s_q = md.batch_size, md.query_len
        heads = layer.tp_q_head_num
        if layer.head_dim != HEAD_DIM_K or layer.v_head_dim != HEAD_DIM_V:
            raise RuntimeError(
                f"flashmla_backend: layer {layer.layer_id} has head_dim {layer.head_dim}, v_head_dim "
                f"{layer.v_head_dim}; the decode kernel needs {HEAD_DIM_K} and {HEAD_DIM_V} (absorbed MLA)")
        rows = q.numel() // (heads * HEAD_DIM_K)
        if rows != bs * s_q:
            raise RuntimeError(
                f"flashmla_backend: {mode} got {rows} query rows for {bs} requests of {s_q} tokens "
                "(a widened draft window, num_front_tokens > 0, is not supported)")
        q = q.reshape(bs, s_q, heads, HEAD_DIM_K)
        model_dtype = q.dtype
        descale_q = None
        if self.fp8_mode == "fast":
            # As SGLang's FlashMLA backend: q / k_scale in e4m3, saturated (an unscaled q beyond 448 would
            # otherwise become NaN), read with descale_q = k_scale (the same one-element tensor as descale_k).
            descale_q = descale_k
            q = (q.float() / descale_q).clamp_(-FP8_MAX, FP8_MAX).to(engine_support.FP8_DTYPE)
        out, _lse = self._attend(q, layer, md, causal=s_q > 1, descale_q=descale_q, descale_k=descale_k)
        if out.dtype != model_dtype:  # the kernel's output with an e4m3 q is bf16; an fp16 model gets it converted
            out = out.to(model_dtype)
        return out.view(-1, heads * HEAD_DIM_V)

    def _attend(self, q, layer, md, *, causal: bool, descale_q=None, descale_k=None, q_pe=None):
        """The decode kernel over this layer's pool with the batch's metadata md: q [bs, s_q, heads, 576], or
        [.., 512] with its rope part q_pe [.., 64] read in place. Returns (out, lse) as flash_mla_with_kvcache."""
        # [num_slots, 1, 576]: the pool's own storage (FP8: its uint8 buffer viewed as float8_e4m3fn), not a copy
        kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        return flashmla_backend.flash_mla_with_kvcache(
            q,
            kv.view(-1, PAGE_SIZE, 1, HEAD_DIM_K),  # [num_pages, 64, 1 latent head, 576]
            md.block_table,
            md.cache_seqlens,
            HEAD_DIM_V,
            md.tile_scheduler_metadata,
            md.num_splits,
            softmax_scale=layer.scaling * self.decode_scale_factor,
            causal=causal,
            descale_q=descale_q,
            descale_k=descale_k,
            q_pe=q_pe,
        )

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        if layer.layer_id not in self._scales_checked:
            self._check_layer_scale(layer)
        if self.dcp_size > 1:
            return self._run_dcp_decode(q, k, layer, forward_batch, save_kv_cache, kwargs.get("q_rope"),
                                        kwargs.get("k_rope"))
        return self._run_decode_kernel(q, k, v, layer, forward_batch, save_kv_cache, MODE_DECODE)

    def _run_dcp_decode(self, q_nope, k_nope, layer, forward_batch, save_kv_cache: bool, q_rope, k_rope):
        """Decode under --dcp-size: DeepSeek's absorbed-MLA form (flashmla_backend.sglang.hooks.route_dcp_decode).

        In: q_nope [bs, heads, 512] and q_rope [bs, heads, 64] with the heads of the whole DCP group
        (layer.tp_q_head_num = local heads * dcp_size), the step's new latent k_nope [bs, 1, 512] and k_rope
        [bs, 1, 64]. The new rows go through the pool's set_mla_kv_buffer, which keeps those this rank owns
        (widened slot % dcp_size == rank) at row slot // dcp_size; the kernel then attends this rank's keys
        (the metadata builder's local lengths and page table). Out: (o [bs, heads * 512], lse [bs, heads]
        float32 in base 2): SGLang merges the ranks' partial outputs by their lse and takes every non-flashmla
        backend's lse as base 2, so the kernel's natural-log lse is multiplied by log2(e). A rank that holds
        none of a request's keys returns lse +inf for it, which SGLang's merge weighs 0.
        """
        md = self.decode_metadata
        if md is None or md.mode != MODE_DECODE:
            raise RuntimeError("flashmla_backend: DCP decode forward without decode metadata (init_forward_metadata "
                               f"was not run for this batch; have {md.mode if md else None})")
        if q_rope is None:
            raise RuntimeError(
                "flashmla_backend: decode under --dcp-size expects DeepSeek's absorbed-MLA call (q_nope with "
                "q_rope/k_rope keyword arguments, the heads of the whole DCP group); got a concatenated query. "
                "The plugin routes DCP decode that way (flashmla_backend.sglang.hooks.route_dcp_decode).")
        heads, bs = layer.tp_q_head_num, md.batch_size
        if q_nope.numel() != bs * heads * HEAD_DIM_V or q_rope.numel() != bs * heads * ROPE_DIM:
            raise RuntimeError(
                f"flashmla_backend: DCP decode got q_nope {tuple(q_nope.shape)} / q_rope {tuple(q_rope.shape)} for "
                f"{bs} requests of {heads} heads (local heads x --dcp-size {self.dcp_size})")
        if k_nope is not None and save_kv_cache:
            if k_rope is None:
                raise RuntimeError("flashmla_backend: DCP decode got k without k_rope")
            self.token_to_kv_pool.set_mla_kv_buffer(layer, self.kv_write_loc(forward_batch), k_nope, k_rope)
        # The two query parts are read in place (no concatenated copy of q).
        out, lse = self._attend(q_nope.reshape(bs, 1, heads, HEAD_DIM_V), layer, md, causal=False,
                                q_pe=q_rope.reshape(bs, 1, heads, ROPE_DIM).to(q_nope.dtype))
        return out.view(-1, heads * HEAD_DIM_V), lse.view(bs, heads) * LOG2_E

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        if layer.layer_id not in self._scales_checked:
            self._check_layer_scale(layer)
        mode = decode_mode_of(forward_batch.forward_mode)
        if self.dcp_size > 1:
            raise RuntimeError(
                f"flashmla_backend: {forward_batch.forward_mode} batch under --dcp-size {self.dcp_size}: the plugin "
                "serves only decode under decode context parallelism; pair it with a prefill backend SGLang runs "
                "DCP with (--prefill-attention-backend flashinfer --decode-attention-backend flashmla_backend)")
        if mode in (MODE_TARGET_VERIFY, MODE_DRAFT_EXTEND):
            return self._run_decode_kernel(q, k, v, layer, forward_batch, save_kv_cache, mode)
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)


class FlashMLAPluginMultiStepDraftBackend:
    """Draft decoder of EAGLE / MTP speculative decoding: one FlashMLAPluginBackend per draft step."""

    needs_cpu_seq_lens: bool = False

    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        if topk > 1:
            raise ValueError(f"flashmla_backend supports speculative decoding with topk 1 only (got {topk})")
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        # Step i's queries see seq_len + i + 1 keys: the i + 1 draft tokens written after seq_len.
        self.attn_backends = [
            FlashMLAPluginBackend(model_runner, skip_prefill=True, step_offset=i + 1)
            for i in range(speculative_num_steps - 1)
        ]

    def _decode_view(self, forward_batch):
        from types import SimpleNamespace

        return SimpleNamespace(
            batch_size=forward_batch.batch_size, forward_mode=ForwardMode.DECODE,
            req_pool_indices=forward_batch.req_pool_indices, seq_lens=forward_batch.seq_lens,
            seq_lens_cpu=getattr(forward_batch, "seq_lens_cpu", None), spec_info=forward_batch.spec_info)

    def init_forward_metadata(self, forward_batch):
        view = self._decode_view(forward_batch)
        for backend in self.attn_backends:
            backend.init_forward_metadata(view)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        for backend in self.attn_backends:
            backend.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        view = self._decode_view(forward_batch)
        for backend in self.attn_backends:
            backend.init_forward_metadata_out_graph(view, in_capture=in_capture)

    def init_forward_metadata_in_graph(self, forward_batch):
        return None

    def get_cuda_graph_seq_len_fill_value(self):
        return 1
