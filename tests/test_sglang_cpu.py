"""CPU conformance of the SGLang plugin against SGLang's real classes (no GPU needed).

Real SGLang pieces: the attention registry and CLI choices, the plugin loader and HookRegistry, the
server-argument page-size pass, DeepSeek's attention-handler registry, the speculative
DraftBackendFactory, ForwardBatch / ForwardMode, ReqToTokenPool, MLATokenToKVPool (KV written through
its own set_kv_buffer), RadixAttention, and the attention unit-test kit's MockMLAModelRunner /
TinyMLAModelConfig (sglang/test/kits/attention_unittest), from which the backend is built through
ATTENTION_BACKENDS as SGLang builds it. The backend's Triton parent constructs on CPU; its Triton
kernels do not run here, so extend batches are only checked to be handed to it. On CPU tensors
flashmla_backend runs its PyTorch reference, so decode / target-verify / draft-extend outputs check
the plugin's plumbing end to end (page table from req_to_token over shuffled pages, key lengths per
mode, causal windows, the layer's scale, CUDA-graph buffers) against dense attention computed here.
FP8 KV caches: the same on the kit's FP8 MLATokenToKVPool (e4m3 bytes in a uint8 buffer), with the layers'
KV-cache scales set by SGLang's own loading code (BaseKVCacheMethod); the reference attends over the dequantized
cache (stored e4m3 value x k_scale), and the stored bytes are checked against SGLang's write rule (k / k_scale
cast to e4m3).

torchvision: SGLang imports it at module import (0.5.17-0.5.20: sglang.srt.utils.common; all: configs
of vision models), but PyPI's torchvision wheels are CUDA builds that cannot load with the CPU torch.
Where torchvision is not installed, SGLang's modules are imported with a stand-in package whose every
attribute raises when used (no attention code uses it); it is removed from sys.modules right after,
and transformers' torchvision check is cached beforehand, so nothing else sees it. SGLang 0.5.17 also
registers "qwen3_asr" configs that transformers 5.18+ ship (and older transformers need torchvision), as
do 0.5.18 and 0.5.19: while SGLang's modules are imported, AutoConfig.register replaces existing names
instead of raising.

Engine versions and their requirement files: the ENGINES table of noxfile.py
(0.5.21, 0.5.23; 0.5.17 with FLASHMLA_BACKEND_EXTRA_ENGINES=1). Tests of interfaces a release lacks skip
with the reason (the KVWriteLoc physical check before 0.5.22, the metadata glue graph in 0.5.17).

Run them with `bash tests/run.sh --engines` (SGLang in its own environment under .test-envs/).
"""
from __future__ import annotations

import contextlib
import importlib.abc
import logging
import importlib.machinery
import importlib.util
import inspect
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

import torch  # noqa: E402


