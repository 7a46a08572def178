"""CPU conformance of the plugin's sparse MLA backend (DeepSeek-V3.2 attention) against vLLM's real classes.

vLLM's config (a tiny DeepSeek-V3.2 config: DeepseekV32ForCausalLM with index_topk), selector, registry,
AttentionGroup, CommonAttentionMetadata, SparseMLACommonMetadataBuilder and SparseMLACommonImpl are the real
ones; the plugin's sparse builder and impl run as vLLM would run them, and on CPU tensors flashmla_backend's
sparse decode runs its PyTorch reference. What forward_mqa is compared with: the same reference called
directly on a compact copy of every request's tokens, with the indices the test expects written out from the
token positions (no block table), and, for the 16-bit cache, vLLM's own PyTorch sparse MLA reference
(reference_mla_sparse_prefill, shipped in vLLM's ROCm sparse backend module). Every cache slot no request owns
holds NaN (or NaN bytes in an fp8_ds_mla cache), so an index that lands on a wrong slot shows.

Test doubles, as in tests/test_vllm_cpu.py: the layer object in the static forward context, a prefill stage
that fails if called, and for the selector tests vLLM's own CUDA platform class reporting capability 9.0.
Run them with `bash tests/run.sh --engines` (vLLM in its own environment under .test-envs/).
"""
from __future__ import annotations

import json
import math
import re

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

import flashmla_backend  # noqa: E402
from flashmla_backend import engine_support, fp8_ds_mla, geometry  # noqa: E402
from flashmla_backend._env import DEBUG_BREAK_SCALE_ENV, SPARSE_GPU_ENV  # noqa: E402
from flashmla_backend.reference import sparse_mla_decode_reference  # noqa: E402
from flashmla_backend.vllm import BACKEND_NAME, register, sparse_choice  # noqa: E402
from flashmla_backend.vllm.backend import FlashMLAPluginBackend  # noqa: E402
from flashmla_backend.vllm.sparse_backend import SPARSE_KERNEL_MISSING, FlashMLASparsePluginBackend  # noqa: E402
from flashmla_backend.vllm.sparse_builder import (  # noqa: E402
    FlashMLASparsePluginMetadata,
    FlashMLASparsePluginMetadataBuilder,
)
from flashmla_backend.vllm.sparse_impl import FlashMLASparsePluginImpl  # noqa: E402

import test_vllm_cpu as base  # noqa: E402  (tests/ is on sys.path)

from vllm.config import ModelConfig, VllmConfig  # noqa: E402
from vllm.config.vllm import set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import MLAAttentionSpec  # noqa: E402
from vllm.v1.worker import utils as worker_utils  # noqa: E402

KERNEL_BLOCK = geometry.PAGE_SIZE
LATENT, HEAD = geometry.HEAD_DIM_V, geometry.HEAD_DIM_K
DS_BYTES = fp8_ds_mla.TOKEN_BYTES
TOPK = 128
MAX_MODEL_LEN = 1024
LAYER_NAME = base.LAYER_NAME
OUT_ATOL, OUT_RTOL = 1e-2, 1e-2


# ---- a tiny DeepSeek-V3.2 config ---------------------------------------------------------------

_model_configs: dict = {}


def v32_model_config(tmp_path_factory, heads: int = 64, dtype: str = "bfloat16") -> ModelConfig:
    key = (heads, dtype)
    if key not in _model_configs:
        cfg = json.loads((base.TINY_DSV3 / "config.json").read_text())
        cfg.update(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", num_attention_heads=heads,
                   num_key_value_heads=heads, index_topk=TOPK, index_n_heads=4, index_head_dim=128)
        path = tmp_path_factory.mktemp(f"tiny-deepseek-v32-h{heads}")
        (path / "config.json").write_text(json.dumps(cfg))
        _model_configs[key] = ModelConfig(model=str(path), skip_tokenizer_init=True, dtype=dtype,
                                          max_model_len=MAX_MODEL_LEN)
    return _model_configs[key]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return lambda heads=64, dtype="bfloat16": v32_model_config(tmp_path_factory, heads, dtype)


def make_vllm_config(model_config: ModelConfig, kv_cache_dtype: str = "auto", manager_block_size: int = 64,
                     query_len: int = 1, full_cuda_graphs: bool = False) -> VllmConfig:
    return base.vllm_config_for(model_config, manager_block_size, kv_cache_dtype, query_len, full_cuda_graphs)


def make_sparse_impl(cfg: VllmConfig, kv_cache_dtype: str, topk_buffer: torch.Tensor | None, num_heads=None):
    from unittest import mock

    from vllm.model_executor.layers.attention import sparse_mla_attention

    hf = cfg.model_config.hf_text_config
    heads = num_heads or cfg.model_config.get_num_attention_heads(cfg.parallel_config)
    # vLLM 0.33's SparseMLACommonImpl asks the tensor-parallel group for its size (no process groups here: one rank).
    single_rank = (mock.patch.object(sparse_mla_attention, "get_tensor_model_parallel_world_size", lambda: 1)
                   if hasattr(sparse_mla_attention, "get_tensor_model_parallel_world_size") else mock.patch.object(
                       sparse_mla_attention, "__doc__", sparse_mla_attention.__doc__))
    with set_current_vllm_config(cfg), single_rank:
        return FlashMLASparsePluginImpl(
            num_heads=heads, head_size=HEAD, scale=base.layer_scale(cfg), num_kv_heads=1, alibi_slopes=None,
            sliding_window=None, kv_cache_dtype=kv_cache_dtype, logits_soft_cap=None, attn_type="decoder",
            kv_sharing_target_layer_name=None, q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
            qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim,
            qk_head_dim=hf.qk_nope_head_dim + hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim, kv_b_proj=None,
            indexer=None, topk_indices_buffer=topk_buffer)


