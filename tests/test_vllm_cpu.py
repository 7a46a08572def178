"""CPU conformance of the vLLM plugin against vLLM's real classes (no GPU needed).

vLLM's config, registry, kernel-block split (select_common_block_size + its block-table mapping),
AttentionGroup, CommonAttentionMetadata and MLACommon* classes are the real ones; the plugin's
builder and impl run as vLLM would run them. On CPU tensors flashmla_backend runs its PyTorch
reference, so forward_mqa checks the plugin's plumbing end to end: page mapping, null block, uniform
query lengths, causal masks, the layer's scale, CUDA-graph buffers. Test doubles: a layer object
(vLLM's own MLA tests use one too) and a prefill stage that fails if called (vLLM's prefill
backends import only on GPU builds; decode-only batches never reach them), and, for the selector tests
(named backends, the opt-in automatic choice), a stand-in GPU: vLLM's own CUDA platform class, with its
real selection code, reporting compute capability 9.0 (its compiled ops' import stubbed where libcuda is
missing).

Run them with `bash tests/run.sh --engines` (vLLM in its own environment under .test-envs/).
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import flashmla_backend  # noqa: E402
from flashmla_backend import engine_support, geometry  # noqa: E402
from flashmla_backend.reference import mla_decode_reference  # noqa: E402
from flashmla_backend.vllm import BACKEND_CLASS_PATH, BACKEND_NAME, DEBUG_BREAK_SCALE_ENV, _compat, register  # noqa: E402
from flashmla_backend.vllm import default_choice  # noqa: E402
from flashmla_backend.vllm.backend import FlashMLAPluginBackend  # noqa: E402
from flashmla_backend.vllm.builder import (  # noqa: E402
    FlashMLAPluginDecodeMetadata, FlashMLAPluginMetadataBuilder, uniform_query_len)
from flashmla_backend.vllm.unsupported import UnsupportedVLLMVersionBackend  # noqa: E402

from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.config.vllm import set_current_vllm_config  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import MLAAttentionSpec  # noqa: E402
from vllm.v1.worker import utils as worker_utils  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY_DSV3 = REPO / "integration" / "models" / "tiny-deepseek-v3"
KERNEL_BLOCK = geometry.PAGE_SIZE
LATENT, ROPE = geometry.HEAD_DIM_V, geometry.ROPE_DIM
HEAD = geometry.HEAD_DIM_K
LAYER_NAME = "model.layers.0.self_attn.attn"
HOPPER = DeviceCapability(9, 0)
# Both sides compute in fp32 from the same bf16/fp16 inputs; the outputs are rounded to 16 bits.
OUT_ATOL, OUT_RTOL = 1e-2, 1e-2
FP8, E4M3_MAX = torch.float8_e4m3fn, 448.0


# ---- vLLM objects ------------------------------------------------------------------------------

_model_configs: dict = {}


def model_config(dtype: str = "bfloat16", model: Path = TINY_DSV3) -> ModelConfig:
    key = (str(model), dtype)
    if key not in _model_configs:
        _model_configs[key] = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype=dtype,
                                          max_model_len=4096)
    return _model_configs[key]


def vllm_config(manager_block_size: int = 64, dtype: str = "bfloat16", kv_cache_dtype: str = "auto",
                query_len: int = 1, full_cuda_graphs: bool = False) -> VllmConfig:
    return vllm_config_for(model_config(dtype), manager_block_size, kv_cache_dtype, query_len, full_cuda_graphs)


def vllm_config_for(model: ModelConfig, manager_block_size: int = 64, kv_cache_dtype: str = "auto",
                    query_len: int = 1, full_cuda_graphs: bool = False) -> VllmConfig:
    """A CPU VllmConfig around `model` (the tiny DeepSeek-V3 here, a V3.2 config in test_vllm_sparse_cpu.py)."""
    cfg = VllmConfig(model_config=model,
                     cache_config=CacheConfig(block_size=manager_block_size, cache_dtype=kv_cache_dtype),
                     device_config=DeviceConfig(device="cpu"))
    if query_len > 1:
        from vllm.config import SpeculativeConfig

        # vLLM raises the decode threshold of UNIFORM builders to 1 + num_speculative_tokens.
        cfg.speculative_config = SpeculativeConfig(method="ngram", num_speculative_tokens=query_len - 1)
    if full_cuda_graphs:
        from vllm.config import CUDAGraphMode

        # The CPU platform turns CUDA graphs off; set the mode the GPU default has (FULL_AND_PIECEWISE)
        # so the builder takes its CUDA-graph path (persistent metadata buffers).
        cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    return cfg


class DecodeOnlyPrefill(MLAPrefillBackend):
    """The prefill stage the builder clones; decode-only batches must never call it."""

    @staticmethod
    def get_name() -> str:
        return "DECODE_ONLY_TEST"

    def run_prefill_new_tokens(self, *args, **kwargs):
        raise AssertionError("a decode-only batch reached the prefill backend")

    def run_prefill_context_chunk(self, *args, **kwargs):
        raise AssertionError("a decode-only batch reached the prefill backend")


class LayerDouble:
    """Stands in for vLLM's MLAAttention in the static forward context (what the builder and impl read)."""

    def __init__(self, cfg: VllmConfig, scale: float):
        hf = cfg.model_config.hf_text_config
        self.prefill_backend = DecodeOnlyPrefill(
            num_heads=hf.num_attention_heads, scale=scale, kv_lora_rank=hf.kv_lora_rank,
            qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim,
            v_head_dim=hf.v_head_dim, vllm_config=cfg)
        # The MLA dimensions vLLM >= 0.33's builder reads from the layer.
        self.num_heads = hf.num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = hf.q_lora_rank, hf.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = hf.qk_nope_head_dim, hf.qk_rope_head_dim
        self.v_head_dim = hf.v_head_dim
        self._q_scale = torch.tensor(1.0)
        self._k_scale = torch.tensor(1.0)
        self._v_scale = torch.tensor(1.0)
        self._q_scale_float = self._k_scale_float = 1.0
        self.calculate_kv_scales = False

    def set_scales(self, k_scale: float, q_scale: float = 1.0) -> None:
        """As vLLM's scale loading or --calculate-kv-scales leaves a layer: device tensors and host copies."""
        self._k_scale.fill_(k_scale)
        self._q_scale.fill_(q_scale)
        self._k_scale_float, self._q_scale_float = k_scale, q_scale


def layer_scale(cfg: VllmConfig) -> float:
    """The softmax scale DeepSeek-V3's attention layer passes (qk_head_dim ** -0.5; no YaRN in the tiny config)."""
    hf = cfg.model_config.hf_text_config
    rope = getattr(hf, "rope_scaling", None) or {}
    assert rope.get("rope_type", "default") == "default", rope  # YaRN would multiply by mscale ** 2
    return (hf.qk_nope_head_dim + hf.qk_rope_head_dim) ** -0.5