class _Absent:
    """An attribute of the stand-in torchvision: usable in module-level expressions, raises when called."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is not installed (test stand-in)")


class _AbsentLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = types.ModuleType(spec.name)

        def __getattr__(attr, _name=spec.name):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Absent(f"{_name}.{attr}")

        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        module.__path__ = []


class _AbsentFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, _AbsentLoader(), is_package=True)
        return None


@contextlib.contextmanager
def torchvision_stand_in():
    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # lru_cache the truth (False) before the stand-in exists
    finder = _AbsentFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]


@contextlib.contextmanager
def config_names_taken_by_transformers():
    """SGLang 0.5.17-0.5.19 register their own "qwen3_asr" configs with AutoConfig.register, which raises
    since transformers 5.18 ships that model type; the transformers they pin (5.12.1), and every release
    before 5.18, need torchvision for image_processing_auto, which SGLang imports too. While SGLang's modules
    are imported, AutoConfig.register replaces an existing name instead of raising (exist_ok=True; the tests
    use none of those configs; releases that register no taken name are unaffected). Restored right after."""
    from transformers import AutoConfig

    original = AutoConfig.__dict__["register"]  # a staticmethod
    register = AutoConfig.register

    def register_replacing(model_type, config, exist_ok=False):
        return register(model_type, config, exist_ok=True)

    AutoConfig.register = staticmethod(register_replacing)
    try:
        yield
    finally:
        AutoConfig.register = original


if importlib.util.find_spec("sglang") is None:  # before the stand-in, which needs SGLang's transformers
    pytest.skip("SGLang is not installed", allow_module_level=True)

with torchvision_stand_in(), config_names_taken_by_transformers():
    sglang = pytest.importorskip("sglang")
    from sglang.srt.layers.attention import attention_registry  # noqa: E402
    from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry  # noqa: E402
    from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402
    from sglang.srt.runtime_context import get_parallel  # noqa: E402
    from sglang.srt.speculative import draft_utils  # noqa: E402
    from sglang.srt.arg_groups import overrides  # noqa: E402
    from sglang.srt import server_args as sgl_server_args  # noqa: E402
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
    from sglang.srt.layers.quantization.kv_cache import BaseKVCacheMethod  # noqa: E402
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool  # noqa: E402
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit  # noqa: E402

    import flashmla_backend  # noqa: E402
    from flashmla_backend import engine_support  # noqa: E402
    from flashmla_backend.sglang import BACKEND_NAME, DEBUG_BREAK_SCALE_ENV, _compat, create_backend, register  # noqa: E402
    from flashmla_backend.sglang import backend as plugin_backend  # noqa: E402
    from flashmla_backend.sglang import hooks as plugin_hooks  # noqa: E402
    from flashmla_backend.sglang.backend import (  # noqa: E402
        FlashMLAPluginBackend,
        FlashMLAPluginMultiStepDraftBackend,
    )
    from flashmla_backend.geometry import HEAD_DIM_K, HEAD_DIM_V, PAGE_SIZE, ROPE_DIM  # noqa: E402
    from flashmla_backend.sglang.metadata import DecodeMetadataBuilder, fill_block_table  # noqa: E402

    register()

REPO = Path(__file__).resolve().parents[1]
LATENT, ROPE = HEAD_DIM_V, ROPE_DIM
HEAD = HEAD_DIM_K
HEADS = 16
MAX_CONTEXT = 1024
POOL_REQS = 4
# Both sides compute in fp32 from the same bf16/fp16 inputs; outputs are rounded to 16 bits.
OUT_ATOL, OUT_RTOL = 1e-2, 1e-2
FP8 = torch.float8_e4m3fn
FP8_NAN_BYTE = 0x7F  # float8_e4m3fn NaN, the poison of an FP8 pool's unused rows


@pytest.fixture(scope="module", autouse=True)
def single_rank():
    """One attention rank, no decode context parallelism (the kit's MLA module sets only the TP size)."""
    ctx = get_parallel().override(attn_tp_size=1, attn_dcp_rank=0)
    ctx.__enter__()
    yield
    ctx.__exit__(None, None, None)


# ---- SGLang objects ----------------------------------------------------------------------------------

def make_runner(mode=ForwardMode.DECODE, num_draft_tokens: int = 0, dtype=torch.bfloat16, backend=BACKEND_NAME,
                kv_lora_rank: int = LATENT, rope: int = ROPE, page_size: int = PAGE_SIZE, fp8: bool = False):
    """The attention kit's MockMLAModelRunner (ReqToTokenPool + MLATokenToKVPool on CPU, server args published);
    fp8: its FP8 KV cache (--kv-cache-dtype fp8_e4m3: an e4m3 MLATokenToKVPool, the model still in `dtype`)."""
    lens = (num_draft_tokens,) if num_draft_tokens else ()
    case = kit.MLAAttentionCase(name="flashmla_backend_cpu", backend=backend, forward_mode=mode, num_heads=HEADS,
                                page_size=page_size, prefix_lens=(0,) * (1 if not lens else 1), extend_lens=lens)
    cfg = kit.TinyMLAModelConfig(num_heads=HEADS, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope,
                                 hidden_size=64, context_len=MAX_CONTEXT)
    runner = kit.MockMLAModelRunner(case=case, model_config=cfg, dtype=dtype, device="cpu",
                                    max_context_len=MAX_CONTEXT, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope,
                                    runner_batch_size=POOL_REQS, fp8_kv_cache=fp8)
    if fp8:
        pool = runner.token_to_kv_pool
        assert isinstance(pool, MLATokenToKVPool) and pool.dtype == FP8 and pool.store_dtype == torch.uint8
        assert runner.kv_cache_dtype == FP8 and runner.kv_cache_dtype_str == "fp8_e4m3"
    return runner


def make_layer(scale: float = (128 + 64) ** -0.5) -> RadixAttention:
    return RadixAttention(num_heads=HEADS, head_dim=HEAD, scaling=scale, num_kv_heads=1, layer_id=0,
                          v_head_dim=LATENT)


def layer_with_kv_scales(checkpoint_scale: float | None, scale: float = (128 + 64) ** -0.5) -> RadixAttention:
    """A layer whose KV-cache scales SGLang's loading code set (BaseKVCacheMethod, as for an FP8 checkpoint):
    k_scale / v_scale float32 parameters and k_scale_float; checkpoint_scale None: the checkpoint has none (1.0)."""
    layer = make_layer(scale)
    method = BaseKVCacheMethod(None)
    method.create_weights(layer)
    if checkpoint_scale is not None:  # what the weight loader copies from the checkpoint
        layer.k_scale.data.fill_(checkpoint_scale)
        layer.v_scale.data.fill_(checkpoint_scale)
    method.process_weights_after_loading(layer)
    assert layer.k_scale.dtype == torch.float32 and layer.k_scale.numel() == 1
    assert layer.k_scale_float == (1.0 if checkpoint_scale is None else pytest.approx(checkpoint_scale))
    return layer


def scaled_for_store(k: torch.Tensor, layer) -> torch.Tensor:
    """What SGLang's Triton backend hands MLATokenToKVPool.set_kv_buffer for MLA: k / k_scale when the layer has one."""
    return k if layer.k_scale is None else k.clone().div_(layer.k_scale)


def stored_values(k: torch.Tensor, layer, cache_dtype) -> torch.Tensor:
    """The values a decode reads for rows k written with SGLang's rule: 16-bit as is; FP8 the e4m3 cast of
    k / k_scale dequantized (x k_scale), in fp32."""
    if cache_dtype != FP8:
        return k.float()
    scale = 1.0 if layer.k_scale is None else layer.k_scale.float()
    return scaled_for_store(k, layer).to(FP8).float() * scale


class Requests:
    """Requests whose tokens live on shuffled 64-token pages of the runner's MLA pool.

    cached[b] tokens of request b are in the pool (written with the pool's own set_kv_buffer, k / k_scale when
    `layer` has a k_scale, as SGLang's Triton prefill writes them) and req_to_token maps every position;
    `window[b]` more positions get slots (the tokens this step writes). Every pool row no request owns holds NaN,
    so a wrong page read shows up. rows[b] are the model's (16-bit) latent rows, keys(b) what a correct decode
    reads for them (the dequantized cache with an FP8 pool).
    """

    def __init__(self, runner, cached: list[int], window: int, seed: int, layer=None):
        gen = torch.Generator().manual_seed(seed)
        self.runner, self.cached, self.window = runner, cached, window
        pool = runner.token_to_kv_pool
        self.dtype = runner.dtype  # the model's: queries and new rows
        self.cache_dtype = pool.dtype
        self.layer = make_layer() if layer is None else layer
        kv = pool.kv_buffer[0]
        if self.cache_dtype == FP8:
            assert kv.dtype == torch.uint8
            kv.fill_(FP8_NAN_BYTE)
        else:
            kv.fill_(float("nan"))
        num_pages = kv.shape[0] // PAGE_SIZE
        pages = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # page 0 is padding
        self.req_rows = torch.randperm(runner.req_to_token_pool.req_to_token.shape[0], generator=gen)[:len(cached)]
        self.slots, self.rows = [], []
        locs, data = [], []
        for b, n in enumerate(cached):
            total = n + window
            own = [pages.pop() for _ in range(-(-total // PAGE_SIZE))]
            slots = torch.tensor([own[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(total)])
            runner.req_to_token_pool.req_to_token[self.req_rows[b], :total] = slots.to(torch.int32)
            rows = torch.randn((total, HEAD), generator=gen).to(self.dtype)
            self.slots.append(slots)
            self.rows.append(rows)
            locs.append(slots[:n])
            data.append(rows[:n])
        pool.set_kv_buffer(self.layer, torch.cat(locs).long(), scaled_for_store(torch.cat(data), self.layer).unsqueeze(1),
                           None)
        self.gen = gen

    def keys(self, b: int, n: int) -> torch.Tensor:
        """fp32 values of request b's first n rows as a correct decode reads them from the pool."""
        return stored_values(self.rows[b][:n], self.layer, self.cache_dtype)

    def new_tokens(self, count: int):
        """(out_cache_loc, k [T, 1, 576], v [T, 1, 512]) of each request's next `count` positions after cached."""
        locs = torch.cat([s[n:n + count] for s, n in zip(self.slots, self.cached)]).long()
        k = torch.cat([r[n:n + count] for r, n in zip(self.rows, self.cached)]).unsqueeze(1)
        return locs, k, k[..., :LATENT]

    def queries(self, s_q: int) -> torch.Tensor:
        return torch.randn((len(self.cached) * s_q, HEADS * HEAD), generator=self.gen).to(self.dtype)

    def forward_batch(self, mode, seq_lens: list[int], out_cache_loc, positions) -> ForwardBatch:
        bs = len(seq_lens)
        return ForwardBatch(
            forward_mode=mode, batch_size=bs, input_ids=torch.zeros(out_cache_loc.shape[0], dtype=torch.int64),
            req_pool_indices=self.req_rows.to(torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32), out_cache_loc=out_cache_loc,
            seq_lens_sum=sum(seq_lens), positions=torch.tensor(positions, dtype=torch.int64))

    def expected(self, q: torch.Tensor, s_q: int, kv_lens: list[int], scale: float) -> torch.Tensor:
        """Dense attention over each request's first kv_len rows, causal inside the s_q-token window."""
        outs = []
        qf = q.float().view(len(kv_lens), s_q, HEADS, HEAD)
        for b, n in enumerate(kv_lens):
            keys = self.keys(b, n)
            scores = torch.einsum("shd,nd->shn", qf[b], keys) * scale
            visible = torch.arange(n)[None, :] <= (n - s_q + torch.arange(s_q))[:, None]  # [s, n]
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            outs.append(torch.einsum("shn,nd->shd", scores.softmax(-1), keys[:, :LATENT]))
        return torch.stack(outs).reshape(len(kv_lens) * s_q, HEADS * LATENT).to(q.dtype)


def restore_server_args(runner) -> None:
    override = getattr(runner, "_server_args_override", None)
    if override is not None and hasattr(override, "restore"):
        override.restore()


@pytest.fixture
def runners():
    made = []

    def make(*args, **kwargs):
        r = make_runner(*args, **kwargs)
        made.append(r)
        return r

    yield make
    for r in reversed(made):
        restore_server_args(r)


# ---- registration -------------------------------------------------------------------------------------

def test_installed_sglang_is_supported():
    assert _compat.unsupported_reason(sglang.__version__) is None, sglang.__version__


def test_registered_in_attention_registry_and_cli_choices():
    assert attention_registry.ATTENTION_BACKENDS[BACKEND_NAME] is create_backend
    assert BACKEND_NAME in sgl_server_args.ATTENTION_BACKEND_CHOICES
    assert sgl_server_args.ATTENTION_BACKEND_CHOICES.count(BACKEND_NAME) == 1
    register()  # idempotent
    assert sgl_server_args.ATTENTION_BACKEND_CHOICES.count(BACKEND_NAME) == 1
    assert "flashmla" in attention_registry.ATTENTION_BACKENDS  # SGLang's own FlashMLA is untouched


def test_cli_accepts_the_backend_name():
    import argparse

    parser = argparse.ArgumentParser()
    sgl_server_args.ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--attention-backend", BACKEND_NAME,
                              "--decode-attention-backend", BACKEND_NAME])
    assert args.attention_backend == BACKEND_NAME and args.decode_attention_backend == BACKEND_NAME
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "m", "--attention-backend", "flashmla_backend_typo"])


def test_no_name_collision_with_sglang_flashmla():
    assert BACKEND_NAME != "flashmla"
    assert flashmla_backend.__name__ == "flashmla_backend"
    assert hasattr(torch.ops.flashmla_backend, "mla_decode")


def test_entry_point_declared():
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    eps = pyproject["project"]["entry-points"]["sglang.srt.plugins"]
    assert eps["flashmla_backend"] == "flashmla_backend.sglang:register"


def test_sglang_plugin_loader_runs_register(monkeypatch, tmp_path):
    """SGLang's loader finds the entry point; calling it registers the backend. Where the package is not
    pip-installed, a dist-info declaring the same entry point stands in."""
    from importlib.metadata import entry_points

    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    if not any(ep.name == "flashmla_backend" for ep in entry_points(group=GENERAL_PLUGINS_GROUP)):
        info = tmp_path / "flashmla_backend_sglang_entry_point_test-0.0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flashmla_backend_sglang_entry_point_test\n"
                                       "Version: 0.0.0\n")
        (info / "entry_points.txt").write_text(
            f"[{GENERAL_PLUGINS_GROUP}]\nflashmla_backend = flashmla_backend.sglang:register\n")
        monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SGLANG_PLUGINS", "flashmla_backend")
    monkeypatch.delitem(attention_registry.ATTENTION_BACKENDS, BACKEND_NAME)
    plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert set(plugins) == {"flashmla_backend"}
    func = plugins["flashmla_backend"][0] if isinstance(plugins["flashmla_backend"], tuple) else plugins[
        "flashmla_backend"]
    func()
    assert attention_registry.ATTENTION_BACKENDS[BACKEND_NAME] is create_backend