@pytest.fixture(autouse=True)
def no_pinned_memory(monkeypatch):
    """vLLM pins host buffers when its platform says pinning works (the platform of a CPU-only machine says so,
    but pinning needs a GPU driver): the sparse builder's host copies stay unpinned here."""
    from vllm.model_executor.layers.attention import sparse_mla_attention
    from vllm.utils import torch_utils

    for module in (torch_utils, sparse_mla_attention):
        if hasattr(module, "PIN_MEMORY"):
            monkeypatch.setattr(module, "PIN_MEMORY", False)


def mla_spec(block_size: int, dtype: torch.dtype, kv_cache_dtype: str) -> MLAAttentionSpec:
    """The KV-cache spec vLLM's MLA layer makes (0.33 also states the fp8_ds_mla token's bytes in the spec)."""
    import dataclasses

    extra = {}
    if "state_content_bytes" in {f.name for f in dataclasses.fields(MLAAttentionSpec)}:
        extra["state_content_bytes"] = DS_BYTES if kv_cache_dtype == "fp8_ds_mla" else None
    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=HEAD, dtype=dtype,
                            cache_dtype_str=kv_cache_dtype, **extra)


class SparsePlugin:
    """The sparse backend as a vLLM worker builds it: kernel block size, AttentionGroup, builder, impl (the builder and
    the indexer's buffer on `device`: the CPU here, the GPU in integration/test_vllm_sparse_layer_gpu.py)."""

    def __init__(self, cfg: VllmConfig, device: torch.device = torch.device("cpu")):
        self.cfg = cfg
        self.backend = FlashMLASparsePluginBackend
        self.scale = base.layer_scale(cfg)
        self.torch_dtype = cfg.model_config.dtype
        self.kv_cache_dtype = cfg.cache_config.cache_dtype
        self.ds = engine_support.sparse_is_ds_mla(self.kv_cache_dtype)
        self.manager_block_size = cfg.cache_config.block_size
        spec = mla_spec(self.manager_block_size, torch.uint8 if self.ds else self.torch_dtype, self.kv_cache_dtype)
        self.spec = spec
        self.kernel_block_size = base.select_kernel_block_size(self.manager_block_size, self.backend, spec)
        self.layer = base.LayerDouble(cfg, self.scale)
        cfg.compilation_config.static_forward_context[LAYER_NAME] = self.layer
        self.group = worker_utils.AttentionGroup(self.backend, [LAYER_NAME], spec, 0)
        self.num_heads = cfg.model_config.get_num_attention_heads(cfg.parallel_config)
        # The indexer's shared buffer [max_num_batched_tokens, topk] (the test writes its rows).
        self.topk_buffer = torch.full((cfg.scheduler_config.max_num_batched_tokens, TOPK), -1, dtype=torch.int32,
                                      device=device)
        with set_current_vllm_config(cfg):
            self.group.create_metadata_builders(cfg, device, self.kernel_block_size)
        self.impl = make_sparse_impl(cfg, self.kv_cache_dtype, self.topk_buffer)
        self.builder = self.group.get_metadata_builder()

    def in_kernel_blocks(self, common):
        """common (host tensors) with its block table in kernel blocks where the release's runner maps them (0.26:
        its BlockTable; 0.33's group.build_metadata maps manager blocks itself, so common stays as it is)."""
        k = self.manager_block_size // self.kernel_block_size
        if k == 1 or hasattr(self.group, "build_metadata"):
            return common
        import numpy as np
        from vllm.v1.worker.block_table import BlockTable

        arange = np.arange(k).reshape(1, -1)
        rows = np.stack([BlockTable.map_to_kernel_blocks(r.numpy(), k, arange) for r in common.block_table_tensor])
        return common.replace(block_table_tensor=torch.from_numpy(rows).to(torch.int32))

    def build_mapped(self, common):
        """The builder on common whose block table is already what the release's builder takes (in_kernel_blocks)."""
        with set_current_vllm_config(self.cfg):
            if hasattr(self.group, "build_metadata"):
                return self.group.build_metadata(common)
            return self.builder.build(common_prefix_len=0, common_attn_metadata=common)

    def build(self, common):
        """common carries KV-manager block ids; the builder sees kernel blocks, mapped as the release maps them."""
        return self.build_mapped(self.in_kernel_blocks(common))

    def forward_mqa(self, q, kv_cache, metadata):
        with set_current_vllm_config(self.cfg):
            return self.impl.forward_mqa(q, kv_cache, metadata, self.layer)


# ---- fake batches ------------------------------------------------------------------------------

def draw_positions(seq_lens: list[int], query_lens: list[int], num_tokens: int, gen: torch.Generator,
                   stale: bool = True) -> torch.Tensor:
    """The indexer's output of a step, [num_tokens, TOPK] int32: for each query token (requests in order, s_q tokens
    each) up to TOPK distinct positions of its request that it may see, a tenth of them skipped (-1), and with
    `stale` one position the request has not written (n + 3) after them where room is left; rows past the
    requests' tokens (CUDA-graph padding) all -1."""
    positions = torch.full((num_tokens, TOPK), -1, dtype=torch.int32)
    t = 0
    for n, s_q in zip(seq_lens, query_lens):
        for s in range(s_q):
            visible = n - s_q + s + 1              # a query token sees its request's tokens up to itself
            k = min(TOPK, visible)
            chosen = torch.randperm(visible, generator=gen)[:k].to(torch.int32)
            chosen[torch.rand(k, generator=gen) < 0.1] = -1   # the indexer's own skips
            positions[t, :k] = chosen
            if stale and k < TOPK:  # a position the request has not written: must be skipped
                positions[t, k] = n + 3
            t += 1
    return positions