class Plugin:
    """The plugin as a vLLM worker builds it: registry lookup, kernel block size, AttentionGroup, impl."""

    def __init__(self, cfg: VllmConfig, scale: float | None = None):
        self.cfg = cfg
        self.scale = layer_scale(cfg) if scale is None else scale
        self.backend = AttentionBackendEnum.CUSTOM.get_class()
        self.manager_block_size = cfg.cache_config.block_size
        self.torch_dtype = cfg.model_config.dtype
        spec = MLAAttentionSpec(block_size=self.manager_block_size, num_kv_heads=1, head_size=HEAD,
                                dtype=self.torch_dtype, cache_dtype_str=cfg.cache_config.cache_dtype)
        self.kernel_block_size = select_kernel_block_size(self.manager_block_size, self.backend, spec)
        self.layer = LayerDouble(cfg, self.scale)
        cfg.compilation_config.static_forward_context[LAYER_NAME] = self.layer
        self.group = worker_utils.AttentionGroup(self.backend, [LAYER_NAME], spec, 0)
        with set_current_vllm_config(cfg):
            self.group.create_metadata_builders(cfg, torch.device("cpu"), self.kernel_block_size)
            self.impl = make_impl(self.backend, cfg, self.scale, cfg.cache_config.cache_dtype)
        self.builder = self.group.get_metadata_builder()
        self._kernel_table: torch.Tensor | None = None

    def kernel_block_table(self, manager_table: torch.Tensor) -> torch.Tensor:
        """vLLM's mapping of KV-manager block ids to kernel block ids (0.26: BlockTable; 0.33: AttentionGroup)."""
        k = self.manager_block_size // self.kernel_block_size
        if hasattr(self.group, "map_to_kernel_block_table"):
            if k == 1:
                return manager_table.clone()
            return self.group.map_to_kernel_block_table(manager_table).clone()
        from vllm.v1.worker.block_table import BlockTable

        arange = np.arange(k).reshape(1, -1)
        rows = np.stack([BlockTable.map_to_kernel_blocks(r.numpy(), k, arange) for r in manager_table])
        # Like the runner's block table, one persistent buffer that every step rewrites.
        if self._kernel_table is None or self._kernel_table.shape != rows.shape:
            self._kernel_table = torch.zeros(rows.shape, dtype=torch.int32)
        self._kernel_table.copy_(torch.from_numpy(rows))
        return self._kernel_table

    def build(self, common: CommonAttentionMetadata):
        with set_current_vllm_config(self.cfg):
            if hasattr(self.group, "build_metadata"):  # 0.33: maps manager blocks to kernel blocks itself
                return self.group.build_metadata(common)
            common = common.replace(block_table_tensor=self.kernel_block_table(common.block_table_tensor))
            return self.builder.build(common_prefix_len=0, common_attn_metadata=common)

    def forward_mqa(self, q, kv_cache, metadata):
        with set_current_vllm_config(self.cfg):
            return self.impl.forward_mqa(q, kv_cache, metadata, self.layer)


def select_kernel_block_size(manager_block_size: int, backend, spec) -> int:
    try:  # 0.33 takes the specs too
        return worker_utils.select_common_block_size(manager_block_size, [backend], [spec])
    except TypeError:
        return worker_utils.select_common_block_size(manager_block_size, [backend])


def make_impl(backend, cfg: VllmConfig, scale: float, kv_cache_dtype: str):
    hf = cfg.model_config.hf_text_config
    return backend.get_impl_cls()(
        num_heads=cfg.model_config.get_num_attention_heads(cfg.parallel_config), head_size=HEAD, scale=scale,
        num_kv_heads=1, alibi_slopes=None, sliding_window=None, kv_cache_dtype=kv_cache_dtype,
        logits_soft_cap=None, attn_type="decoder", kv_sharing_target_layer_name=None,
        q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim, qk_head_dim=hf.qk_nope_head_dim + hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim, kv_b_proj=None)


# ---- fake batches ------------------------------------------------------------------------------