@pytest.mark.parametrize("version", ["0.5.16", "0.5.24", "0.6.0", "", "garbage"])
def test_unsupported_versions_fail_with_the_supported_range(version, monkeypatch):
    reason = _compat.unsupported_reason(version)
    assert reason is not None and _compat.SUPPORTED_RANGE in reason and "0.5.17" in reason
    monkeypatch.setattr(_compat, "installed_sglang_version", lambda: version)
    try:
        register()
        factory = attention_registry.ATTENTION_BACKENDS[BACKEND_NAME]
        assert factory is not create_backend
        with pytest.raises(RuntimeError, match="supports SGLang"):
            factory(None)
        assert BACKEND_NAME in sgl_server_args.ATTENTION_BACKEND_CHOICES
    finally:
        monkeypatch.undo()
        register()
    assert attention_registry.ATTENTION_BACKENDS[BACKEND_NAME] is create_backend


@pytest.mark.parametrize("version", ["0.5.17", "0.5.18", "0.5.21", "0.5.21.post1", "0.5.20rc0", "0.5.22",
                                     "0.5.23", "0.5.23.post1"])
def test_supported_versions(version):
    assert _compat.unsupported_reason(version) is None


def test_version_gates():
    assert not _compat.draft_creators_return_stamp("0.5.17") and _compat.draft_creators_return_stamp("0.5.18")
    assert not _compat.writes_take_kv_write_loc("0.5.21") and _compat.writes_take_kv_write_loc("0.5.22")
    assert _compat.writes_take_kv_write_loc("0.5.23")


# ---- hooks --------------------------------------------------------------------------------------------

def page_view(**kw):
    fields = dict(attention_backend=None, decode_attention_backend=None, prefill_attention_backend=None,
                  speculative_draft_attention_backend=None, page_size=None, kv_cache_dtype="auto")
    fields.update(kw)
    return SimpleNamespace(**fields)


def test_hooks_are_applied_to_sglang():
    assert plugin_hooks.PAGE_SIZE_TARGET in HookRegistry._patched
    assert plugin_hooks.HANDLER_TARGET in HookRegistry._patched
    assert plugin_hooks.DRAFT_FACTORY_TARGET in HookRegistry._patched


@pytest.mark.parametrize("field", ["attention_backend", "decode_attention_backend", "prefill_attention_backend"])
@pytest.mark.parametrize("page_size", [None, 1, 16, 128])
def test_page_size_forced_to_64(field, page_size):
    """SGLang's page-size pass, called as server-argument resolution calls it."""
    declared = overrides._mla_backend_page_constraints(page_view(**{field: BACKEND_NAME, "page_size": page_size}))
    assert declared == {"page_size": 64}
    assert overrides._mla_backend_page_constraints(page_view(**{field: BACKEND_NAME, "page_size": 64})) in ({}, {
        "page_size": 64})


def test_page_size_of_other_backends_untouched():
    assert overrides._mla_backend_page_constraints(page_view(attention_backend="triton", page_size=16)) == {}
    assert overrides._mla_backend_page_constraints(page_view(attention_backend="flashmla", page_size=16)) == {
        "page_size": 64}


def test_page_size_through_sglangs_post_process_runner():
    """run_post_process_pass is what ServerArgs.__post_init__ calls at this pass's slot."""
    server_args = SimpleNamespace(**vars(page_view(attention_backend=BACKEND_NAME, page_size=1)))
    server_args._resolved_overrides = []
    from sglang.srt.arg_groups.overrides import run_post_process_pass

    try:
        run_post_process_pass(server_args, overrides._mla_backend_page_constraints)
    except Exception as e:  # validate_declarations may need a full ServerArgs in some releases
        pytest.skip(f"run_post_process_pass needs a full ServerArgs here: {e}")
    assert server_args._resolved_overrides[-1][1] == {"page_size": 64}


@pytest.mark.parametrize("field", ["attention_backend", "decode_attention_backend"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "auto", "bf16", "bfloat16"])
def test_served_kv_cache_dtypes_pass_server_args(field, kv_cache_dtype):
    """fp8_e4m3 (and the 16-bit spellings) pass SGLang's page-size pass with ours named; the page size still snaps."""
    declared = overrides._mla_backend_page_constraints(page_view(**{field: BACKEND_NAME, "page_size": 1,
                                                                    "kv_cache_dtype": kv_cache_dtype}))
    assert declared == {"page_size": 64}


def test_every_sglang_choice_engine_support_names_passes_the_hook():
    """The hook serves exactly engine_support's SGLang names among SGLang's own --kv-cache-dtype choices."""
    import argparse

    parser = argparse.ArgumentParser()
    sgl_server_args.ServerArgs.add_cli_args(parser)
    choices = next(a.choices for a in parser._actions if "--kv-cache-dtype" in a.option_strings)
    assert "fp8_e4m3" in choices and "fp8_e5m2" in choices
    for name in choices:
        view = page_view(attention_backend=BACKEND_NAME, kv_cache_dtype=name)
        if name in engine_support.accepted_names("sglang"):
            overrides._mla_backend_page_constraints(view)
        else:
            with pytest.raises(ValueError, match=name):
                overrides._mla_backend_page_constraints(view)


