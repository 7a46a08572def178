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

FlashMLAPluginMultiStepDraftBackend is the speculative draft decoder (speculative_num_steps - 1 steps,
topk 1): step i reads the i + 1 draft tokens written after seq_len.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode

import flashmla_backend
from flashmla_backend.geometry import HEAD_DIM_K, HEAD_DIM_V, PAGE_SIZE, ROPE_DIM

from .._env import DEBUG_BREAK_SCALE_ENV, debug_break_scale_enabled
from . import _compat
from .metadata import MODE_DECODE, MODE_DRAFT_EXTEND, MODE_TARGET_VERIFY, DecodeMetadata, DecodeMetadataBuilder

logger = logging.getLogger("sglang.flashmla_backend")

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
_announced = False


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


def check_model_runner(model_runner, *, skip_prefill: bool) -> list[str]:
    """Reasons this runner's configuration cannot use the plugin (empty when it can)."""
    reasons = []
    cfg = model_runner.model_config
    if not getattr(model_runner, "use_mla_backend", False):
        reasons.append("flashmla_backend serves only MLA models (DeepSeek-V2/V3 architecture)")
        return reasons
    rank, rope = getattr(cfg, "kv_lora_rank", None), getattr(cfg, "qk_rope_head_dim", None)
    if (rank, rope) != (HEAD_DIM_V, ROPE_DIM):
        reasons.append(f"flashmla_backend's decode kernel needs kv_lora_rank {HEAD_DIM_V} and qk_rope_head_dim "
                       f"{ROPE_DIM} (DeepSeek-V2/V3 MLA), got {rank} and {rope}")
    if model_runner.page_size != PAGE_SIZE:
        reasons.append(f"flashmla_backend needs --page-size {PAGE_SIZE} (got {model_runner.page_size}); the "
                       "plugin sets it when --attention-backend/--decode-attention-backend names it")
    kv_dtype, dtype = model_runner.kv_cache_dtype, model_runner.dtype
    if kv_dtype not in SUPPORTED_DTYPES:
        reasons.append(f"the flashmla_backend plugin does not serve FP8 KV caches yet (the API does): KV cache dtype {kv_dtype} is not supported; "
                       "use --kv-cache-dtype auto with a bf16 or fp16 model")
    elif kv_dtype != dtype:
        reasons.append(f"flashmla_backend needs the KV cache in the model dtype ({dtype}), got {kv_dtype}")
    parallel, spec = _runtime()
    dcp = getattr(parallel, "attn_dcp_size", 1)
    if dcp and dcp > 1:
        reasons.append("flashmla_backend does not support decode context parallelism (--dcp-size > 1)")
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
        self.decode_builder = DecodeMetadataBuilder(
            req_to_token=model_runner.req_to_token_pool.req_to_token, num_q_heads=self.num_q_heads,
            num_draft_tokens=self.num_draft_tokens, step_offset=step_offset)
        self.decode_metadata = None
        self.kv_write_loc = kv_write_loc_of(_compat.installed_sglang_version())
        self.is_draft_runner = bool(getattr(model_runner, "is_draft_worker", False))

        device = torch.device(model_runner.device)
        if device.type == "cuda":
            ok, kernel_or_reason = flashmla_backend.is_supported(device)
            if not ok:
                raise RuntimeError(kernel_or_reason)
            where = f"kernel '{kernel_or_reason}' on {torch.cuda.get_device_name(device)}"
        else:
            where = "the PyTorch reference (no CUDA device)"
        self.decode_scale_factor = 1.0
        if debug_break_scale_enabled(draft_runner=self.is_draft_runner):
            self.decode_scale_factor = 1.5
            logger.warning("flashmla_backend: %s is set: %s decode attention uses a WRONG softmax scale (x1.5). "
                           "This is a test hook; outputs are deliberately incorrect.", DEBUG_BREAK_SCALE_ENV,
                           "the draft model's" if self.is_draft_runner else "the")
        global _announced
        if not _announced:
            _announced = True
            logger.info("flashmla_backend: MLA decode attention runs on flashmla_backend %s (%s), %d heads per "
                        "rank; prefill and extend stay with SGLang's Triton backend.",
                        flashmla_backend.__version__, where, self.num_q_heads)

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

    # ---- forward --------------------------------------------------------------------------------

    def _run_decode_kernel(self, q, k, v, layer, forward_batch, save_kv_cache: bool, mode: str):
        md = self.decode_metadata
        if md is None or md.mode != mode:
            raise RuntimeError(
                f"flashmla_backend: {mode} forward without {mode} metadata (init_forward_metadata was not run "
                f"for this batch; have {md.mode if md else None})")
        if k is not None and save_kv_cache:
            assert v is not None
            self.token_to_kv_pool.set_kv_buffer(layer, self.kv_write_loc(forward_batch), k, v)
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
        kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id)  # [num_slots, 1, 576]
        out, _lse = flashmla_backend.flash_mla_with_kvcache(
            q.reshape(bs, s_q, heads, HEAD_DIM_K),
            kv.view(-1, PAGE_SIZE, 1, HEAD_DIM_K),  # [num_pages, 64, 1 latent head, 576]
            md.block_table,
            md.cache_seqlens,
            HEAD_DIM_V,
            md.tile_scheduler_metadata,
            md.num_splits,
            softmax_scale=layer.scaling * self.decode_scale_factor,
            causal=s_q > 1,
        )
        return out.view(-1, heads * HEAD_DIM_V)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._run_decode_kernel(q, k, v, layer, forward_batch, save_kv_cache, MODE_DECODE)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        mode = decode_mode_of(forward_batch.forward_mode)
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