def common_attn_metadata(**fields) -> CommonAttentionMetadata:
    """vLLM's CommonAttentionMetadata from the fields this vLLM release has (0.33 dropped _seq_lens_cpu)."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    return CommonAttentionMetadata(**{k: v for k, v in fields.items() if k in known})


class DecodeBatch:
    """A decode batch as vLLM's model runner hands it over, with the KV cache it reads.

    seq_lens[i] tokens of request i are cached, its last query_len tokens being this step's queries;
    seq_len 0 marks a CUDA-graph padding request (null block, no query tokens). KV-manager blocks are
    a random permutation of 1..N (block 0 is the null block); the per-layer cache is viewed in 64-token
    kernel blocks as vLLM does, and every slot no request owns holds NaN.
    """

    def __init__(self, plugin: Plugin, seq_lens: list[int], query_len: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.seq_lens, self.query_len = seq_lens, query_len
        dtype, M = plugin.torch_dtype, plugin.manager_block_size
        B = len(seq_lens)
        self.num_heads = plugin.cfg.model_config.get_num_attention_heads(plugin.cfg.parallel_config)
        per_req = [-(-n // M) for n in seq_lens]
        num_manager_blocks = sum(per_req) + 3 + 1  # spare blocks, null block 0
        width = -(-plugin.cfg.model_config.max_model_len // M)
        perm = (torch.randperm(num_manager_blocks - 1, generator=gen) + 1).tolist()
        manager_table = torch.zeros((B, width), dtype=torch.int32)
        self.tokens = []  # request i's cached latent rows [seq_len, 576]
        k = M // KERNEL_BLOCK
        kv_cache = torch.full((num_manager_blocks * k, KERNEL_BLOCK, HEAD), float("nan"), dtype=dtype)
        for i, n in enumerate(seq_lens):
            blocks = [perm.pop() for _ in range(per_req[i])]
            manager_table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            rows = torch.randn((n, HEAD), generator=gen).to(dtype)
            self.tokens.append(rows)
            for t in range(n):  # token t lives in manager block blocks[t // M] at row t % M
                b, r = blocks[t // M], t % M
                kv_cache[b * k + r // KERNEL_BLOCK, r % KERNEL_BLOCK] = rows[t]
        self.kv_cache = kv_cache
        self.manager_table = manager_table

        q_lens = [query_len if n > 0 else 0 for n in seq_lens]
        if any(n == 0 for n in seq_lens):  # padded CUDA-graph batch: vLLM pads the tokens too
            num_tokens = B * query_len
        else:
            num_tokens = sum(q_lens)
        qsl = torch.zeros(B + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
        seq = torch.tensor(seq_lens, dtype=torch.int32)
        self.common = common_attn_metadata(
            query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=seq.clone(), num_reqs=B,
            num_actual_tokens=num_tokens, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
            block_table_tensor=manager_table, slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
            causal=True, _seq_lens_cpu=seq.clone(), seq_lens_cpu_upper_bound=seq.clone(),
            is_prefilling=torch.zeros(B, dtype=torch.bool))
        # Queries in vLLM's layout: ql_nope is a transposed bmm output (non-contiguous), q_pe a split slice.
        H = self.num_heads
        self.ql_nope = torch.randn((H, num_tokens, LATENT), generator=gen).to(dtype).transpose(0, 1)
        self.q_pe = torch.randn((num_tokens, H, 2 * ROPE), generator=gen).to(dtype)[..., ROPE:]

    def load_into(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        """This batch's lengths and block table written into another batch's tensors of the same shapes
        (the model runner's persistent input buffers, which a captured CUDA graph reads)."""
        for name in ("query_start_loc", "query_start_loc_cpu", "seq_lens", "_seq_lens_cpu",
                     "seq_lens_cpu_upper_bound", "block_table_tensor"):
            if getattr(common, name, None) is not None:
                getattr(common, name).copy_(getattr(self.common, name))
        return common.replace(max_seq_len=self.common.max_seq_len, max_query_len=self.common.max_query_len)

    def q(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ql_nope, self.q_pe

    def expected(self, scale: float, *, k_scale: float | None = None, q8: torch.Tensor | None = None,
                 q_scale: float | None = None) -> torch.Tensor:
        """The reference on a dense cache built from the raw token rows (independent of vLLM's paging).

        With k_scale: the rows as an FP8 cache stores them, e4m3(row / k_scale), read with descale_k = k_scale;
        with q8 (an e4m3 [T, N, 576] query) and q_scale: that query, dequantized, instead of the 16-bit one."""
        B, s_q, H = len(self.seq_lens), self.query_len, self.num_heads
        q = (torch.cat([self.ql_nope, self.q_pe], dim=-1) if q8 is None else q8).reshape(B, s_q, H, HEAD)
        pages = [-(-n // KERNEL_BLOCK) for n in self.seq_lens]
        cache_dtype = q.dtype if k_scale is None else FP8
        dense = torch.zeros((max(sum(pages), 1), KERNEL_BLOCK, 1, HEAD), dtype=cache_dtype)
        table = torch.zeros((B, max(max(pages), 1)), dtype=torch.int32)
        start = 0
        for i, rows in enumerate(self.tokens):
            n = rows.shape[0]
            flat = dense[start: start + pages[i]].view(-1, HEAD)
            flat[:n] = rows if k_scale is None else (rows.float() / k_scale).to(FP8)
            table[i, : pages[i]] = torch.arange(start, start + pages[i], dtype=torch.int32)
            start += pages[i]
        scales = {}
        if k_scale is not None:
            scales["descale_k"] = torch.tensor([k_scale], dtype=torch.float32)
        if q8 is not None:
            scales["descale_q"] = torch.tensor([q_scale], dtype=torch.float32)
        out, _ = mla_decode_reference(q, dense, table, torch.tensor(self.seq_lens, dtype=torch.int32),
                                      LATENT, softmax_scale=scale, causal=True, **scales)
        return out.reshape(B * s_q, H, LATENT)

    def fp8_cache(self, k_scale: float) -> torch.Tensor:
        """The cache as vLLM's FP8 cache op leaves it: e4m3(value / k_scale) bytes in vLLM's uint8 allocation
        (the never-written slots, NaN here, stay NaN)."""
        return (self.kv_cache.float() / k_scale).to(FP8).view(torch.uint8)

    def fp8_query(self, q_scale: float) -> torch.Tensor:
        """The fast mode's query: vLLM's fused concat + quant, one e4m3 [T, N, 576] tensor (saturating)."""
        q = torch.cat(self.q(), dim=-1).float() / q_scale
        return q.clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


# ---- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def registered():
    os.environ.pop(DEBUG_BREAK_SCALE_ENV, None)
    register()
    yield


# ---- registration and versions -----------------------------------------------------------------

def test_register_points_custom_at_the_plugin():
    register()  # idempotent: vLLM may load plugins more than once per process
    assert AttentionBackendEnum.CUSTOM.get_path() == BACKEND_CLASS_PATH
    assert AttentionBackendEnum.CUSTOM.get_class() is FlashMLAPluginBackend
    backend = FlashMLAPluginBackend
    assert backend.is_mla() and backend.get_name() == "CUSTOM"
    assert backend.get_supported_kernel_block_sizes() == [KERNEL_BLOCK]
    assert backend.get_builder_cls()._cudagraph_support.name == "UNIFORM_BATCH"
    assert backend.get_builder_cls().query_len_support.name == "UNIFORM"


def test_named_backend_where_vllm_accepts_names():
    if not callable(getattr(AttentionBackendEnum, "register", None)):
        assert BACKEND_NAME not in AttentionBackendEnum.__members__  # 0.26: enum members only
        pytest.skip(f"vLLM {vllm.__version__} does not accept new backend names")
    assert AttentionBackendEnum[BACKEND_NAME].get_class() is FlashMLAPluginBackend
    from vllm.config import AttentionConfig

    assert AttentionConfig(backend=BACKEND_NAME).backend == AttentionBackendEnum[BACKEND_NAME]


def test_attention_config_selects_custom():
    from vllm.config import AttentionConfig

    assert AttentionConfig(backend="CUSTOM").backend == AttentionBackendEnum.CUSTOM


def test_entry_point_declared():
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    eps = pyproject["project"]["entry-points"]["vllm.general_plugins"]
    assert eps["flashmla_backend"] == "flashmla_backend.vllm:register"


def test_vllm_plugin_loader_runs_register(monkeypatch, tmp_path):
    """vLLM's own plugin loader finds the entry point and its call registers the backend. Where the
    package is not pip-installed, a dist-info declaring pyproject.toml's entry point stands in."""
    from importlib.metadata import entry_points

    if not any(ep.name == "flashmla_backend" for ep in entry_points(group="vllm.general_plugins")):
        tomllib = pytest.importorskip("tomllib")
        target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"][
            "vllm.general_plugins"]["flashmla_backend"]
        info = tmp_path / "flashmla_backend_entry_point_test-0.0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flashmla_backend_entry_point_test\n"
                                       "Version: 0.0.0\n")
        (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\nflashmla_backend = {target}\n")
        monkeypatch.syspath_prepend(str(tmp_path))
    from vllm.plugins import load_plugins_by_group

    monkeypatch.setenv("VLLM_PLUGINS", "flashmla_backend")
    AttentionBackendEnum.CUSTOM.clear_override()
    try:
        plugins = load_plugins_by_group("vllm.general_plugins")
        assert set(plugins) == {"flashmla_backend"}
        plugins["flashmla_backend"]()
        assert AttentionBackendEnum.CUSTOM.get_class() is FlashMLAPluginBackend
    finally:
        register()  # leave the registry as the other tests expect it


def test_installed_vllm_version_is_supported():
    assert _compat.unsupported_reason(vllm.__version__) is None, vllm.__version__


@pytest.mark.parametrize("version", ["0.25.1", "0.34.0", "1.0.0", "", "garbage"])
def test_unsupported_versions_fail_with_the_supported_range(version, monkeypatch):
    reason = _compat.unsupported_reason(version)
    assert reason is not None and _compat.SUPPORTED_RANGE in reason and "0.26.0" in reason
    monkeypatch.setattr(_compat, "installed_vllm_version", lambda: version)
    reasons = UnsupportedVLLMVersionBackend.validate_configuration(
        head_size=HEAD, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None, use_mla=True,
        device_capability=HOPPER)
    assert reasons == [reason]


@pytest.mark.parametrize("version", ["0.26.0", "0.26.1", "0.30.0rc1", "0.33.0", "0.33.2.dev4+g0123"])
def test_supported_versions(version):
    assert _compat.unsupported_reason(version) is None


# ---- vLLM's automatic choice (selector) on a stand-in Hopper ----------------------------------

def stand_in_cuda_platform(monkeypatch, major: int = 9):
    """vLLM's own CUDA platform class (its real get_attn_backend_cls and MLA priority list) reporting
    compute capability major.0, made vLLM's current platform. Make the VllmConfig before calling this:
    config checks expect the platform the process really has."""
    import importlib
    import types

    import vllm.platforms
    from vllm.v1.attention import selector

    try:
        cuda = importlib.import_module("vllm.platforms.cuda")
    except ImportError:  # its compiled ops need libcuda; the selection logic does not
        monkeypatch.setitem(sys.modules, "vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
        cuda = importlib.import_module("vllm.platforms.cuda")
        monkeypatch.setitem(sys.modules, "vllm.platforms.cuda", cuda)  # dropped again after the test

    class StandInGPU(cuda.NonNvmlCudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return DeviceCapability(major, 0)

    platform = StandInGPU()
    monkeypatch.setattr(vllm.platforms, "current_platform", platform, raising=False)
    selector._cached_get_attn_backend.cache_clear()  # selections made for the real platform
    return platform


def selected_backend(cfg: VllmConfig, *, kv_cache_dtype: str = "auto", use_mla: bool = True, head_size=HEAD):
    """The backend class vLLM's selector returns for one attention layer, or the ValueError's text."""
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()
    with set_current_vllm_config(cfg):
        try:
            return selector.get_attn_backend(head_size, cfg.model_config.dtype, kv_cache_dtype, use_mla=use_mla)
        except ValueError as e:  # no backend of vLLM's imports on this CPU-only machine
            return str(e)


@pytest.fixture
def clean_selector():
    from vllm.v1.attention import selector

    yield
    selector._cached_get_attn_backend.cache_clear()


@pytest.mark.parametrize("name", ["CUSTOM", BACKEND_NAME])
def test_named_selection_reaches_the_plugin_through_vllms_selector(name, monkeypatch, clean_selector):
    if name not in AttentionBackendEnum.__members__:
        pytest.skip(f"vLLM {vllm.__version__} does not accept new backend names")
    cfg = vllm_config(64)
    cfg.attention_config.backend = AttentionBackendEnum[name]
    stand_in_cuda_platform(monkeypatch)
    assert selected_backend(cfg) is FlashMLAPluginBackend


def test_default_choice_is_vllms_without_the_opt_in(monkeypatch, clean_selector):
    monkeypatch.delenv(default_choice.ENV, raising=False)
    cfg = vllm_config(64)
    platform = stand_in_cuda_platform(monkeypatch)
    register()
    assert not default_choice.is_installed(platform)
    chosen = selected_backend(cfg)
    assert chosen is not FlashMLAPluginBackend, chosen
    assert AttentionBackendEnum.CUSTOM.get_class() is FlashMLAPluginBackend  # still selectable by name


def test_default_choice_opt_in_picks_the_plugin_for_mla_on_hopper(monkeypatch, clean_selector):
    monkeypatch.setenv(default_choice.ENV, "1")
    cfg, fp8, block32 = vllm_config(64), vllm_config(64, kv_cache_dtype="fp8"), vllm_config(32)
    block32.cache_config.user_specified_block_size = True  # as `--block-size 32` sets it (0.33 reads it)
    explicit = vllm_config(64)
    explicit.attention_config.backend = AttentionBackendEnum.TRITON_MLA
    platform = stand_in_cuda_platform(monkeypatch)
    register()
    register()  # idempotent: one wrapper
    assert default_choice.is_installed(platform)
    chain = [platform.get_attn_backend_cls]  # register() also attaches the sparse MLA route (sparse_choice.py)
    while hasattr(chain[-1], "__wrapped__"):
        chain.append(chain[-1].__wrapped__)
    assert sum(bool(getattr(f, default_choice._MARK, False)) for f in chain) == 1
    assert selected_backend(cfg) is FlashMLAPluginBackend
    # Layers the plugin refuses, named backends and non-MLA layers keep vLLM's choice.
    assert selected_backend(fp8, kv_cache_dtype="fp8") is FlashMLAPluginBackend  # FP8 (e4m3) caches too
    e5m2 = vllm_config(64, kv_cache_dtype="fp8_e5m2")
    assert selected_backend(e5m2, kv_cache_dtype="fp8_e5m2") is not FlashMLAPluginBackend
    if hasattr(block32.cache_config, "user_specified_block_size"):
        assert selected_backend(block32) is not FlashMLAPluginBackend
    assert selected_backend(explicit) is AttentionBackendEnum.TRITON_MLA.get_class()
    assert selected_backend(cfg, use_mla=False, head_size=128) is not FlashMLAPluginBackend


def test_default_choice_opt_in_leaves_other_gpus_alone(monkeypatch, clean_selector):
    monkeypatch.setenv(default_choice.ENV, "1")
    cfg = vllm_config(64)
    platform = stand_in_cuda_platform(monkeypatch, major=8)
    register()
    assert default_choice.is_installed(platform)
    assert selected_backend(cfg) is not FlashMLAPluginBackend


def test_default_choice_opt_in_does_nothing_off_cuda(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setenv(default_choice.ENV, "1")
    assert not current_platform.is_cuda()
    register()  # must not raise
    assert not default_choice.is_installed(current_platform)


# ---- refusals, through vLLM's selector check ---------------------------------------------------

def selector_reasons(cfg: VllmConfig | None = None, *, model: ModelConfig | None = None, block_size=None,
                     kv_cache_dtype="auto", dtype=None) -> list[str]:
    """What vLLM's CUDA platform checks when the backend is selected (cuda.py: validate_configuration)."""
    from vllm.v1.attention.selector import AttentionSelectorConfig

    model = model or cfg.model_config
    fields = AttentionSelectorConfig._fields
    values = dict(head_size=model.get_head_size(), dtype=dtype or model.dtype, kv_cache_dtype=kv_cache_dtype,
                  block_size=block_size, use_mla=model.use_mla, has_sink=False, use_sparse=False,
                  use_mm_prefix=False, use_per_head_quant_scales=False, attn_type="decoder")
    selector = AttentionSelectorConfig(**{k: v for k, v in values.items() if k in fields})
    return FlashMLAPluginBackend.validate_configuration(device_capability=HOPPER, **selector._asdict())


@pytest.mark.parametrize("block_size", [None, 64, 128, 256])
def test_block_sizes_that_work(block_size):
    assert selector_reasons(model=model_config(), block_size=block_size) == []


@pytest.mark.parametrize("block_size", [16, 32])
def test_small_block_sizes_refused_naming_the_ones_that_work(block_size):
    reasons = selector_reasons(model=model_config(), block_size=block_size)
    assert "block_size not supported" in reasons  # vLLM's own reason ...
    ours = " ".join(reasons)  # ... and ours, which says what to use
    assert f"{block_size} does not" in ours and all(s in ours for s in ("64", "128", "256"))


@pytest.mark.parametrize("manager_block_size,kernel_block_size", [(64, 64), (128, 64), (256, 64)])
def test_vllm_splits_manager_blocks_into_64_token_kernel_blocks(manager_block_size, kernel_block_size):
    spec = MLAAttentionSpec(block_size=manager_block_size, num_kv_heads=1, head_size=HEAD, dtype=torch.bfloat16)
    assert select_kernel_block_size(manager_block_size, FlashMLAPluginBackend, spec) == kernel_block_size


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_fp8_kv_cache_accepted(kv_cache_dtype):
    assert selector_reasons(model=model_config(), kv_cache_dtype=kv_cache_dtype) == []
    cfg = vllm_config(kv_cache_dtype=kv_cache_dtype)
    with set_current_vllm_config(cfg):
        impl = make_impl(FlashMLAPluginBackend, cfg, layer_scale(cfg), kv_cache_dtype)
    assert impl.kv_fp8 and impl.fp8_mode == engine_support.DEFAULT_FP8_MODES["vllm"]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e5m2", "fp8_ds_mla", "int8"])
def test_other_kv_cache_formats_refused_naming_what_works(kv_cache_dtype):
    reasons = " ".join(selector_reasons(model=model_config(), kv_cache_dtype=kv_cache_dtype))
    assert "kv_cache_dtype not supported" in reasons  # vLLM's own reason, and ours naming what works
    assert kv_cache_dtype in reasons and "fp8_e4m3" in reasons and "auto" in reasons
    cfg = vllm_config()
    with set_current_vllm_config(cfg), pytest.raises(NotImplementedError, match="fp8, fp8_e4m3"):
        make_impl(FlashMLAPluginBackend, cfg, layer_scale(cfg), kv_cache_dtype)


def test_kv_cache_dtype_must_match_model_dtype():
    assert selector_reasons(model=model_config(), kv_cache_dtype="bfloat16") == []
    reasons = " ".join(selector_reasons(model=model_config(), kv_cache_dtype="float16"))
    assert "model dtype" in reasons


def test_non_mla_model_refused(tmp_path):
    llama = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(llama))
    model = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024)
    assert not model.use_mla
    reasons = selector_reasons(model=model)
    assert "non-MLA not supported" in reasons
    assert any("only MLA models" in r for r in reasons)


def test_tiny_deepseek_config_resolves_to_mla():
    model = model_config()
    assert model.use_mla and model.get_head_size() == HEAD
    assert model.hf_text_config.kv_lora_rank == LATENT and model.hf_text_config.qk_rope_head_dim == ROPE


# ---- build() and forward_mqa against the reference ---------------------------------------------

CASES = {
    # name: (manager block size, query length, seq_lens, model dtype)
    "decode_bs64": (64, 1, [1, 37, 64, 65, 300, 1000], "bfloat16"),
    "decode_bs128": (128, 1, [129, 255, 256, 257, 2047], "bfloat16"),
    "decode_bs256": (256, 1, [5, 511, 513, 1500], "bfloat16"),
    "decode_fp16": (128, 1, [3, 200, 700], "float16"),
    "spec2_bs64": (64, 2, [2, 70, 300, 999], "bfloat16"),
    "spec4_bs256": (256, 4, [4, 64, 65, 777, 2000], "bfloat16"),
    "spec4_bs128_fp16": (128, 4, [9, 130, 1024], "float16"),
    "padded_decode": (64, 1, [100, 300, 0, 0], "bfloat16"),
    "padded_spec2": (128, 2, [64, 500, 0], "bfloat16"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_build_and_forward_mqa_match_reference(case):
    manager_block_size, s_q, seq_lens, dtype = CASES[case]
    cfg = vllm_config(manager_block_size, dtype=dtype, query_len=s_q)
    plugin = Plugin(cfg)
    assert plugin.kernel_block_size == KERNEL_BLOCK
    assert plugin.builder.kv_cache_spec.block_size == KERNEL_BLOCK
    batch = DecodeBatch(plugin, seq_lens, s_q, seed=sum(seq_lens) + s_q)

    md = plugin.build(batch.common)
    B = len(seq_lens)
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens) == (B, 0, batch.common.num_actual_tokens)
    assert md.prefill is None and isinstance(md.decode, FlashMLAPluginDecodeMetadata)
    assert md.decode.query_len == s_q
    # The block table the kernel sees is in 64-token blocks: manager block b -> kernel blocks b*k .. b*k+k-1.
    k = manager_block_size // KERNEL_BLOCK
    table = md.decode.block_table
    for i, n in enumerate(seq_lens):
        for p in range(-(-n // KERNEL_BLOCK)):
            assert int(table[i, p]) == int(batch.manager_table[i, p // k]) * k + p % k
        if n == 0:
            assert int(table[i, 0]) == 0  # padding requests point at the null block
    want_md, want_splits = flashmla_backend.get_mla_metadata(batch.common.seq_lens, s_q * batch.num_heads, 1)
    assert torch.equal(md.decode.tile_scheduler_metadata, want_md)
    assert torch.equal(md.decode.num_splits, want_splits)

    out, lse = plugin.forward_mqa(batch.q(), batch.kv_cache, md)
    assert lse is None
    assert out.shape == (batch.common.num_actual_tokens, batch.num_heads, LATENT) and out.dtype == plugin.torch_dtype
    expected = batch.expected(plugin.scale)
    assert torch.isfinite(out).all()  # NaN-poisoned slots (null block, spare blocks) are never read
    torch.testing.assert_close(out, expected, atol=OUT_ATOL, rtol=OUT_RTOL)
    for i, n in enumerate(seq_lens):
        if n == 0:
            assert not out[i * s_q:(i + 1) * s_q].any()  # padding requests: zeros


def test_spec_decode_is_causal():
    """With s_q = 4, query token s of a request must not see the request's later tokens."""
    cfg = vllm_config(64, query_len=4)
    plugin = Plugin(cfg)
    batch = DecodeBatch(plugin, [70, 300], 4, seed=7)
    md = plugin.build(batch.common)
    out, _ = plugin.forward_mqa(batch.q(), batch.kv_cache, md)
    B, H = 2, batch.num_heads
    q = torch.cat(batch.q(), dim=-1).reshape(B, 4, H, HEAD)
    non_causal = []
    for i, rows in enumerate(batch.tokens):  # dense attention over every cached token, no mask
        kv = rows.float()
        scores = torch.einsum("shd,nd->shn", q[i].float(), kv) * plugin.scale
        non_causal.append(torch.einsum("shn,nd->shd", scores.softmax(-1), kv[:, :LATENT]))
    non_causal = torch.stack(non_causal).reshape(B * 4, H, LATENT).to(out.dtype)
    last = torch.arange(B) * 4 + 3  # the last query token sees everything: both agree there
    torch.testing.assert_close(out[last], non_causal[last], atol=OUT_ATOL, rtol=OUT_RTOL)
    first = torch.arange(B) * 4
    assert (out[first].float() - non_causal[first].float()).abs().max() > 0.05


def test_short_prefills_run_on_the_decode_kernel_as_with_flashmla():
    """The decode threshold is vLLM's FlashMLA builder's, 128 query tokens: a batch of fresh prompts of equal
    length up to 128 is prefilled by the causal decode kernel (not vLLM's MHA prefill), so the plugin and
    FLASHMLA route a step's tokens alike; 129 tokens go to the prefill path."""
    from vllm.v1.attention.backends.mla.flashmla import FlashMLAMetadataBuilder

    assert FlashMLAPluginMetadataBuilder.reorder_batch_threshold == FlashMLAMetadataBuilder.reorder_batch_threshold
    plugin = Plugin(vllm_config(64))
    assert plugin.builder.reorder_batch_threshold == 128
    batch = DecodeBatch(plugin, [128, 128, 128], 128, seed=128)
    md = plugin.build(batch.common)
    assert (md.num_decodes, md.num_prefills) == (3, 0) and md.decode.query_len == 128
    out, _ = plugin.forward_mqa(batch.q(), batch.kv_cache, md)
    torch.testing.assert_close(out, batch.expected(plugin.scale), atol=OUT_ATOL, rtol=OUT_RTOL)
    # 129 tokens: vLLM's split (the builder's call: uniform query lengths required) sends them to the prefill path
    # (building that path's metadata needs pinned memory on 0.33, so the split is asked directly).
    from vllm.v1.attention.backends.utils import split_decodes_and_prefills

    common = DecodeBatch(plugin, [129, 129], 129, seed=129).common
    split = split_decodes_and_prefills(common, decode_threshold=plugin.builder.reorder_batch_threshold,
                                       require_uniform=True)
    assert split[:2] == (0, 2)


def test_forward_mqa_uses_the_layers_scale():
    cfg = vllm_config(64)
    scale = 0.0917  # neither 576 ** -0.5 nor 192 ** -0.5
    plugin = Plugin(cfg, scale=scale)
    batch = DecodeBatch(plugin, [33, 400, 900], 1, seed=3)
    out, _ = plugin.forward_mqa(batch.q(), batch.kv_cache, plugin.build(batch.common))
    torch.testing.assert_close(out, batch.expected(scale), atol=OUT_ATOL, rtol=OUT_RTOL)
    assert (out.float() - batch.expected(HEAD ** -0.5).float()).abs().max() > 0.05


# ---- FP8 KV cache ------------------------------------------------------------------------------

def fp8_plugin(monkeypatch, mode: str | None, manager_block_size: int = 64, query_len: int = 1,
               kv_cache_dtype: str = "fp8", **kw) -> Plugin:
    if mode is None:
        monkeypatch.delenv(engine_support.FP8_MODE_ENV, raising=False)
    else:
        monkeypatch.setenv(engine_support.FP8_MODE_ENV, mode)
    return Plugin(vllm_config(manager_block_size, kv_cache_dtype=kv_cache_dtype, query_len=query_len, **kw))


@pytest.mark.parametrize("mode,expect_quant_q", [(None, True), ("accurate", False), ("fast", True),
                                                 (" FAST ", True), (" Accurate", False)])
def test_fp8_mode_switch(monkeypatch, mode, expect_quant_q):
    """vLLM's layer quantizes q before forward_mqa exactly when the impl says supports_quant_query_input."""
    plugin = fp8_plugin(monkeypatch, mode)
    assert plugin.impl.supports_quant_query_input is expect_quant_q
    assert plugin.impl.fp8_mode == ("fast" if expect_quant_q else "accurate")
    bf16 = Plugin(vllm_config(64))  # the variable does not matter for a 16-bit cache
    assert bf16.impl.supports_quant_query_input is False and bf16.impl.fp8_mode is None


def test_fp8_mode_switch_refuses_unknown_values(monkeypatch):
    monkeypatch.setenv(engine_support.FP8_MODE_ENV, "turbo")
    with pytest.raises(ValueError, match=f"{engine_support.FP8_MODE_ENV}='turbo'.*accurate, fast"):
        Plugin(vllm_config(64, kv_cache_dtype="fp8"))


@pytest.mark.parametrize("mode", ["accurate", "fast", None])
def test_fp8_output_in_an_fp16_models_dtype(monkeypatch, mode):
    """An fp16 model with an FP8 cache: the kernel's output with an e4m3 q (fast, the default) is bf16, which vLLM's
    layer would multiply by its fp16 W_UV; forward_mqa hands it over in fp16, as the accurate mode's output is."""
    plugin = fp8_plugin(monkeypatch, mode, dtype="float16")
    assert plugin.impl.fp8_mode == (mode or engine_support.DEFAULT_FP8_MODES["vllm"])
    plugin.layer.set_scales(0.05, 0.03)
    seq_lens = [3, 200, 700]
    batch = DecodeBatch(plugin, seq_lens, 1, seed=5)
    md = plugin.build(batch.common)
    cache = batch.fp8_cache(0.05).view(FP8)
    if plugin.impl.fp8_mode == "fast":
        q8 = batch.fp8_query(0.03)
        out, _ = plugin.forward_mqa(q8, cache, md)
        expected = batch.expected(plugin.scale, k_scale=0.05, q8=q8, q_scale=0.03)
    else:
        out, _ = plugin.forward_mqa(batch.q(), cache, md)
        expected = batch.expected(plugin.scale, k_scale=0.05)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected.float(), atol=OUT_ATOL, rtol=OUT_RTOL)


FP8_CASES = {  # name: (manager block size, s_q, seq_lens, k_scale, cache handed as uint8 bytes)
    "decode_bs64": (64, 1, [1, 33, 64, 65, 700, 1500], 0.05, True),
    "decode_bs256_scale1": (256, 1, [5, 255, 257, 2500], 1.0, False),
    "spec2_bs64": (64, 2, [2, 70, 300, 999], 0.02, True),
    "spec4_bs128": (128, 4, [4, 130, 1024], 0.05, False),
    "padded_spec2": (128, 2, [64, 500, 0], 0.05, True),
}


@pytest.mark.parametrize("mode", ["accurate", "fast"])
@pytest.mark.parametrize("case", list(FP8_CASES))
def test_fp8_forward_mqa_matches_the_dequantized_reference(monkeypatch, case, mode):
    """Both modes on the bytes vLLM's FP8 cache op writes, with the layer's scales (k_scale != 1 included)."""
    manager_block_size, s_q, seq_lens, k_scale, as_bytes = FP8_CASES[case]
    plugin = fp8_plugin(monkeypatch, mode, manager_block_size, s_q)
    q_scale = 0.03
    plugin.layer.set_scales(k_scale, q_scale)
    batch = DecodeBatch(plugin, seq_lens, s_q, seed=sum(seq_lens) + s_q)
    md = plugin.build(batch.common)
    cache = batch.fp8_cache(k_scale)
    if not as_bytes:
        cache = cache.view(FP8)  # as vLLM's layer hands it (it views the uint8 allocation)
    if mode == "fast":
        q8 = batch.fp8_query(q_scale)
        out, _ = plugin.forward_mqa(q8, cache, md)
        expected = batch.expected(plugin.scale, k_scale=k_scale, q8=q8, q_scale=q_scale)
    else:
        out, _ = plugin.forward_mqa(batch.q(), cache, md)
        expected = batch.expected(plugin.scale, k_scale=k_scale)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=OUT_ATOL, rtol=OUT_RTOL)
    # The scale matters: reading the bytes with another descale gives another answer.
    wrong = batch.expected(plugin.scale, k_scale=k_scale * 1.5) if mode == "accurate" else None
    if wrong is not None and k_scale != 1.0:
        assert (out.float() - wrong.float()).abs().max() > 0.02


def test_fp8_adapter_hands_the_kernel_the_layers_tensors_in_place(monkeypatch):
    """No copy of q (its two parts go to the kernel as they are), the cache viewed not converted, and the
    descales are views of the layer's own scale tensors, so a CUDA-graph replay reads their current values."""
    plugin = fp8_plugin(monkeypatch, "accurate")
    plugin.layer.set_scales(0.05)
    batch = DecodeBatch(plugin, [70, 300], 1, seed=21)
    md = plugin.build(batch.common)
    seen = {}
    real = flashmla_backend.flash_mla_with_kvcache

    def spy(q, k_cache, *args, **kw):
        seen.update(q=q, k_cache=k_cache, **kw)
        return real(q, k_cache, *args, **kw)

    monkeypatch.setattr(flashmla_backend, "flash_mla_with_kvcache", spy)
    cache = batch.fp8_cache(0.05)
    plugin.forward_mqa(batch.q(), cache, md)
    ql_nope, q_pe = batch.q()
    assert seen["q"].data_ptr() == ql_nope.data_ptr() and seen["q_pe"].data_ptr() == q_pe.data_ptr()
    assert seen["k_cache"].dtype == FP8 and seen["k_cache"].data_ptr() == cache.data_ptr()
    assert seen["descale_k"].data_ptr() == plugin.layer._k_scale.data_ptr() and seen["descale_q"] is None
    monkeypatch.setenv(engine_support.FP8_MODE_ENV, "fast")
    fast = Plugin(vllm_config(64, kv_cache_dtype="fp8"))
    fast.layer.set_scales(0.05, 0.03)
    seen.clear()
    fast.forward_mqa(batch.fp8_query(0.03), cache, fast.build(batch.common))
    assert seen["descale_q"].data_ptr() == fast.layer._q_scale.data_ptr() and seen.get("q_pe") is None


def test_16bit_decode_passes_q_in_two_parts_without_a_copy(monkeypatch):
    plugin = Plugin(vllm_config(64))
    batch = DecodeBatch(plugin, [40, 900], 1, seed=22)
    seen = {}
    real = flashmla_backend.flash_mla_with_kvcache

    def spy(q, *args, **kw):
        seen.update(q=q, **kw)
        return real(q, *args, **kw)

    monkeypatch.setattr(flashmla_backend, "flash_mla_with_kvcache", spy)
    out, _ = plugin.forward_mqa(batch.q(), batch.kv_cache, plugin.build(batch.common))
    assert seen["q"].data_ptr() == batch.ql_nope.data_ptr() and seen["q_pe"].data_ptr() == batch.q_pe.data_ptr()
    assert seen["descale_k"] is None
    torch.testing.assert_close(out, batch.expected(plugin.scale), atol=OUT_ATOL, rtol=OUT_RTOL)


class _Records(list):
    """The records one logger emits (whatever vLLM's logging configuration does with propagation)."""

    def messages(self, text: str) -> list[str]:
        return [r.getMessage() for r in self if text in r.getMessage()]


@pytest.fixture
def plugin_log():
    import logging

    from flashmla_backend.vllm import impl as impl_module

    records = _Records()
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("vllm.flashmla_backend")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    impl_module._default_scale_logged = False
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old_level)
    impl_module._default_scale_logged = False


def test_fp8_default_scale_is_reported_once(monkeypatch, plugin_log):
    plugin = fp8_plugin(monkeypatch, None)
    batch = DecodeBatch(plugin, [70, 300], 1, seed=23)
    md = plugin.build(batch.common)
    for _ in range(3):
        plugin.forward_mqa(batch.q(), batch.fp8_cache(1.0), md)
    lines = plugin_log.messages("default scale 1.0")
    assert len(lines) == 1 and "--calculate-kv-scales" in lines[0]


def test_fp8_calibrated_scale_is_not_reported(monkeypatch, plugin_log):
    plugin = fp8_plugin(monkeypatch, None)
    plugin.layer.set_scales(0.05)
    batch = DecodeBatch(plugin, [70, 300], 1, seed=24)
    plugin.forward_mqa(batch.q(), batch.fp8_cache(0.05), plugin.build(batch.common))
    bf16 = Plugin(vllm_config(64))
    bf16.forward_mqa(batch.q(), batch.kv_cache, bf16.build(batch.common))
    assert not plugin_log.messages("default scale")


def test_fp8_start_up_line_names_the_cache_and_mode(monkeypatch, plugin_log):
    from flashmla_backend.vllm import impl as impl_module

    monkeypatch.setattr(impl_module, "_announced", False)
    fp8_plugin(monkeypatch, "fast")
    line, = plugin_log.messages("MLA decode attention runs on")
    assert "FP8 KV cache" in line and "mode fast" in line


def test_cuda_graph_buffers_are_persistent_and_refreshed():
    """Full CUDA graphs replay kernels that read fixed addresses: every build() must write this step's
    metadata into the same buffers ([num_SMs, 8] and [max_num_seqs + 1] int32)."""
    cfg = vllm_config(128, query_len=2, full_cuda_graphs=True)
    plugin = Plugin(cfg)
    plan = plugin.builder.plan
    assert plan.has_graph_buffers and plan.max_batch == cfg.scheduler_config.max_num_seqs
    assert plan.cg_tile_scheduler_metadata.shape == (flashmla_backend.device.sm_count(torch.device("cpu")), 8)
    assert plan.cg_num_splits.shape == (cfg.scheduler_config.max_num_seqs + 1,)

    first = DecodeBatch(plugin, [5, 1000, 64, 0], 2, seed=11)  # a padded batch, as captured
    second = DecodeBatch(plugin, [2000, 3, 129, 700], 2, seed=12)  # same shape, new lengths
    md1 = plugin.build(first.common)
    tile1, splits1 = md1.decode.tile_scheduler_metadata, md1.decode.num_splits
    tile1_values = tile1.clone()
    out1, _ = plugin.forward_mqa(first.q(), first.kv_cache, md1)
    torch.testing.assert_close(out1, first.expected(plugin.scale), atol=OUT_ATOL, rtol=OUT_RTOL)

    md2 = plugin.build(second.load_into(first.common))
    tile2, splits2 = md2.decode.tile_scheduler_metadata, md2.decode.num_splits
    assert tile2.data_ptr() == tile1.data_ptr() == plan.cg_tile_scheduler_metadata.data_ptr()
    assert splits2.data_ptr() == splits1.data_ptr() == plan.cg_num_splits.data_ptr()
    want_md, want_splits = flashmla_backend.get_mla_metadata(second.common.seq_lens, 2 * second.num_heads, 1)
    assert torch.equal(tile1, want_md) and torch.equal(splits1, want_splits)  # the captured views see new values
    assert not torch.equal(tile1_values, want_md)
    # A "replay": the first step's metadata object, whose tensors are the persistent buffers.
    out2, _ = plugin.forward_mqa(second.q(), second.kv_cache, md1)
    torch.testing.assert_close(out2, second.expected(plugin.scale), atol=OUT_ATOL, rtol=OUT_RTOL)


def test_eager_mode_allocates_no_graph_buffers():
    plugin = Plugin(vllm_config(64))
    plan = plugin.builder.plan
    assert not plan.has_graph_buffers
    assert plan.cg_tile_scheduler_metadata is None and plan.cg_num_splits is None


def test_debug_break_scale_hook_breaks_the_comparison(monkeypatch):
    """The test hook the GPU end-to-end tests use to prove they catch wrong attention."""
    monkeypatch.setenv(DEBUG_BREAK_SCALE_ENV, "1")
    cfg = vllm_config(64)
    plugin = Plugin(cfg)
    assert math.isclose(plugin.impl.decode_scale, 1.5 * plugin.scale)
    batch = DecodeBatch(plugin, [50, 600, 1200], 1, seed=5)
    out, _ = plugin.forward_mqa(batch.q(), batch.kv_cache, plugin.build(batch.common))
    assert (out.float() - batch.expected(plugin.scale).float()).abs().max() > 0.05


def test_uniform_query_len_rejects_mixed_decodes():
    assert uniform_query_len(torch.tensor([0, 2, 4, 4, 4]), 8) == 2  # padding requests have 0 tokens
    with pytest.raises(ValueError, match="query lengths"):
        uniform_query_len(torch.tensor([0, 1, 4]), 4)
    with pytest.raises(ValueError, match="not uniform"):
        uniform_query_len(torch.tensor([0, 1, 3, 4]), 4)


def test_builder_refuses_a_non_64_kernel_block():
    cfg = vllm_config(64)
    spec = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=HEAD, dtype=torch.bfloat16)
    cfg.compilation_config.static_forward_context[LAYER_NAME] = LayerDouble(cfg, layer_scale(cfg))
    with set_current_vllm_config(cfg), pytest.raises(ValueError, match="64"):
        FlashMLAPluginBackend.get_builder_cls()(spec, [LAYER_NAME], cfg, torch.device("cpu"))


def test_builder_plans_for_the_head_count_vllm_gives_the_group():
    """vLLM 0.31+ counts a KV-cache group's query heads on its layers (a draft model's group may have
    fewer heads than the target); the tile-scheduler plan must use that count, 0.26's model-wide one there."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    from flashmla_backend._versions import in_range

    class DraftLayer(LayerDouble, AttentionLayerBase):
        def get_attn_backend(self):
            return FlashMLAPluginBackend

        def get_kv_cache_spec(self, vllm_config):
            return None

    cfg = vllm_config(64)
    model_heads = cfg.model_config.get_num_attention_heads(cfg.parallel_config)
    layer = DraftLayer(cfg, layer_scale(cfg))
    layer.num_heads = model_heads // 2
    cfg.compilation_config.static_forward_context[LAYER_NAME] = layer
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=HEAD, dtype=torch.bfloat16)
    with set_current_vllm_config(cfg):
        builder = FlashMLAPluginBackend.get_builder_cls()(spec, [LAYER_NAME], cfg, torch.device("cpu"))
    per_layer = in_range(vllm.__version__, (0, 31, 0), (1, 0, 0))  # read in 0.26 (model-wide) and 0.31-0.33
    assert builder.num_q_heads == builder.num_heads == (layer.num_heads if per_layer else model_heads)
    assert builder.plan.num_q_heads == builder.num_q_heads


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


# ---- the ablation hook: vLLM's FlashMLA kernel in the plugin's decode ----------------------------

VLLM_KERNEL_ENV = "FLASHMLA_BACKEND_DEBUG_VLLM_DECODE_KERNEL"


def test_vllm_kernel_hook_refuses_an_fp8_cache(monkeypatch):
    monkeypatch.setenv(VLLM_KERNEL_ENV, "1")
    with pytest.raises(NotImplementedError, match=VLLM_KERNEL_ENV + ".*16-bit KV cache only"):
        Plugin(vllm_config(64, kv_cache_dtype="fp8"))


def test_vllm_kernel_hook_refuses_where_flashmla_cannot_run(monkeypatch):
    """On this CPU machine vLLM's FlashMLA has no device to run on: the plugin says so at start-up, naming the hook,
    instead of failing in the first decode."""
    monkeypatch.setenv(VLLM_KERNEL_ENV, "1")
    with pytest.raises(RuntimeError, match=VLLM_KERNEL_ENV):
        Plugin(vllm_config(64))


def test_vllm_kernel_hook_routes_decode_to_vllm_flashmla(monkeypatch, plugin_log):
    """With the hook the decode goes to vLLM's flash_mla_with_kvcache (here a stand-in computing with ours) with q
    and q_pe concatenated, the plugin's block table and lengths, a fresh metadata object, the decode scale and
    causal for s_q > 1; the warning the engine test looks for is logged, and the result is the reference's."""
    import types

    from flashmla_backend.vllm import impl as impl_module

    calls = []

    def fake_kernel(q, k_cache, block_table, cache_seqlens, head_dim_v, sched, num_splits, softmax_scale, causal):
        assert isinstance(sched, dict) and num_splits is None and head_dim_v == LATENT
        calls.append(dict(q=q, causal=causal, scale=softmax_scale, block_table=block_table, seqlens=cache_seqlens))
        meta, splits = flashmla_backend.get_mla_metadata(cache_seqlens, q.shape[1] * q.shape[2], 1)
        return flashmla_backend.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, meta,
                                                       splits, softmax_scale=softmax_scale, causal=causal)

    fake = types.SimpleNamespace(get_mla_metadata=lambda *a, **k: ({}, None), flash_mla_with_kvcache=fake_kernel)
    monkeypatch.setattr(impl_module, "vllm_flashmla_ops", lambda kv_fp8: fake)
    monkeypatch.setattr(impl_module, "_ablation_logged", False)
    monkeypatch.setenv(VLLM_KERNEL_ENV, "1")
    for query_len in (1, 2):
        plugin = Plugin(vllm_config(64, query_len=query_len))
        batch = DecodeBatch(plugin, [50, 600, 1200], query_len, seed=31 + query_len)
        md = plugin.build(batch.common)
        out, lse = plugin.forward_mqa(batch.q(), batch.kv_cache, md)
        assert lse is None
        call = calls[-1]
        assert call["causal"] == (query_len > 1) and call["scale"] == plugin.impl.decode_scale
        assert call["q"].shape == (3, query_len, batch.num_heads, HEAD)
        torch.testing.assert_close(call["q"].reshape(-1, batch.num_heads, HEAD),
                                   torch.cat(batch.q(), dim=-1))
        assert call["block_table"] is md.decode.block_table and call["seqlens"] is md.decode.seq_lens
        torch.testing.assert_close(out, batch.expected(plugin.scale), atol=OUT_ATOL, rtol=OUT_RTOL)
    assert len(calls) == 2
    assert len(plugin_log.messages("decode attention runs on vLLM's FlashMLA kernel")) == 1  # once a process


def test_vllm_kernel_hook_is_off_by_default(monkeypatch):
    monkeypatch.delenv(VLLM_KERNEL_ENV, raising=False)
    assert Plugin(vllm_config(64)).impl.vllm_decode_ops is None
    monkeypatch.setenv(VLLM_KERNEL_ENV, "0")
    assert Plugin(vllm_config(64)).impl.vllm_decode_ops is None