@pytest.mark.parametrize("field", ["attention_backend", "decode_attention_backend"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e5m2", "fp4_e2m1", "mxfp8", "nvfp4", "fp4_mx_block16"])
def test_other_kv_cache_formats_refused_at_server_args(field, kv_cache_dtype):
    with pytest.raises(ValueError) as info:
        overrides._mla_backend_page_constraints(page_view(**{field: BACKEND_NAME, "kv_cache_dtype": kv_cache_dtype}))
    message = str(info.value)
    assert repr(kv_cache_dtype) in message and BACKEND_NAME in message
    assert "fp8_e4m3" in message and "auto" in message  # what works


def test_draft_kv_cache_dtype_checked_at_server_args():
    """SGLang 0.5.21+'s --speculative-draft-kv-cache-dtype, when the draft model runs on ours."""
    view = page_view(attention_backend=BACKEND_NAME, speculative_draft_kv_cache_dtype="fp8_e4m3")
    assert overrides._mla_backend_page_constraints(view) == {"page_size": 64}
    view.speculative_draft_kv_cache_dtype = "fp8_e5m2"
    with pytest.raises(ValueError, match="--speculative-draft-kv-cache-dtype fp8_e5m2") as info:
        overrides._mla_backend_page_constraints(view)
    assert "fp8_e4m3" in str(info.value)
    view.speculative_draft_attention_backend = "triton"  # the draft model is not on ours
    assert overrides._mla_backend_page_constraints(view) == {"page_size": 64}


def test_server_arg_hook_reads_engine_support(monkeypatch):
    """The hook's list is engine_support's: without fp8_e4m3 there, the hook refuses it."""
    names = dict(engine_support.KV_CACHE_DTYPES["sglang"])
    del names["fp8_e4m3"]
    monkeypatch.setitem(engine_support.KV_CACHE_DTYPES, "sglang", names)
    with pytest.raises(ValueError, match="fp8_e4m3"):
        overrides._mla_backend_page_constraints(page_view(attention_backend=BACKEND_NAME, kv_cache_dtype="fp8_e4m3"))


def test_deepseek_handler_chooses_as_triton():
    assert AttentionBackendRegistry.get_handler(BACKEND_NAME) is AttentionBackendRegistry.get_handler("triton")
    assert AttentionBackendRegistry.get_handler("flashmla") is not AttentionBackendRegistry.get_handler("triton")


def draft_factory(runner, steps: int = 3):
    params = inspect.signature(draft_utils.DraftBackendFactory.__init__).parameters
    kwargs = dict(draft_model_runner=runner, topk=1, speculative_num_steps=steps)
    if "server_args" in params:  # 0.5.17
        kwargs["server_args"] = SimpleNamespace(
            speculative_draft_attention_backend=None, attention_backend=BACKEND_NAME,
            decode_attention_backend=BACKEND_NAME, prefill_attention_backend=BACKEND_NAME)
    return draft_utils.DraftBackendFactory(**kwargs)


def test_draft_factory_builds_our_backends(runners):
    runner = runners()
    factory = draft_factory(runner, steps=3)
    decode = factory.create_decode_backend()
    assert isinstance(decode, FlashMLAPluginMultiStepDraftBackend)
    assert len(decode.attn_backends) == 2
    assert [b.decode_builder.step_offset for b in decode.attn_backends] == [1, 2]
    try:
        extend = factory.create_draft_extend_backend()
    except RuntimeError as e:  # runtime fields this mock runner does not publish
        pytest.skip(f"draft-extend factory needs more runtime state here: {e}")
    assert isinstance(extend, FlashMLAPluginBackend) and not extend.skip_prefill


# ---- metadata -----------------------------------------------------------------------------------------

def test_fill_block_table_matches_a_loop():
    gen = torch.Generator().manual_seed(0)
    req_to_token = torch.randint(0, 1 << 20, (6, 700), generator=gen, dtype=torch.int32)
    lens = torch.tensor([0, 1, 64, 65, 640, 700], dtype=torch.int32)
    rows = torch.tensor([5, 0, 3, 1, 2, 4], dtype=torch.int32)
    out = fill_block_table(req_to_token, rows, lens, torch.full((6, 12), -7, dtype=torch.int32))
    for b in range(6):
        for j in range(12):
            want = int(req_to_token[rows[b], 64 * j]) // 64 if 64 * j < int(lens[b]) else 0
            assert int(out[b, j]) == want, (b, j)


def test_key_lengths_per_mode():
    builder = DecodeMetadataBuilder(req_to_token=torch.zeros((2, 256), dtype=torch.int32), num_q_heads=16,
                                    num_draft_tokens=3)
    seq = torch.tensor([10, 70])
    assert builder.kv_lens("decode", seq).tolist() == [10, 70]
    assert builder.kv_lens("target_verify", seq).tolist() == [13, 73]
    assert builder.kv_lens("draft_extend", seq).tolist() == [10, 70]
    assert builder.query_len("decode") == 1 and builder.query_len("target_verify") == 3
    step = DecodeMetadataBuilder(req_to_token=torch.zeros((2, 256), dtype=torch.int32), num_q_heads=16,
                                 num_draft_tokens=3, step_offset=2)
    assert step.kv_lens("decode", seq).tolist() == [12, 72]
    no_spec = DecodeMetadataBuilder(req_to_token=torch.zeros((2, 256), dtype=torch.int32), num_q_heads=16,
                                    num_draft_tokens=0)
    with pytest.raises(RuntimeError, match="speculative"):
        no_spec.query_len("target_verify")


# ---- the backend on SGLang's pools ---------------------------------------------------------------------

def build_backend(runner) -> FlashMLAPluginBackend:
    backend = attention_registry.ATTENTION_BACKENDS[BACKEND_NAME](runner)
    assert isinstance(backend, FlashMLAPluginBackend) and isinstance(backend, TritonAttnBackend)
    return backend


def check_metadata(backend, req: Requests, kv_lens: list[int], s_q: int):
    md = backend.decode_metadata
    assert md.query_len == s_q and md.cache_seqlens.tolist() == kv_lens
    for b, n in enumerate(kv_lens):
        for j in range(-(-n // PAGE_SIZE)):
            assert int(md.block_table[b, j]) == int(req.slots[b][64 * j]) // 64
        assert not md.block_table[b, -(-n // PAGE_SIZE):].any()
    want_md, want_splits = flashmla_backend.get_mla_metadata(md.cache_seqlens, s_q * HEADS, 1)
    assert torch.equal(md.tile_scheduler_metadata, want_md) and torch.equal(md.num_splits, want_splits)


@pytest.mark.parametrize("cached,dtype", [([1, 63, 64, 300], torch.bfloat16), ([129, 1000, 2, 65], torch.bfloat16),
                                          ([5, 700, 64], torch.float16)])
def test_decode_matches_dense_attention(runners, cached, dtype):
    runner = runners(dtype=dtype)
    backend = build_backend(runner)
    req = Requests(runner, cached, window=1, seed=sum(cached))
    layer = make_layer()
    locs, k, v = req.new_tokens(1)
    seq_lens = [n + 1 for n in cached]  # decode: seq_len counts the token being decoded
    fb = req.forward_batch(ForwardMode.DECODE, seq_lens, locs, [n for n in cached])
    backend.init_forward_metadata(fb)
    check_metadata(backend, req, seq_lens, 1)
    q = req.queries(1)
    out = backend.forward(q, k, v, layer, fb, save_kv_cache=True)
    pool_rows = runner.token_to_kv_pool.kv_buffer[0][locs, 0]
    assert torch.equal(pool_rows, k[:, 0])  # the new token was written through the pool
    assert out.shape == (len(cached), HEADS * LATENT) and out.dtype == dtype
    assert torch.isfinite(out).all()  # NaN-poisoned rows (other pages, page 0) never read
    torch.testing.assert_close(out, req.expected(q, 1, seq_lens, layer.scaling), atol=OUT_ATOL, rtol=OUT_RTOL)


def test_decode_uses_the_layers_scale(runners):
    runner = runners()
    backend = build_backend(runner)
    req = Requests(runner, [40, 500], window=1, seed=3)
    layer = make_layer(scale=0.0917)
    locs, k, v = req.new_tokens(1)
    fb = req.forward_batch(ForwardMode.DECODE, [41, 501], locs, [40, 500])
    backend.init_forward_metadata(fb)
    q = req.queries(1)
    out = backend.forward(q, k, v, layer, fb)
    torch.testing.assert_close(out, req.expected(q, 1, [41, 501], 0.0917), atol=OUT_ATOL, rtol=OUT_RTOL)
    assert (out.float() - req.expected(q, 1, [41, 501], HEAD ** -0.5).float()).abs().max() > 0.05


@pytest.mark.parametrize("cached", [[3, 64, 250], [61, 1000]])
def test_target_verify_is_causal_over_the_drafts(runners, cached):
    W = 3
    runner = runners(mode=ForwardMode.TARGET_VERIFY, num_draft_tokens=W)
    backend = build_backend(runner)
    assert backend.num_draft_tokens == W
    req = Requests(runner, cached, window=W, seed=len(cached) + 11)
    layer = make_layer()
    locs, k, v = req.new_tokens(W)
    fb = req.forward_batch(ForwardMode.TARGET_VERIFY, cached, locs,  # seq_lens exclude the drafts
                           [n + i for n in cached for i in range(W)])
    backend.init_forward_metadata(fb)
    kv_lens = [n + W for n in cached]
    check_metadata(backend, req, kv_lens, W)
    q = req.queries(W)
    out = backend.forward(q, k, v, layer, fb, save_kv_cache=True)
    expected = req.expected(q, W, kv_lens, layer.scaling)
    torch.testing.assert_close(out, expected, atol=OUT_ATOL, rtol=OUT_RTOL)
    # Non-causal attention differs on the first draft row: the mask is applied.
    first = torch.arange(len(cached)) * W
    no_mask = []
    qf = q.float().view(len(cached), W, HEADS, HEAD)
    for b, n in enumerate(kv_lens):
        keys = req.rows[b][:n].float()
        p = (torch.einsum("hd,nd->hn", qf[b, 0], keys) * layer.scaling).softmax(-1)
        no_mask.append((p @ keys[:, :LATENT]).reshape(-1))
    no_mask = torch.stack(no_mask)
    assert (out[first].float() - no_mask).abs().max() > 0.05


def test_draft_extend_window_is_in_seq_lens(runners):
    W = 4
    cached = [10, 64, 333]
    runner = runners(mode=ForwardMode.TARGET_VERIFY, num_draft_tokens=W)
    backend = build_backend(runner)
    req = Requests(runner, cached, window=W, seed=21)
    layer = make_layer()
    locs, k, v = req.new_tokens(W)
    seq_lens = [n + W for n in cached]  # draft extend: the window is already counted
    fb = req.forward_batch(ForwardMode.DRAFT_EXTEND_V2, seq_lens, locs, [n + i for n in cached for i in range(W)])
    backend.init_forward_metadata(fb)
    check_metadata(backend, req, seq_lens, W)
    q = req.queries(W)
    out = backend.forward(q, k, v, layer, fb, save_kv_cache=True)
    torch.testing.assert_close(out, req.expected(q, W, seq_lens, layer.scaling), atol=OUT_ATOL, rtol=OUT_RTOL)


def test_multi_step_draft_decoder_reads_the_new_draft_tokens(runners):
    steps = 4
    cached = [20, 64, 200]
    runner = runners(mode=ForwardMode.TARGET_VERIFY, num_draft_tokens=steps)
    draft = FlashMLAPluginMultiStepDraftBackend(runner, topk=1, speculative_num_steps=steps)
    req = Requests(runner, cached, window=steps, seed=5)
    layer = make_layer()
    locs_all, k_all, _ = req.new_tokens(steps)
    fb = req.forward_batch(ForwardMode.DECODE, cached, locs_all[::steps], cached)  # seq_lens: verified prefix
    draft.init_forward_metadata(fb)
    for i, backend in enumerate(draft.attn_backends):
        # Step i writes the draft token at position n + i and reads n + i + 1 keys.
        locs = torch.stack([req.slots[b][n + i] for b, n in enumerate(cached)]).long()
        k = torch.stack([req.rows[b][n + i] for b, n in enumerate(cached)]).unsqueeze(1)
        fb.out_cache_loc = locs
        kv_lens = [n + i + 1 for n in cached]
        assert backend.decode_metadata.cache_seqlens.tolist() == kv_lens
        q = req.queries(1)
        out = backend.forward(q, k, k[..., :LATENT], layer, fb, save_kv_cache=True)
        torch.testing.assert_close(out, req.expected(q, 1, kv_lens, layer.scaling), atol=OUT_ATOL, rtol=OUT_RTOL)


def test_cuda_graph_buffers_are_persistent_and_refreshed(runners):
    """Captured kernels hold the metadata addresses of capture time: each out_graph call must write the
    step's values into the same buffers."""
    runner = runners()
    backend = build_backend(runner)
    backend.init_cuda_graph_state(max_bs=POOL_REQS, max_num_tokens=POOL_REQS)
    layer = make_layer()
    first = Requests(runner, [5, 300, 64, 1], window=1, seed=31)
    locs1, k1, v1 = first.new_tokens(1)
    fb1 = first.forward_batch(ForwardMode.DECODE, [6, 301, 65, 2], locs1, [5, 300, 64, 1])
    backend.init_forward_metadata_out_graph(fb1, in_capture=True)
    captured = backend.decode_metadata
    cg = backend.decode_builder
    assert captured.block_table.data_ptr() == cg.cg_block_table.data_ptr()
    assert captured.tile_scheduler_metadata.data_ptr() == cg.plan.cg_tile_scheduler_metadata.data_ptr()
    assert captured.num_splits.data_ptr() == cg.plan.cg_num_splits.data_ptr()
    assert captured.cache_seqlens.data_ptr() == cg.cg_cache_seqlens.data_ptr()
    backend.init_forward_metadata_in_graph(fb1)
    q1 = first.queries(1)
    out1 = backend.forward(q1, k1, v1, layer, fb1)
    torch.testing.assert_close(out1, first.expected(q1, 1, [6, 301, 65, 2], layer.scaling), atol=OUT_ATOL,
                               rtol=OUT_RTOL)
    tile_before = captured.tile_scheduler_metadata.clone()

    second = Requests(runner, [900, 2, 129, 64], window=1, seed=32)  # same shape, new pages and lengths
    locs2, k2, v2 = second.new_tokens(1)
    fb2 = second.forward_batch(ForwardMode.DECODE, [901, 3, 130, 65], locs2, [900, 2, 129, 64])
    backend.init_forward_metadata_out_graph(fb2)  # a replay's preparation
    assert backend.decode_metadata.block_table.data_ptr() == captured.block_table.data_ptr()
    backend.decode_metadata = captured  # the graph replays with the capture-time tensors
    check_metadata(backend, second, [901, 3, 130, 65], 1)
    assert not torch.equal(tile_before, captured.tile_scheduler_metadata)
    q2 = second.queries(1)
    out2 = backend.forward(q2, k2, v2, layer, fb2)
    torch.testing.assert_close(out2, second.expected(q2, 1, [901, 3, 130, 65], layer.scaling), atol=OUT_ATOL,
                               rtol=OUT_RTOL)
    assert backend.get_cuda_graph_seq_len_fill_value() == 1


def test_padded_graph_request_reads_padding_page(runners):
    """CUDA-graph padding rows: seq_len fill value 1 and req_pool_indices 0 (req_to_token row 0)."""
    runner = runners()
    backend = build_backend(runner)
    backend.init_cuda_graph_state(max_bs=POOL_REQS, max_num_tokens=POOL_REQS)
    req = Requests(runner, [50, 70], window=1, seed=41)
    locs, _, _ = req.new_tokens(1)
    fb = req.forward_batch(ForwardMode.DECODE, [51, 71], locs, [50, 70])
    fb.batch_size = 3
    fb.req_pool_indices = torch.cat([fb.req_pool_indices, torch.zeros(1, dtype=torch.int32)])
    fb.seq_lens = torch.tensor([51, 71, 1], dtype=torch.int32)
    backend.init_forward_metadata_out_graph(fb)
    md = backend.decode_metadata
    assert md.batch_size == 3 and md.cache_seqlens.tolist() == [51, 71, 1]
    assert md.num_splits.shape == (4,)


def test_extend_batches_go_to_the_triton_parent(runners, monkeypatch):
    calls = []
    monkeypatch.setattr(TritonAttnBackend, "init_forward_metadata", lambda self, fb: calls.append("meta"))
    monkeypatch.setattr(TritonAttnBackend, "forward_extend", lambda self, *a, **k: calls.append("extend") or "parent")
    runner = runners()
    backend = build_backend(runner)
    fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=1)
    backend.init_forward_metadata(fb)
    assert backend.decode_metadata is None
    assert backend.forward_extend(None, None, None, make_layer(), fb) == "parent"
    assert calls == ["meta", "extend"]


@pytest.mark.parametrize("value,draft_worker,broken", [("1", False, True), ("1", True, True),
                                                      ("draft", False, False), ("draft", True, True)])
def test_debug_break_scale_hook(runners, monkeypatch, value, draft_worker, broken):
    """The test hook multiplies the softmax scale by 1.5 (value "draft": only in the draft model's backends),
    enough to fail the comparisons that use it."""
    monkeypatch.setenv(DEBUG_BREAK_SCALE_ENV, value)
    runner = runners()
    runner.is_draft_worker = draft_worker
    backend = build_backend(runner)
    req = Requests(runner, [100, 400], window=1, seed=7)
    layer = make_layer()
    locs, k, v = req.new_tokens(1)
    fb = req.forward_batch(ForwardMode.DECODE, [101, 401], locs, [100, 400])
    backend.init_forward_metadata(fb)
    q = req.queries(1)
    out = backend.forward(q, k, v, layer, fb)
    if broken:
        assert (out.float() - req.expected(q, 1, [101, 401], layer.scaling).float()).abs().max() > 0.05
    torch.testing.assert_close(out, req.expected(q, 1, [101, 401], (1.5 if broken else 1.0) * layer.scaling),
                               atol=OUT_ATOL, rtol=OUT_RTOL)


def test_forward_without_metadata_fails_clearly(runners):
    runner = runners()
    backend = build_backend(runner)
    req = Requests(runner, [10], window=1, seed=1)
    locs, k, v = req.new_tokens(1)
    fb = req.forward_batch(ForwardMode.DECODE, [11], locs, [10])
    with pytest.raises(RuntimeError, match="metadata"):
        backend.forward(req.queries(1), k, v, make_layer(), fb)


# ---- interfaces that differ between releases ----------------------------------------------------------

def test_kv_writes_use_this_releases_write_loc(runners, monkeypatch):
    """0.5.22+: the pool's write door gets KVWriteLoc.for_batch(forward_batch); before, out_cache_loc."""
    runner = runners()
    backend = build_backend(runner)
    req = Requests(runner, [30, 64], window=1, seed=13)
    locs, k, v = req.new_tokens(1)
    fb = req.forward_batch(ForwardMode.DECODE, [31, 65], locs, [30, 64])
    pool = runner.token_to_kv_pool
    seen = []
    original = type(pool).set_kv_buffer
    monkeypatch.setattr(pool, "set_kv_buffer",
                        lambda layer, loc, *a, **kw: seen.append(loc) or original(pool, layer, loc, *a, **kw))
    backend.init_forward_metadata(fb)
    backend.forward(req.queries(1), k, v, make_layer(), fb, save_kv_cache=True)
    assert len(seen) == 1
    if _compat.writes_take_kv_write_loc(sglang.__version__):
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        assert isinstance(seen[0], KVWriteLoc) and seen[0].loc is locs
        assert seen[0].physical == fb.out_cache_loc_is_physical
    else:
        assert seen[0] is locs
    assert torch.equal(pool.kv_buffer[0][locs, 0], k[:, 0])


def test_pool_requiring_physical_write_locs_takes_our_writes(runners):
    """0.5.22+: pools with requires_physical_write_loc refuse a bare location; the plugin's write carries the
    batch's physical mark, as SGLang's own backends' writes do."""
    if not _compat.writes_take_kv_write_loc(sglang.__version__):
        pytest.skip(f"SGLang {sglang.__version__} has no physical write-location check")
    runner = runners()
    backend = build_backend(runner)
    req = Requests(runner, [12, 100], window=1, seed=17)
    locs, k, v = req.new_tokens(1)
    fb = req.forward_batch(ForwardMode.DECODE, [13, 101], locs, [12, 100])
    fb.out_cache_loc_is_physical = True  # as a batch bound to a KV location plan
    pool = runner.token_to_kv_pool
    pool.requires_physical_write_loc = True
    layer = make_layer()
    with pytest.raises(ValueError, match="physical"):  # SGLang's own check, on a bare location
        pool.set_kv_buffer(layer, locs, k, v)
    backend.init_forward_metadata(fb)
    q = req.queries(1)
    out = backend.forward(q, k, v, layer, fb, save_kv_cache=True)
    assert torch.equal(pool.kv_buffer[0][locs, 0], k[:, 0])
    torch.testing.assert_close(out, req.expected(q, 1, [13, 101], layer.scaling), atol=OUT_ATOL, rtol=OUT_RTOL)


def test_metadata_glue_graph_reinstalls_our_metadata(runners):
    """SGLang's metadata glue graph runs init_forward_metadata_out_graph once per replay key under capture,
    keeps each backend's forward_metadata, and on later replays reinstalls it and replays only the device
    ops. Driven through SGLang's MetadataGlueGraph with a stand-in for the captured graph whose replay does
    what the captured ops do: rewrite the persistent buffers with that key's values."""
    glue_mod = pytest.importorskip("sglang.srt.model_executor.runner.metadata_glue_graph",
                                   reason="this SGLang has no metadata glue graph")
    runner = runners()
    backend = build_backend(runner)
    backend.init_cuda_graph_state(max_bs=POOL_REQS, max_num_tokens=POOL_REQS)
    cg = backend.decode_builder
    buffers = (cg.cg_cache_seqlens, cg.cg_block_table, cg.plan.cg_tile_scheduler_metadata, cg.plan.cg_num_splits)

    class CapturedPrep:  # what torch.cuda.CUDAGraph.replay does for the captured prep
        def __init__(self):
            self.values = [b.clone() for b in buffers]

        def replay(self):
            for b, val in zip(buffers, self.values):
                b.copy_(val)

    glue = glue_mod.MetadataGlueGraph("cpu")
    first = Requests(runner, [5, 300, 64, 1], window=1, seed=51)
    locs1, k1, v1 = first.new_tokens(1)
    fb1 = first.forward_batch(ForwardMode.DECODE, [6, 301, 65, 2], locs1, [5, 300, 64, 1])
    backend.init_forward_metadata_out_graph(fb1)
    glue._states["bs4"] = {"warmups": glue.NUM_WARMUP, "graph": CapturedPrep(),
                           "meta": [(backend, backend.forward_metadata)]}
    assert backend.forward_metadata is backend.decode_metadata

    other = Requests(runner, [700, 9], window=1, seed=52)  # another key: smaller batch, other pages
    locs2, _, _ = other.new_tokens(1)
    backend.init_forward_metadata_out_graph(other.forward_batch(ForwardMode.DECODE, [701, 10], locs2, [700, 9]))
    assert backend.decode_metadata.batch_size == 2

    first = Requests(runner, [5, 300, 64, 1], window=1, seed=51)  # the pool again as the first key left it
    glue.run(backend, None, "bs4")  # a replay of the first key: reinstall, then the captured ops
    md = backend.decode_metadata
    assert md.batch_size == 4 and md.cache_seqlens.tolist() == [6, 301, 65, 2]
    q = first.queries(1)
    out = backend.forward(q, k1, v1, make_layer(), fb1)
    torch.testing.assert_close(out, first.expected(q, 1, [6, 301, 65, 2], make_layer().scaling), atol=OUT_ATOL,
                               rtol=OUT_RTOL)


# ---- refusals -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,message", [
    (dict(page_size=16), "page-size 64"),
    (dict(kv_lora_rank=256), "kv_lora_rank 512"),
    (dict(dtype=torch.float8_e5m2), "float8_e5m2"),
    (dict(dtype=torch.float16), "model dtype"),  # a 16-bit cache in another dtype than the bf16 model
    (dict(use_mla_backend=False), "only MLA"),
])
def test_refusals_name_the_problem(runners, change, message):
    kw = {}
    if "page_size" in change:
        kw["page_size"] = change["page_size"]
    if "kv_lora_rank" in change:
        kw["kv_lora_rank"] = change["kv_lora_rank"]
    runner = runners(**kw)
    if "dtype" in change:
        runner.kv_cache_dtype = change["dtype"]
    if "use_mla_backend" in change:
        runner.use_mla_backend = False
    with pytest.raises(ValueError, match=message):
        FlashMLAPluginBackend(runner)


def test_topk_above_one_refused(runners):
    runner = runners()
    with pytest.raises(ValueError, match="topk 1"):
        FlashMLAPluginMultiStepDraftBackend(runner, topk=2, speculative_num_steps=3)



# ---- FP8 (e4m3) KV cache -------------------------------------------------------------------------------

@pytest.fixture
def plugin_log():
    """Records of the plugin's logger (SGLang may stop propagation to the root logger, which caplog reads)."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.DEBUG)
    log = logging.getLogger("sglang.flashmla_backend")
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    yield records
    log.removeHandler(handler)
    log.setLevel(old_level)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Each flash_mla_with_kvcache call of the backend: its q, k_cache and descales (then the real call)."""
    calls = []
    real = flashmla_backend.flash_mla_with_kvcache

    def spy(q, k_cache, *args, **kwargs):
        calls.append(SimpleNamespace(q=q, k_cache=k_cache, descale_q=kwargs.get("descale_q"),
                                     descale_k=kwargs.get("descale_k")))
        return real(q, k_cache, *args, **kwargs)

    monkeypatch.setattr(flashmla_backend, "flash_mla_with_kvcache", spy)
    return calls


def messages(records, text: str) -> list[str]:
    return [r.getMessage() for r in records if text in r.getMessage()]


def test_fp8_runner_accepted_by_check_model_runner(runners):
    for dtype in (torch.bfloat16, torch.float16):
        runner = runners(dtype=dtype, fp8=True)
        assert plugin_backend.check_model_runner(runner, skip_prefill=False) == []
        backend = build_backend(runner)
        assert backend.kv_cache_fp8
        assert backend.unit_descale_k.dtype == torch.float32 and backend.unit_descale_k.tolist() == [1.0]


@pytest.mark.parametrize("kv_dtype,server_arg,message", [
    (torch.float8_e5m2, "fp8_e5m2", "float8_e5m2"),
    (FP8, "mxfp8", "'mxfp8'"),  # SGLang resolves mxfp8 to float8_e4m3fn too: told apart by the server argument
])
def test_fp8_formats_other_than_e4m3_refused_by_check_model_runner(runners, monkeypatch, kv_dtype, server_arg,
                                                                   message):
    runner = runners(fp8=True)
    runner.kv_cache_dtype = kv_dtype
    runner.kv_cache_dtype_str = server_arg  # the runner's resolved format name, as SGLang's ModelRunner sets it
    reasons = plugin_backend.check_model_runner(runner, skip_prefill=False)
    assert len(reasons) == 1 and message in reasons[0] and "fp8_e4m3" in reasons[0]
    with pytest.raises(ValueError, match=message):
        build_backend(runner)


def test_check_model_runner_reads_engine_support(runners, monkeypatch):
    runner = runners(fp8=True)
    monkeypatch.setattr(engine_support, "cache_dtype_problem", lambda kv, model: f"refused {kv} with {model}")
    assert plugin_backend.check_model_runner(runner, skip_prefill=False) == [
        f"refused {FP8} with {torch.bfloat16}"]


def fp8_decode(runners, cached, layer, dtype=torch.bfloat16, seed=0):
    runner = runners(dtype=dtype, fp8=True)
    backend = build_backend(runner)
    req = Requests(runner, cached, window=1, seed=seed, layer=layer)
    locs, k, v = req.new_tokens(1)
    seq_lens = [n + 1 for n in cached]
    fb = req.forward_batch(ForwardMode.DECODE, seq_lens, locs, list(cached))
    backend.init_forward_metadata(fb)
    return runner, backend, req, locs, k, v, fb, seq_lens


@pytest.mark.parametrize("checkpoint_scale", [None, "no checkpoint scale", 0.05, 3.0])
@pytest.mark.parametrize("cached,dtype", [([1, 63, 64, 300], torch.bfloat16), ([129, 1000, 2], torch.float16)])
def test_fp8_decode_reads_the_pool_in_place(runners, kernel_calls, cached, dtype, checkpoint_scale):
    """Decode on SGLang's FP8 MLATokenToKVPool: the kernel gets the pool's own bytes (no copy) with descale_k =
    the layer's k_scale (or the backend's ones tensor), the new token is stored as (k / k_scale) in e4m3, and the
    output is attention over the dequantized cache."""
    if checkpoint_scale is None:
        layer = make_layer()  # --kv-cache-dtype fp8_e4m3 with a 16-bit checkpoint: no k_scale on the layer
    else:
        layer = layer_with_kv_scales(None if checkpoint_scale == "no checkpoint scale" else checkpoint_scale)
    runner, backend, req, locs, k, v, fb, seq_lens = fp8_decode(runners, cached, layer, dtype, seed=len(cached))
    pool = runner.token_to_kv_pool
    k_in = k.clone()
    q = req.queries(1)
    out = backend.forward(q, k, v, layer, fb, save_kv_cache=True)

    (call,) = kernel_calls
    assert call.k_cache.dtype == FP8 and call.k_cache.shape[1:] == (PAGE_SIZE, 1, HEAD)
    assert call.k_cache.data_ptr() == pool.kv_buffer[0].data_ptr()  # the pool's storage, not a converted copy
    assert call.q.dtype == dtype  # the accurate mode: 16-bit queries
    if layer.k_scale is None:
        assert call.descale_k is backend.unit_descale_k
    else:
        assert call.descale_k.shape == (1,) and call.descale_k.dtype == torch.float32
        assert call.descale_k.data_ptr() == layer.k_scale.data_ptr()  # a view: the kernel reads its current value

    want_bytes = scaled_for_store(k_in[:, 0], layer).to(FP8).view(torch.uint8)
    assert torch.equal(pool.kv_buffer[0][locs, 0], want_bytes)
    assert torch.equal(pool.get_key_buffer(0)[locs, 0].view(torch.uint8), want_bytes)
    assert out.dtype == dtype and torch.isfinite(out).all()
    expected = req.expected(q, 1, seq_lens, layer.scaling)
    torch.testing.assert_close(out, expected, atol=OUT_ATOL, rtol=OUT_RTOL)
    if layer.k_scale is not None and layer.k_scale_float != 1.0:
        # The scale matters: attention over the stored values without it is far off.
        unscaled = []
        qf = q.float().view(len(cached), HEADS, HEAD)
        for b, n in enumerate(seq_lens):
            keys = scaled_for_store(req.rows[b][:n], layer).to(FP8).float()
            p = (torch.einsum("hd,nd->hn", qf[b], keys) * layer.scaling).softmax(-1)
            unscaled.append((p @ keys[:, :LATENT]).reshape(-1))
        assert (out.float() - torch.stack(unscaled)).abs().max() > 0.05


def test_fp8_decode_divides_k_in_place_as_sglangs_triton_backend(runners):
    """Decode scales the step's k in place before the pool's write (k is not read afterwards), as Triton does."""
    layer = layer_with_kv_scales(0.25)
    _, backend, req, _, k, v, fb, _ = fp8_decode(runners, [10, 70], layer, seed=9)
    k_in = k.clone()
    backend.forward(req.queries(1), k, v, layer, fb, save_kv_cache=True)
    assert torch.equal(k, k_in.clone().div_(layer.k_scale))


@pytest.mark.parametrize("checkpoint_scale", [None, 0.05])
def test_fp8_target_verify_and_draft_extend(runners, kernel_calls, checkpoint_scale):
    """MTP / EAGLE verification (drafts after seq_len) and draft extend (window inside seq_len) on the FP8 pool:
    new rows stored as (k / k_scale) in e4m3 from a copy (the caller's k unchanged), causal over the window."""
    W = 3
    cached = [3, 64, 250]
    for mode, seq_lens, kv_lens in [(ForwardMode.TARGET_VERIFY, cached, [n + W for n in cached]),
                                    (ForwardMode.DRAFT_EXTEND_V2, [n + W for n in cached], [n + W for n in cached])]:
        runner = runners(mode=ForwardMode.TARGET_VERIFY, num_draft_tokens=W, fp8=True)
        backend = build_backend(runner)
        layer = make_layer() if checkpoint_scale is None else layer_with_kv_scales(checkpoint_scale)
        req = Requests(runner, cached, window=W, seed=W + len(kernel_calls), layer=layer)
        locs, k, v = req.new_tokens(W)
        k_in = k.clone()
        fb = req.forward_batch(mode, seq_lens, locs, [n + i for n in cached for i in range(W)])
        backend.init_forward_metadata(fb)
        check_metadata(backend, req, kv_lens, W)
        q = req.queries(W)
        out = backend.forward(q, k, v, layer, fb, save_kv_cache=True)
        assert torch.equal(k, k_in)  # divided on a copy, as SGLang's Triton forward_extend does
        pool = runner.token_to_kv_pool
        assert torch.equal(pool.kv_buffer[0][locs, 0], scaled_for_store(k_in[:, 0], layer).to(FP8).view(torch.uint8))
        call = kernel_calls[-1]
        assert call.k_cache.data_ptr() == pool.kv_buffer[0].data_ptr() and call.k_cache.dtype == FP8
        torch.testing.assert_close(out, req.expected(q, W, kv_lens, layer.scaling), atol=OUT_ATOL, rtol=OUT_RTOL)


def test_fp8_multi_step_draft_decoder(runners):
    steps = 3
    cached = [20, 64, 200]
    runner = runners(mode=ForwardMode.TARGET_VERIFY, num_draft_tokens=steps, fp8=True)
    draft = FlashMLAPluginMultiStepDraftBackend(runner, topk=1, speculative_num_steps=steps)
    layer = layer_with_kv_scales(0.5)
    req = Requests(runner, cached, window=steps, seed=8, layer=layer)
    locs_all, _, _ = req.new_tokens(steps)
    fb = req.forward_batch(ForwardMode.DECODE, cached, locs_all[::steps], cached)
    draft.init_forward_metadata(fb)
    for i, backend in enumerate(draft.attn_backends):
        assert backend.kv_cache_fp8
        fb.out_cache_loc = torch.stack([req.slots[b][n + i] for b, n in enumerate(cached)]).long()
        k = torch.stack([req.rows[b][n + i] for b, n in enumerate(cached)]).unsqueeze(1)
        q = req.queries(1)
        out = backend.forward(q, k, k[..., :LATENT], layer, fb, save_kv_cache=True)
        kv_lens = [n + i + 1 for n in cached]
        torch.testing.assert_close(out, req.expected(q, 1, kv_lens, layer.scaling), atol=OUT_ATOL, rtol=OUT_RTOL)


def test_fp8_cuda_graph_replays_read_fixed_descale_tensors(runners, kernel_calls):
    """Graph batches hand the kernel the same descale tensors every step: the backend's ones tensor (made once)
    or the layer's k_scale itself, whose value the kernel reads at each replay."""
    runner = runners(fp8=True)
    backend = build_backend(runner)
    backend.init_cuda_graph_state(max_bs=POOL_REQS, max_num_tokens=POOL_REQS)
    unit = backend.unit_descale_k
    scaled = layer_with_kv_scales(0.5)
    for seed, layer in [(61, make_layer()), (62, make_layer()), (63, scaled), (64, scaled)]:
        req = Requests(runner, [5, 300, 64, 1], window=1, seed=seed, layer=layer)
        locs, k, v = req.new_tokens(1)
        fb = req.forward_batch(ForwardMode.DECODE, [6, 301, 65, 2], locs, [5, 300, 64, 1])
        backend.init_forward_metadata_out_graph(fb, in_capture=seed == 61)
        q = req.queries(1)
        out = backend.forward(q, k, v, layer, fb)
        torch.testing.assert_close(out, req.expected(q, 1, [6, 301, 65, 2], layer.scaling), atol=OUT_ATOL,
                                   rtol=OUT_RTOL)
    assert [c.descale_k is unit for c in kernel_calls] == [True, True, False, False]
    assert {c.descale_k.data_ptr() for c in kernel_calls[2:]} == {scaled.k_scale.data_ptr()}
    assert backend.unit_descale_k is unit and unit.tolist() == [1.0]


@pytest.fixture
def fresh_process_notes(monkeypatch):
    """The once-per-process notes of the backend module, as in a new process."""
    monkeypatch.setattr(plugin_backend, "_default_scale_noted", False)


DEFAULT_SCALE_TEXT = "FP8 KV cache with the default scale 1.0"


@pytest.mark.parametrize("layer_kind", ["no k_scale", "no checkpoint scale"])
def test_fp8_default_scale_logged_once_at_the_first_forward(runners, plugin_log, fresh_process_notes, layer_kind):
    assert DEFAULT_SCALE_TEXT in engine_support.default_scale_message("sglang")
    layer = make_layer() if layer_kind == "no k_scale" else layer_with_kv_scales(None)
    runner, backend, req, locs, k, v, fb, _ = fp8_decode(runners, [40, 100], layer, seed=2)
    assert messages(plugin_log, DEFAULT_SCALE_TEXT) == []  # not at construction: at the first forward
    backend.forward(req.queries(1), k, v, layer, fb)
    assert messages(plugin_log, DEFAULT_SCALE_TEXT) == [engine_support.default_scale_message("sglang")]
    backend.forward(req.queries(1), k, v, layer, fb)
    other = build_backend(runner)  # e.g. the draft model's backend in the same process
    other.init_forward_metadata(fb)
    other.forward(req.queries(1), k, v, layer, fb)
    assert len(messages(plugin_log, DEFAULT_SCALE_TEXT)) == 1


def test_fp8_default_scale_logged_at_a_first_prefill_too(runners, plugin_log, fresh_process_notes, monkeypatch):
    """Without CUDA graphs SGLang's first forward is a prefill, which the Triton parent runs."""
    monkeypatch.setattr(TritonAttnBackend, "forward_extend", lambda self, *a, **k: "parent")
    backend = build_backend(runners(fp8=True))
    assert backend.forward_extend(None, None, None, make_layer(), SimpleNamespace(forward_mode=ForwardMode.EXTEND,
                                                                                   batch_size=1)) == "parent"
    assert len(messages(plugin_log, DEFAULT_SCALE_TEXT)) == 1


def test_fp8_checkpoint_scale_is_not_the_default(runners, plugin_log, fresh_process_notes):
    layer = layer_with_kv_scales(0.05)
    _, backend, req, _, k, v, fb, _ = fp8_decode(runners, [40, 100], layer, seed=4)
    backend.forward(req.queries(1), k, v, layer, fb)
    assert messages(plugin_log, DEFAULT_SCALE_TEXT) == []


def test_default_scale_not_logged_for_16_bit_caches(runners, plugin_log, fresh_process_notes):
    runner = runners()
    backend = build_backend(runner)
    req = Requests(runner, [40, 100], window=1, seed=5)
    locs, k, v = req.new_tokens(1)
    fb = req.forward_batch(ForwardMode.DECODE, [41, 101], locs, [40, 100])
    backend.init_forward_metadata(fb)
    backend.forward(req.queries(1), k, v, make_layer(), fb)
    assert messages(plugin_log, DEFAULT_SCALE_TEXT) == [] and not backend.kv_cache_fp8
    assert backend.unit_descale_k is None


def test_fp8_mode_unset_is_the_accurate_mode(runners, monkeypatch, kernel_calls):
    """SGLang's default (engine_support.DEFAULT_FP8_MODES): 16-bit queries, no descale_q."""
    monkeypatch.delenv(engine_support.FP8_MODE_ENV, raising=False)
    layer = make_layer()
    _, backend, req, _, k, v, fb, seq_lens = fp8_decode(runners, [30, 90], layer, seed=6)
    assert backend.fp8_mode == engine_support.DEFAULT_FP8_MODES["sglang"] == "accurate"
    q = req.queries(1)
    out = backend.forward(q, k, v, layer, fb)
    assert kernel_calls[-1].q.dtype == torch.bfloat16 and kernel_calls[-1].descale_q is None
    torch.testing.assert_close(out, req.expected(q, 1, seq_lens, layer.scaling), atol=OUT_ATOL, rtol=OUT_RTOL)
    assert build_backend(runners()).fp8_mode is None  # a 16-bit cache has no query mode


@pytest.mark.parametrize("checkpoint_scale", [None, 0.05, 3.0])
def test_fp8_fast_mode_quantizes_q_with_the_k_scale(runners, monkeypatch, kernel_calls, checkpoint_scale):
    """FLASHMLA_BACKEND_FP8_MODE=fast: the kernel gets q / k_scale in e4m3, saturated at 448 (SGLang's FlashMLA
    backend quantizes q so with an FP8 cache), with descale_q = the k scale descale_k is (the layer's k_scale
    view, or the backend's ones tensor); the output is attention with that query over the dequantized cache."""
    monkeypatch.setenv(engine_support.FP8_MODE_ENV, "fast")
    layer = make_layer() if checkpoint_scale is None else layer_with_kv_scales(checkpoint_scale)
    _, backend, req, _, k, v, fb, seq_lens = fp8_decode(runners, [1, 63, 300], layer, seed=4)
    assert backend.fp8_mode == "fast"
    q = req.queries(1)
    q.view(-1)[:5] = 1e4  # past e4m3's range at every scale here: saturated, not NaN
    out = backend.forward(q, k, v, layer, fb)
    (call,) = kernel_calls
    assert call.descale_q is call.descale_k
    scale = call.descale_k
    want = (q.float().reshape(call.q.shape) / scale).clamp(-448.0, 448.0).to(FP8)
    assert call.q.dtype == FP8 and torch.equal(call.q.view(torch.uint8), want.view(torch.uint8))
    assert torch.isfinite(out).all()
    q_deq = (want.float() * scale).reshape(q.shape)
    expected = req.expected(q_deq, 1, seq_lens, layer.scaling)
    torch.testing.assert_close(out.float(), expected, atol=OUT_ATOL, rtol=OUT_RTOL)
    # The query's rounding matters: the 16-bit query's attention differs from it.
    assert (req.expected(q.float(), 1, seq_lens, layer.scaling) - expected).abs().max() > OUT_ATOL


def test_fp8_fast_mode_output_in_an_fp16_models_dtype(runners, monkeypatch, kernel_calls):
    """The kernel's output with an e4m3 q is bf16; an fp16 model gets it back in fp16, as the accurate mode's."""
    monkeypatch.setenv(engine_support.FP8_MODE_ENV, "fast")
    layer = make_layer()
    _, backend, req, _, k, v, fb, seq_lens = fp8_decode(runners, [129, 1000, 2], layer, dtype=torch.float16, seed=9)
    q = req.queries(1)
    assert q.dtype == torch.float16
    out = backend.forward(q, k, v, layer, fb)
    assert kernel_calls[-1].q.dtype == FP8 and out.dtype == torch.float16 and torch.isfinite(out).all()
    q_deq = kernel_calls[-1].q.float().reshape(q.shape) * kernel_calls[-1].descale_q
    torch.testing.assert_close(out.float(), req.expected(q_deq, 1, seq_lens, layer.scaling), atol=OUT_ATOL,
                               rtol=OUT_RTOL)


@pytest.mark.parametrize("fp8", [True, False])
def test_invalid_fp8_mode_fails_at_start_up(runners, monkeypatch, fp8):
    monkeypatch.setenv(engine_support.FP8_MODE_ENV, "turbo")
    with pytest.raises(ValueError, match=engine_support.FP8_MODE_ENV) as info:
        build_backend(runners(fp8=fp8))
    assert "accurate" in str(info.value) and "fast" in str(info.value)


@pytest.mark.parametrize("bad_scale", [torch.full((HEADS,), 0.5), torch.tensor(0.5, dtype=torch.float64)],
                         ids=["per-head", "float64"])
def test_fp8_k_scale_that_is_not_one_float32_value_refused(runners, bad_scale):
    layer = layer_with_kv_scales(0.5)
    _, backend, req, _, k, v, fb, _ = fp8_decode(runners, [10], layer, seed=1)
    layer.k_scale = torch.nn.Parameter(bad_scale, requires_grad=False)
    k_in = k.clone()
    with pytest.raises(ValueError, match="k_scale must be one float32 value"):
        backend.forward(req.queries(1), k, v, layer, fb, save_kv_cache=True)
    assert torch.equal(k, k_in)  # refused before the write


def test_16_bit_cache_with_a_checkpoint_kv_scale_refused(runners):
    """SGLang's Triton prefill stores k / k_scale whenever a layer has a k_scale; a 16-bit cache of such a layer
    would be read unscaled, so the plugin refuses it at the first forward and names what works."""
    runner = runners()
    backend = build_backend(runner)
    req = Requests(runner, [10], window=1, seed=1)
    locs, k, v = req.new_tokens(1)
    fb = req.forward_batch(ForwardMode.DECODE, [11], locs, [10])
    backend.init_forward_metadata(fb)
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e4m3"):
        backend.forward(req.queries(1), k, v, layer_with_kv_scales(0.05), fb)
    layer = layer_with_kv_scales(None)  # scale 1.0: stored values are k itself
    q = req.queries(1)
    out = backend.forward(q, k, v, layer, fb)
    torch.testing.assert_close(out, req.expected(q, 1, [11], layer.scaling), atol=OUT_ATOL, rtol=OUT_RTOL)