class SparseBatch:
    """One step of a DeepSeek-V3.2 model: requests with seq_lens[i] cached tokens, the last query_lens[i] of them
    this step's queries (decode requests first), and top-k positions per query token as vLLM's indexer leaves
    them in its buffer (positions within the request, -1 for none; rows of requests shorter than topk end in -1).

    The cache is paged in 64-token blocks from a random permutation (block 0 is the null block) and every slot
    no request owns holds NaN. `expected` runs flashmla_backend's reference on a compact cache (request i's tokens
    from offset start_i) with indices start_i + position: no block table involved.
    """

    def __init__(self, plugin: SparsePlugin, seq_lens: list[int], query_lens: list[int], seed: int,
                 stale: bool = True):
        gen = torch.Generator().manual_seed(seed)
        self.seq_lens, self.query_lens = seq_lens, query_lens
        B, H = len(seq_lens), plugin.num_heads
        M = plugin.manager_block_size
        k = M // KERNEL_BLOCK                          # kernel blocks per KV-manager block
        per_req = [-(-n // M) for n in seq_lens]
        num_blocks = sum(per_req) + 3 + 1              # manager blocks: spare ones, null block 0
        width = -(-MAX_MODEL_LEN // M)
        perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        table = torch.zeros((B, width), dtype=torch.int32)
        self.tokens = []
        values = torch.full((num_blocks * k, KERNEL_BLOCK, HEAD), float("nan"))   # the cache in kernel blocks
        for i, n in enumerate(seq_lens):
            blocks = [perm.pop() for _ in range(per_req[i])]
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            rows = torch.randn((n, HEAD), generator=gen)
            self.tokens.append(rows)
            for t in range(n):  # token t: manager block blocks[t // M], row t % M
                r = t % M
                values[blocks[t // M] * k + r // KERNEL_BLOCK, r % KERNEL_BLOCK] = rows[t]
        num_blocks *= k
        self.ds = plugin.ds
        if self.ds:  # vLLM's fp8_ds_mla allocation: [blocks, 64, 656] uint8; NaN rows quantize to NaN bytes
            self.kv_cache = fp8_ds_mla.quantize(values.view(-1, HEAD)).view(num_blocks, KERNEL_BLOCK, DS_BYTES)
        else:
            self.kv_cache = values.to(plugin.torch_dtype)
        self.block_table = table

        # A padded CUDA-graph batch (requests of seq_len 0 and no query tokens): vLLM pads the tokens to
        # requests x s_q; the padding tokens map to request 0 and have no indexer output (all -1).
        T = len(seq_lens) * max(query_lens) if 0 in seq_lens else sum(query_lens)
        self.num_tokens = T
        self.positions = draw_positions(seq_lens, query_lens, T, gen, stale)
        qsl = torch.zeros(B + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
        seq = torch.tensor(seq_lens, dtype=torch.int32)
        self.common = base.common_attn_metadata(
            query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=seq.clone(), num_reqs=B,
            num_actual_tokens=T, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            block_table_tensor=table, slot_mapping=torch.zeros(T, dtype=torch.int64), causal=True,
            _seq_lens_cpu=seq.clone(), seq_lens_cpu_upper_bound=seq.clone(),
            is_prefilling=torch.tensor([s_q > 1 and s_q == n for n, s_q in zip(seq_lens, query_lens)]))
        if hasattr(self.common, "_token_to_req_indices_cache"):
            # vLLM 0.33 maps query tokens to requests with a Triton kernel (none on a CPU-only machine) and keeps
            # the result on the step's CommonAttentionMetadata; the test hands it the same map made on the host.
            mapped = torch.repeat_interleave(torch.arange(B, dtype=torch.int32), torch.tensor(query_lens))
            self.common._token_to_req_indices_cache = torch.cat(
                [mapped, torch.zeros(T - mapped.shape[0], dtype=torch.int32)])
        dtype = plugin.torch_dtype
        self.ql_nope = torch.randn((H, T, LATENT), generator=gen).to(dtype).transpose(0, 1)
        self.q_pe = torch.randn((T, H, 128), generator=gen).to(dtype)[..., 64:]

    def load_indexer_output(self, plugin: SparsePlugin) -> None:
        plugin.topk_buffer.fill_(-1)
        plugin.topk_buffer[: self.num_tokens] = self.positions

    def q(self):
        return self.ql_nope, self.q_pe

    def compact(self):
        """Every request's tokens one after another, and the indices into that compact cache the test expects."""
        starts, flat = [], []
        for rows in self.tokens:
            starts.append(sum(r.shape[0] for r in flat))
            flat.append(rows)
        values = torch.cat(flat)
        idx = torch.full_like(self.positions, -1)
        t = 0
        for i, (n, s_q) in enumerate(zip(self.seq_lens, self.query_lens)):
            for _ in range(s_q):
                for j, p in enumerate(self.positions[t].tolist()):
                    if 0 <= p < n:
                        idx[t, j] = starts[i] + p
                t += 1
        return values, idx

    def expected(self, scale: float) -> torch.Tensor:
        values, idx = self.compact()
        if self.ds:
            cache = fp8_ds_mla.quantize(values).view(-1, 1, 1, DS_BYTES)
        else:
            cache = values.to(self.ql_nope.dtype).view(-1, 1, 1, HEAD)
        q = torch.cat(self.q(), dim=-1)
        out, _ = sparse_mla_decode_reference(q.unsqueeze(1), cache, idx.unsqueeze(1), scale)
        return out.squeeze(1)


# ---- registration and selection ----------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def registered():
    register()
    yield


@pytest.fixture
def hopper(monkeypatch):
    from vllm.v1.attention import selector

    platform = base.stand_in_cuda_platform(monkeypatch)
    register()  # attaches the sparse route to this platform object, as in a real vLLM process
    yield platform
    selector._cached_get_attn_backend.cache_clear()


def select(cfg: VllmConfig, *, use_sparse: bool, kv_cache_dtype: str = "auto"):
    """The backend class vLLM's selector returns for an MLA layer, or the ValueError's text."""
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()
    with set_current_vllm_config(cfg):
        try:
            return selector.get_attn_backend(HEAD, cfg.model_config.dtype, kv_cache_dtype, use_mla=True,
                                             use_sparse=use_sparse)
        except ValueError as e:
            return str(e)


def test_v32_config_resolves_to_sparse_mla(model):
    m = model()
    assert m.use_mla and m.get_head_size() == HEAD and m.hf_text_config.index_topk == TOPK
    assert m.hf_config.architectures == ["DeepseekV32ForCausalLM"]


@pytest.mark.parametrize("name", ["CUSTOM", BACKEND_NAME])
def test_one_flag_gives_sparse_layers_the_sparse_backend_and_dense_layers_the_dense_one(name, model, hopper):
    if name not in AttentionBackendEnum.__members__:
        pytest.skip(f"vLLM {vllm.__version__} does not accept new backend names")
    assert sparse_choice.is_installed(hopper)
    cfg = make_vllm_config(model())
    cfg.attention_config.backend = AttentionBackendEnum[name]
    assert select(cfg, use_sparse=True) is FlashMLASparsePluginBackend
    assert select(cfg, use_sparse=False) is FlashMLAPluginBackend
    assert AttentionBackendEnum.CUSTOM.get_class() is FlashMLAPluginBackend  # the registry slot is unchanged


def test_sparse_route_is_installed_once(hopper):
    register()
    wrappers, fn = 0, hopper.get_attn_backend_cls
    while fn is not None:
        wrappers += bool(getattr(fn, sparse_choice._MARK, False))
        fn = getattr(fn, "__wrapped__", None)
    assert wrappers == 1


def test_other_backends_keep_vllms_choice_for_sparse_layers(model, hopper):
    cfg = make_vllm_config(model())
    assert select(cfg, use_sparse=True) is not FlashMLASparsePluginBackend   # no backend named
    cfg.attention_config.backend = AttentionBackendEnum.FLASHMLA_SPARSE
    chosen = select(cfg, use_sparse=True)
    assert chosen is not FlashMLASparsePluginBackend and chosen is not FlashMLAPluginBackend


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "fp8_ds_mla", "fp8", "fp8_e4m3"])
def test_cache_dtypes_that_work(kv_cache_dtype, model, hopper):
    cfg = make_vllm_config(model(), kv_cache_dtype=kv_cache_dtype)
    cfg.attention_config.backend = AttentionBackendEnum.CUSTOM
    assert select(cfg, use_sparse=True, kv_cache_dtype=kv_cache_dtype) is FlashMLASparsePluginBackend


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e5m2", "float16"])
def test_other_cache_dtypes_refused_at_selection_naming_what_works(kv_cache_dtype, model, hopper):
    cfg = make_vllm_config(model(), kv_cache_dtype="auto")
    cfg.attention_config.backend = AttentionBackendEnum.CUSTOM
    text = select(cfg, use_sparse=True, kv_cache_dtype=kv_cache_dtype)
    assert isinstance(text, str) and "Selected backend" in text and "is not valid" in text
    assert kv_cache_dtype in text and "fp8_ds_mla" in text and "auto" in text


def test_fp16_model_with_fp8_ds_mla_refused_naming_bf16(model):
    reasons = " ".join(FlashMLASparsePluginBackend.validate_configuration(
        **selector_fields(model(), kv_cache_dtype="fp8_ds_mla", dtype=torch.float16)))
    assert "bf16" in reasons and "fp8_ds_mla" in reasons


def selector_fields(m: ModelConfig, *, kv_cache_dtype="auto", block_size=None, dtype=None, has_sink=False,
                    use_sparse=True) -> dict:
    from vllm.v1.attention.selector import AttentionSelectorConfig

    values = dict(head_size=m.get_head_size(), dtype=dtype or m.dtype, kv_cache_dtype=kv_cache_dtype,
                  block_size=block_size, use_mla=True, has_sink=has_sink, use_sparse=use_sparse, use_mm_prefix=False,
                  use_per_head_quant_scales=False, attn_type="decoder")
    fields = AttentionSelectorConfig._fields
    return dict(device_capability=base.HOPPER,
                **AttentionSelectorConfig(**{k: v for k, v in values.items() if k in fields})._asdict())


@pytest.mark.parametrize("block_size", [None, 64, 128])
def test_block_sizes_that_work(block_size, model):
    assert FlashMLASparsePluginBackend.validate_configuration(**selector_fields(model(), block_size=block_size)) == []


@pytest.mark.parametrize("block_size", [16, 32])
def test_small_block_sizes_refused_naming_64(block_size, model):
    reasons = " ".join(FlashMLASparsePluginBackend.validate_configuration(
        **selector_fields(model(), block_size=block_size)))
    assert "block_size not supported" in reasons and f"{block_size} does not" in reasons and "64" in reasons


def test_sinks_and_dense_layers_refused(model):
    sink = " ".join(FlashMLASparsePluginBackend.validate_configuration(**selector_fields(model(), has_sink=True)))
    assert "sink" in sink
    dense = " ".join(FlashMLASparsePluginBackend.validate_configuration(**selector_fields(model(), use_sparse=False)))
    assert "sparse MLA layers" in dense and "flashmla_backend.vllm.backend" in dense


def test_a_cuda_device_is_refused_until_the_backend_runs_on_gpus(model, monkeypatch):
    """No silent fallback: with a CUDA device the selection fails saying the backend does not run on GPUs yet."""
    monkeypatch.delenv(SPARSE_GPU_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: (9, 0))
    reasons = FlashMLASparsePluginBackend.validate_configuration(**selector_fields(model()))
    assert SPARSE_KERNEL_MISSING in reasons and "does not run on GPUs yet" in SPARSE_KERNEL_MISSING
    assert f"{SPARSE_GPU_ENV}=1 runs it anyway on a Hopper GPU (--kv-cache-dtype fp8" in SPARSE_KERNEL_MISSING
    cfg = make_vllm_config(model())
    with pytest.raises(RuntimeError, match="does not run on GPUs yet"):
        make_sparse_impl(cfg, "auto", torch.zeros((4, TOPK), dtype=torch.int32))


@pytest.mark.parametrize("kv_cache_dtype, capability, words", [
    ("fp8_ds_mla", (9, 0), None),
    ("fp8", (9, 0), None),                                     # stored as fp8_ds_mla
    ("auto", (9, 0), None),                                    # the 16-bit cache: gathered for the dense kernel
    ("fp8_ds_mla", (10, 0), "this one is sm_100"),            # not a Hopper GPU
    ("auto", (10, 0), "(a 16-bit cache), this one is sm_100"),
])
def test_a_cuda_device_with_the_opt_in(kv_cache_dtype, capability, words, model, monkeypatch):
    """FLASHMLA_BACKEND_SPARSE_GPU=1: the selection and the impl accept a Hopper GPU with the fp8_ds_mla cache or a
    16-bit one (gathered for the dense kernel) and refuse the rest naming what works."""
    from vllm.platforms.interface import DeviceCapability

    monkeypatch.setenv(SPARSE_GPU_ENV, "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: capability)
    fields = selector_fields(model(), kv_cache_dtype=kv_cache_dtype)
    fields["device_capability"] = DeviceCapability(*capability)
    reasons = FlashMLASparsePluginBackend.validate_configuration(**fields)
    stored = "fp8_ds_mla" if engine_support.sparse_is_ds_mla(kv_cache_dtype) else kv_cache_dtype
    cfg = make_vllm_config(model(), kv_cache_dtype=stored)
    if words is None:
        assert not reasons, reasons
        impl = make_sparse_impl(cfg, stored, torch.zeros((4, TOPK), dtype=torch.int32))
        assert impl.kv_ds_mla == engine_support.sparse_is_ds_mla(kv_cache_dtype)
    else:
        assert any(words in r and SPARSE_GPU_ENV in r for r in reasons), reasons
        with pytest.raises(RuntimeError, match=re.escape(words)):
            make_sparse_impl(cfg, stored, torch.zeros((4, TOPK), dtype=torch.int32))


def test_fp8_is_stored_as_fp8_ds_mla_for_the_sparse_backend_only():
    from vllm.model_executor.layers.attention import mla_attention

    original = getattr(mla_attention, sparse_choice._CANONICALIZER)
    try:
        assert sparse_choice.install_fp8_alias() and sparse_choice.install_fp8_alias()
        canonicalize = getattr(mla_attention, sparse_choice._CANONICALIZER)
        for name in ("fp8", "fp8_e4m3"):
            assert canonicalize(FlashMLASparsePluginBackend, name) == "fp8_ds_mla"
            assert canonicalize(FlashMLAPluginBackend, name) == name          # dense: e4m3 per-tensor cache
        assert canonicalize(FlashMLASparsePluginBackend, "auto") == "auto"
        vllms = AttentionBackendEnum.FLASHMLA_SPARSE
        assert canonicalize(type("Named", (), {"get_name": staticmethod(lambda: vllms.name)}), "fp8") == "fp8_ds_mla"
    finally:
        setattr(mla_attention, sparse_choice._CANONICALIZER, original)


def test_head_counts_other_than_64_and_128_refused_naming_them(model):
    cfg = make_vllm_config(model(heads=16))
    with pytest.raises(ValueError, match="64 or 128 query heads per rank, got 16"):
        SparsePlugin(cfg)
    with pytest.raises(NotImplementedError, match="64 or 128 query heads per rank, got 32"):
        make_sparse_impl(make_vllm_config(model()), "auto", torch.zeros((4, TOPK), dtype=torch.int32), num_heads=32)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e5m2", "int8"])
def test_impl_refuses_other_cache_dtypes(kv_cache_dtype, model):
    with pytest.raises(NotImplementedError, match="fp8_ds_mla"):
        make_sparse_impl(make_vllm_config(model()), kv_cache_dtype, torch.zeros((4, TOPK), dtype=torch.int32))


def test_kv_cache_shape_is_656_bytes_for_fp8_ds_mla():
    assert FlashMLASparsePluginBackend.get_kv_cache_shape(10, 64, 1, HEAD, "fp8_ds_mla") == (10, 64, DS_BYTES)
    assert FlashMLASparsePluginBackend.get_kv_cache_shape(10, 64, 1, HEAD, "auto") == (10, 64, HEAD)
    spec = mla_spec(64, torch.uint8, "fp8_ds_mla")
    assert spec.real_page_size_bytes == 64 * DS_BYTES  # vLLM allocates what the backend reads


# ---- the builder -------------------------------------------------------------------------------

def test_builder_declares_full_cuda_graphs_and_uniform_decodes(model):
    assert FlashMLASparsePluginMetadataBuilder._cudagraph_support == AttentionCGSupport.UNIFORM_BATCH
    assert FlashMLASparsePluginMetadataBuilder.require_uniform_decodes is True
    plugin = SparsePlugin(make_vllm_config(model(), query_len=3, full_cuda_graphs=True))
    assert plugin.builder.reorder_batch_threshold == 3  # vLLM: 1 + num_speculative_tokens (MTP)
    assert plugin.kernel_block_size == KERNEL_BLOCK


@pytest.mark.parametrize("s_q", [1, 2])
def test_decode_only_build(s_q, model):
    plugin = SparsePlugin(make_vllm_config(model(), query_len=s_q))
    seq_lens = [5, 64, 200, 700]
    batch = SparseBatch(plugin, seq_lens, [s_q] * 4, seed=s_q)
    md = plugin.build(batch.common)
    assert isinstance(md, FlashMLASparsePluginMetadata)
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens) == (4, 0, 4 * s_q)
    assert md.decode_query_len == s_q and md.topk_tokens == TOPK and md.block_size == KERNEL_BLOCK
    assert md.decode_sched_meta is not None and md.prefill_sched_meta is None
    # The decode schedule is filled by the builder for the calls of this batch shape (on CPU: the configuration only)
    # and kept for it, so that captured graphs find it before capture and in every replay.
    assert md.decode_sched_meta.config == flashmla_backend.FlashMLASchedMeta.Config(
        4, s_q, plugin.num_heads, KERNEL_BLOCK, 1, False, False, TOPK)
    assert md.req_id_per_token[: 4 * s_q].tolist() == [i for i in range(4) for _ in range(s_q)]
    assert torch.equal(md.block_table[:, :1], batch.block_table[:, :1])
    assert plugin.build(batch.common).decode_sched_meta is md.decode_sched_meta
    smaller = SparseBatch(plugin, seq_lens[:3], [s_q] * 3, seed=s_q)
    assert plugin.build(smaller.common).decode_sched_meta.config.b == 3


# ---- forward_mqa against the reference ----------------------------------------------------------

FORWARD_CASES = {
    # name: (kv cache dtype, model dtype, seq_lens, query_lens[, KV-manager block size, 64 by default])
    "bf16_decode": ("auto", "bfloat16", [1, 37, 64, 65, 300, 1000], [1] * 6),
    "bf16_mtp2": ("auto", "bfloat16", [2, 70, 129, 999], [2] * 4),
    "fp16_decode": ("auto", "float16", [3, 200, 700], [1] * 3),
    "ds_decode": ("fp8_ds_mla", "bfloat16", [1, 37, 64, 65, 300, 1000], [1] * 6),
    "ds_mtp2": ("fp8_ds_mla", "bfloat16", [2, 70, 129, 999], [2] * 4),
    "bf16_padded": ("auto", "bfloat16", [100, 300, 0, 0], [1, 1, 0, 0]),
    "ds_padded_mtp2": ("fp8_ds_mla", "bfloat16", [64, 500, 0], [2, 2, 0]),
    "bf16_block128": ("auto", "bfloat16", [1, 127, 128, 129, 600], [1] * 5, 128),
    "ds_block256": ("fp8_ds_mla", "bfloat16", [5, 255, 257, 900], [1] * 4, 256),
}


def forward_case(model, kv_cache_dtype, dtype, seq_lens, query_lens, seed=0, manager_block_size=64, **batch_kw):
    s_q = max(query_lens)
    plugin = SparsePlugin(make_vllm_config(model(dtype=dtype), kv_cache_dtype=kv_cache_dtype, query_len=s_q,
                                           manager_block_size=manager_block_size))
    batch = SparseBatch(plugin, seq_lens, query_lens, seed=seed or sum(seq_lens), **batch_kw)
    batch.load_indexer_output(plugin)
    md = plugin.build(batch.common)
    out, lse = plugin.forward_mqa(batch.q(), batch.kv_cache, md)
    return plugin, batch, md, out, lse


@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_forward_mqa_matches_the_reference_with_the_expected_indices(case, model):
    kv_cache_dtype, dtype, seq_lens, query_lens, *block = FORWARD_CASES[case]
    plugin, batch, md, out, lse = forward_case(model, kv_cache_dtype, dtype, seq_lens, query_lens,
                                               manager_block_size=block[0] if block else 64)
    assert plugin.kernel_block_size == KERNEL_BLOCK and md.block_size == KERNEL_BLOCK
    assert lse is None
    assert out.shape == (batch.num_tokens, plugin.num_heads, LATENT) and out.dtype == plugin.torch_dtype
    assert torch.isfinite(out).all()  # no index landed on a NaN slot (null block, spare blocks, stale positions)
    torch.testing.assert_close(out, batch.expected(plugin.scale), atol=OUT_ATOL, rtol=OUT_RTOL)
    mapped = sum(query_lens)
    assert not out[mapped:].any()  # CUDA-graph padding tokens: no indices, zeros


def test_the_comparison_fails_when_the_indices_are_wrong(model):
    """Requests 0 and 1 swapped in the block table: the forward reads other tokens (or NaN) and must not match."""
    plugin, batch, md, out, _ = forward_case(model, "auto", "bfloat16", [300, 400, 500], [1, 1, 1])
    md.block_table[[0, 1]] = md.block_table[[1, 0]].clone()
    md.decode_sched_meta = flashmla_backend.get_mla_metadata()[0]
    wrong, _ = plugin.forward_mqa(batch.q(), batch.kv_cache, md)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(wrong, batch.expected(plugin.scale), atol=OUT_ATOL, rtol=OUT_RTOL)


def test_the_layers_scale_is_used(model):
    plugin, batch, md, out, _ = forward_case(model, "auto", "bfloat16", [100, 900], [1, 1])
    assert (out.float() - batch.expected(HEAD ** -0.5).float()).abs().max() > 0.05
    torch.testing.assert_close(out, batch.expected(plugin.scale), atol=OUT_ATOL, rtol=OUT_RTOL)


def test_debug_break_scale_hook_breaks_the_sparse_attention(model, monkeypatch):
    """The test hook the GPU engine tests use to prove they catch wrong attention: the sparse impl then attends with
    1.5 x the layer's scale (and says so), which the comparison with the reference at the layer's scale catches."""
    monkeypatch.setenv(DEBUG_BREAK_SCALE_ENV, "1")
    plugin, batch, md, out, _ = forward_case(model, "auto", "bfloat16", [100, 900], [1, 1])
    assert math.isclose(plugin.impl.attn_scale, 1.5 * plugin.scale)
    assert (out.float() - batch.expected(plugin.scale).float()).abs().max() > 0.05
    torch.testing.assert_close(out, batch.expected(1.5 * plugin.scale), atol=OUT_ATOL, rtol=OUT_RTOL)
    monkeypatch.setenv(DEBUG_BREAK_SCALE_ENV, "0")
    plugin, batch, md, out, _ = forward_case(model, "auto", "bfloat16", [100, 900], [1, 1])
    assert plugin.impl.attn_scale == plugin.scale


def test_forward_mqa_matches_vllms_own_sparse_reference(model):
    """vLLM's PyTorch reference of sparse MLA (from its ROCm sparse backend module), given the compact cache and
    the expected indices, agrees with the plugin's forward on the paged cache (16-bit cache; vLLM's reference
    rounds the probabilities to the query dtype, hence the wider tolerance)."""
    from vllm.v1.attention.backends.mla.rocm_aiter_mla_sparse import reference_mla_sparse_prefill

    plugin, batch, md, out, _ = forward_case(model, "auto", "bfloat16", [40, 300, 1000], [1, 1, 1], stale=False)
    values, idx = batch.compact()
    q = torch.cat(batch.q(), dim=-1)
    theirs, _ = reference_mla_sparse_prefill(q, values.to(q.dtype).unsqueeze(1), idx.clone().unsqueeze(1),
                                             plugin.scale, LATENT)
    torch.testing.assert_close(out, theirs.to(out.dtype), atol=3e-2, rtol=3e-2)
    with pytest.raises(AssertionError):  # and it tells a wrong scale apart
        wrong, _ = reference_mla_sparse_prefill(q, values.to(q.dtype).unsqueeze(1), idx.clone().unsqueeze(1),
                                                plugin.scale * 1.5, LATENT)
        torch.testing.assert_close(out, wrong.to(out.dtype), atol=3e-2, rtol=3e-2)


def test_each_call_passes_the_rows_counted_lengths_as_topk_length(model, monkeypatch):
    """Decode requests of s_q 2 (MTP) and short requests: topk_length is a request's longest row up to its last
    entry that names a token, so a request shorter than top-k costs its own length; the output still matches."""
    calls = []
    real = flashmla_backend.flash_mla_with_kvcache

    def spy(*args, **kwargs):
        calls.append((kwargs["indices"].clone(), kwargs["topk_length"].clone()))
        return real(*args, **kwargs)

    monkeypatch.setattr(flashmla_backend, "flash_mla_with_kvcache", spy)
    plugin, batch, md, out, _ = forward_case(model, "auto", "bfloat16", [2, 70, 129, 999], [2] * 4)
    (indices, topk_length), = calls
    assert indices.shape[:2] == (4, 2) and topk_length.shape == (4,) and topk_length.dtype == torch.int32
    want = [max((j + 1 for s in range(2) for j, v in enumerate(indices[r, s].tolist()) if v >= 0), default=0)
            for r in range(4)]
    assert topk_length.tolist() == want
    assert want[0] <= 2 and want[1] <= 70 and want[3] > 0   # short requests: their own length, not top-k
    torch.testing.assert_close(out, batch.expected(plugin.scale), atol=OUT_ATOL, rtol=OUT_RTOL)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_ds_mla"])
def test_mixed_batch_prefill_tokens_are_queries_of_their_own(kv_cache_dtype, model):
    """Decode requests and a prefill request in one step, all sent down the sparse path (vLLM does this when
    its dense-MHA prefill does not take them): every prefill token attends the positions its own index row names."""
    seq_lens, query_lens = [70, 300, 150], [1, 1, 150]
    try:
        plugin, batch, md, out, _ = forward_case(model, kv_cache_dtype, "bfloat16", seq_lens, query_lens)
    except RuntimeError as e:
        if "pin" in str(e).lower():
            pytest.skip(f"vLLM {vllm.__version__} needs pinned memory (a GPU driver) for batches with prefill: {e}")
        raise
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens) == (2, 1, 2)
    assert md.decode_sched_meta is not None and md.prefill_sched_meta is not None
    assert md.req_id_per_token[:152].tolist() == [0, 1] + [2] * 150
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, batch.expected(plugin.scale), atol=OUT_ATOL, rtol=OUT_RTOL)


def test_decode_context_parallelism_refused(model, monkeypatch):
    """0.33 asks the backend at selection (validate_configuration(use_dcp=True): the impl declares no DCP support);
    0.26 does not, and the builder refuses a DCP group of more than one rank naming the flag."""
    import inspect
    from types import SimpleNamespace

    from vllm.model_executor.layers.attention import sparse_mla_attention

    if "use_dcp" in inspect.signature(FlashMLASparsePluginBackend.validate_configuration).parameters:
        reasons = FlashMLASparsePluginBackend.validate_configuration(**{**selector_fields(model()), "use_dcp": True})
        assert "DCP not supported" in reasons
        return
    monkeypatch.setattr(sparse_mla_attention, "get_dcp_group", lambda: SimpleNamespace(world_size=2))
    with pytest.raises(ValueError, match="--decode-context-parallel-size 2 .* Leave it at 1"):
        SparsePlugin(make_vllm_config(model()))


def test_a_cache_in_larger_blocks_is_read_in_kernel_blocks(model):
    """A cache handed as [manager blocks, 128, 576] holds the same tokens as the kernel-block view: same output;
    one whose blocks do not follow each other (padded strides) is refused instead of read at the wrong rows."""
    plugin, batch, md, out, _ = forward_case(model, "auto", "bfloat16", [1, 127, 129, 600], [1] * 4,
                                             manager_block_size=128)
    md.decode_sched_meta = flashmla_backend.get_mla_metadata()[0]
    big = batch.kv_cache.view(-1, 128, HEAD)
    again, _ = plugin.forward_mqa(batch.q(), big, md)
    assert torch.equal(again, out)
    padded = torch.full((big.shape[0], 130, HEAD), float("nan"), dtype=big.dtype)[:, :128]
    padded.copy_(big)
    md.decode_sched_meta = flashmla_backend.get_mla_metadata()[0]
    with pytest.raises(RuntimeError, match="cannot be viewed in 64-token kernel blocks"):
        plugin.forward_mqa(batch.q(), padded, md)


@pytest.mark.parametrize("kv_cache_dtype,stored,bytes_per_token", [
    ("auto", "auto", 2 * HEAD), ("fp8_ds_mla", "fp8_ds_mla", DS_BYTES), ("fp8", "fp8_ds_mla", DS_BYTES),
    ("fp8_e4m3", "fp8_ds_mla", DS_BYTES)])
def test_vllms_mla_layer_builds_the_sparse_impl_from_the_one_flag(kv_cache_dtype, stored, bytes_per_token, model,
                                                                     hopper, monkeypatch):
    """vLLM's own MLAAttention layer for a sparse layer (use_sparse, as DeepSeek-V3.2's attention makes it) with
    --attention-backend CUSTOM: it gets the plugin's sparse impl, stores the FP8 spellings as fp8_ds_mla, and its
    KV-cache spec has the token size the impl reads. Stand-ins: no kv_b_proj weights (the layer only stores it) and
    a tensor-parallel size of 1 (0.33's impl asks)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.attention import mla_attention, sparse_mla_attention

    monkeypatch.setattr(mla_attention, sparse_choice._CANONICALIZER,
                        getattr(mla_attention, sparse_choice._CANONICALIZER))  # restored after the test
    monkeypatch.setattr(sparse_mla_attention, "get_tensor_model_parallel_world_size", lambda: 1, raising=False)
    cfg = make_vllm_config(model(), kv_cache_dtype=kv_cache_dtype)
    cfg.attention_config.backend = AttentionBackendEnum.CUSTOM
    hf = cfg.model_config.hf_text_config
    default = torch.get_default_dtype()
    torch.set_default_dtype(cfg.model_config.dtype)  # as vLLM's model loader does while it builds the model
    try:
        with set_current_vllm_config(cfg):
            layer = mla_attention.MLAAttention(
                num_heads=hf.num_attention_heads, scale=base.layer_scale(cfg), qk_nope_head_dim=hf.qk_nope_head_dim,
                qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim, q_lora_rank=hf.q_lora_rank,
                kv_lora_rank=hf.kv_lora_rank, kv_b_proj=SimpleNamespace(), cache_config=cfg.cache_config,
                prefix="model.layers.1.self_attn.attn", use_sparse=True, indexer=None,
                topk_indices_buffer=torch.zeros((16, TOPK), dtype=torch.int32))
    finally:
        torch.set_default_dtype(default)
    assert layer.attn_backend is FlashMLASparsePluginBackend and isinstance(layer.impl, FlashMLASparsePluginImpl)
    assert layer.kv_cache_dtype == stored and cfg.cache_config.cache_dtype == stored
    assert layer.impl.kv_ds_mla == (stored == "fp8_ds_mla")
    spec = layer.get_kv_cache_spec(cfg)
    assert spec.real_page_size_bytes == spec.block_size * bytes_per_token


def test_tiny_v32_checkpoint_has_the_tensors_of_deepseek_v32(tmp_path):
    """integration/models/tiny-deepseek-v32 through integration/make_tiny_checkpoint.py (the engine runs' model):
    its tensors are transformers' DeepSeek-V3.2 parameters by name and shape, the indexer's included (transformers
    fuses the routed experts when it loads them, so those are compared by count), and vLLM resolves the config as
    sparse MLA with 64 heads."""
    transformers = pytest.importorskip("transformers")
    try:  # transformers' own classes: vLLM registers config classes of its own under the Auto mappings
        from transformers.models.deepseek_v32 import DeepseekV32Config, DeepseekV32ForCausalLM
    except ImportError:
        pytest.skip(f"transformers {transformers.__version__} has no DeepSeek-V3.2 model")
    import sys

    root = base.REPO
    sys.path.insert(0, str(root / "integration"))
    import make_tiny_checkpoint

    cfg = json.loads((root / "integration" / "models" / "tiny-deepseek-v32" / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    got = {k: tuple(v.shape) for k, v in make_tiny_checkpoint.make_weights(cfg, 1).items()}
    hf_cfg = DeepseekV32Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        hf_model = DeepseekV32ForCausalLM(hf_cfg)
    want = {k: tuple(v.shape) for k, v in hf_model.state_dict().items()}
    routed = ".mlp.experts."
    assert {k: s for k, s in got.items() if routed not in k} == {k: s for k, s in want.items() if routed not in k}
    assert sum(".self_attn.indexer." in k for k in got) == 5 * cfg["num_hidden_layers"]
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    assert sum(routed in k for k in got) == 3 * cfg["n_routed_experts"] * moe_layers
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=MAX_MODEL_LEN)
    assert m.use_mla and m.hf_text_config.index_topk == cfg["index_topk"]
    assert m.hf_text_config.num_attention_heads == 64
