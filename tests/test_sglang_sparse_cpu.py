"""flashmla_backend's sparse decode as the decode kernel of SGLang's DSA backend, against SGLang's real classes on CPU.

flashmla_backend.sglang.dsa hooks three methods of SGLang's DeepseekSparseAttnBackend (constructor, forward_decode,
_forward_flashmla_sparse) while FLASHMLA_BACKEND_DSA_DECODE is set. Real SGLang pieces here: the backend class, built
by its own constructor (hooked through SGLang's HookRegistry) from the attention kit's MockMLAModelRunner with a
DeepSeek-V3.2 model config and SGLang's DSATokenToKVPool (its per-layer buffers are the caches read), its
forward_decode, DSAMetadata, RadixAttention, SpeculativeAlgorithm, and the sources of the kernel call, the top-k
translation and the FP8 quantizer (what the hooks rely on is checked in them). Stand-ins: CUDA's device-capability
query (answers Hopper's (9, 0): the constructor's one CUDA call), instances with the constructor's attributes set
directly for the refusals adopt() makes (their names checked against its source), and SGLang's Triton kernels:
the top-k translation of forward_decode (transform_index_page_table_decode, replaced by a PyTorch function with
the semantics of its docstring: result[i, j] = page_table[i, topk[i, j]], -1 where topk is -1; with SGLang's fused
top-k the same function gives the indexer's output) and the FP8 KV writes (the caches are written here; SGLang
0.5.21's PyTorch quantizer, where present, writes the FP8 one). On CPU tensors flashmla_backend runs its
PyTorch reference, so outputs are compared with that reference called directly with the indices expected
(page * 64 + offset of each chosen position) and with dense attention over the chosen tokens computed here.

Run them with `bash tests/run.sh --engines` (SGLang in its own environment under .test-envs/).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import math
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("sglang") is None:  # `import sglang` itself needs test_sglang_cpu's stand-ins (0.5.17)
    pytest.skip("SGLang is not installed", allow_module_level=True)

import test_sglang_cpu as base  # noqa: E402  (imports SGLang as those tests do: the torchvision stand-in)
import torch  # noqa: E402

import flashmla_backend  # noqa: E402
from flashmla_backend import fp8_ds_mla  # noqa: E402
from flashmla_backend.geometry import HEAD_DIM_K, HEAD_DIM_V, PAGE_SIZE, ROPE_DIM  # noqa: E402
from flashmla_backend.sglang import dsa  # noqa: E402

from sglang.srt.layers.attention import dsa_backend  # noqa: E402
from sglang.srt.layers.attention.dsa_backend import DSAMetadata, DeepseekSparseAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402
from sglang_dsa_hooks import TARGETS, applied_dsa_hooks  # noqa: E402

SCALE = (128 + 64) ** -0.5
POOL_TOKENS = 6 * PAGE_SIZE   # SGLang adds one padding page: 7 pages in the buffer
TOPK = 96                     # the model's index_topk (DeepSeek-V3.2: 2048); a small one keeps the reference quick


@pytest.fixture(scope="module", autouse=True)
def single_rank():
    """One attention rank, no decode context parallelism."""
    ctx = get_parallel().override(attn_tp_size=1, attn_dcp_size=1, attn_dcp_rank=0)
    ctx.__enter__()
    yield
    ctx.__exit__(None, None, None)


@pytest.fixture
def dsa_hooks():
    """FLASHMLA_BACKEND_DSA_DECODE=1: the hooks registered and applied by SGLang's HookRegistry to the real class;
    the class's methods and the registry are restored afterwards (sglang_dsa_hooks.py)."""
    with applied_dsa_hooks({dsa.DSA_DECODE_ENV: "1"}):
        yield


def make_pool(fp8: bool) -> DSATokenToKVPool:
    """SGLang's DSA KV pool on CPU as its configurator sizes it: 656-byte scaled tokens for fp8_e4m3, 576 bf16."""
    return DSATokenToKVPool(size=POOL_TOKENS, page_size=PAGE_SIZE, kv_lora_rank=HEAD_DIM_V,
                            dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, qk_rope_head_dim=ROPE_DIM,
                            layer_num=1, device="cpu", index_head_dim=128, enable_memory_saver=False,
                            kv_cache_dim=fp8_ds_mla.TOKEN_BYTES if fp8 else HEAD_DIM_K)


# The attributes SGLang's constructor sets that adopt() and forward_decode read (checked against its source).
INIT_ATTRIBUTES = ("num_q_heads", "kv_cache_dtype", "dsa_kv_cache_store_fp8", "kv_cache_dim", "kv_lora_rank",
                   "qk_rope_head_dim", "hisparse_coordinator", "device", "token_to_kv_pool", "dsa_decode_impl",
                   "use_fused_topk")


def make_backend(heads: int = 64, fp8: bool = True, pool=None, **changes) -> DeepseekSparseAttnBackend:
    """A DeepseekSparseAttnBackend with the attributes its constructor sets on a Hopper DSA server (the constructor
    itself asks CUDA for the device capability)."""
    backend = DeepseekSparseAttnBackend.__new__(DeepseekSparseAttnBackend)
    pool = pool if pool is not None else make_pool(fp8)
    values = dict(num_q_heads=heads, kv_cache_dtype=pool.dtype, dsa_kv_cache_store_fp8=pool.dsa_kv_cache_store_fp8,
                  kv_cache_dim=pool.kv_cache_dim, kv_lora_rank=HEAD_DIM_V, qk_rope_head_dim=ROPE_DIM,
                  hisparse_coordinator=None, device="cpu", token_to_kv_pool=pool,
                  dsa_decode_impl="flashmla_kv" if fp8 else "fa3", use_fused_topk=False, dsa_index_topk=TOPK)
    for name in ("dsa_index_kpool", "dcp_size"):   # set only by the releases whose constructor sets them
        if f"self.{name} =" in init_source():
            values[name] = 1
    values.update(changes)
    for name, value in values.items():
        setattr(backend, name, value)
    return backend


def init_source() -> str:
    return inspect.getsource(inspect.unwrap(DeepseekSparseAttnBackend.__init__))


def sinks_supported() -> bool:
    """Learnable attention sinks reach forward_decode in 0.5.21 and 0.5.23 (0.5.17 has none in DSA)."""
    return "attn_sink" in inspect.signature(inspect.unwrap(DeepseekSparseAttnBackend.forward_decode)).parameters


def real_backend(monkeypatch, heads: int = 64, fp8: bool = True, pool=None, index_kpool: int | None = None,
                 spec: str | None = None, fused: bool = True) -> DeepseekSparseAttnBackend:
    """SGLang's own constructor (hooked by SGLang's HookRegistry when dsa_hooks is active) on CPU: the attention
    kit's MockMLAModelRunner with `heads` heads and SGLang's DSA pool, a DeepSeek-V3.2 model config (architecture,
    index_topk), and CUDA's device-capability query answering Hopper's (9, 0), the one CUDA call it makes.
    fused: SGLang's SGLANG_DSA_FUSE_TOPK (on by default), with which its indexer emits the translated slots."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: (9, 0))
    monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "1" if fused else "0")
    monkeypatch.setattr(base, "HEADS", heads)
    model_runner = base.make_runner(fp8=fp8)
    hf_config = SimpleNamespace(architectures=["DeepseekV32ForCausalLM"], index_topk=TOPK, index_head_dim=128)
    if index_kpool is not None:
        hf_config.index_kpool = index_kpool
    monkeypatch.setattr(model_runner.model_config, "hf_config", hf_config, raising=False)
    model_runner.token_to_kv_pool = pool if pool is not None else make_pool(fp8)
    if spec is not None:
        model_runner.spec_algorithm = SpeculativeAlgorithm.from_string(spec)
    backend = DeepseekSparseAttnBackend(model_runner)
    assert backend.use_fused_topk is fused
    return backend


def runner(model_dtype=torch.bfloat16, spec: str | None = None, draft: bool = False):
    return SimpleNamespace(dtype=model_dtype, spec_algorithm=SpeculativeAlgorithm.from_string(spec),
                           is_draft_worker=draft)


# ---- what the hooks rely on in SGLang -------------------------------------------------------------------------

def test_hook_targets_exist_with_the_arguments_dsadecode_takes():
    import pkgutil

    for target in TARGETS:
        assert callable(pkgutil.resolve_name(target)), target
    kernel = list(inspect.signature(inspect.unwrap(DeepseekSparseAttnBackend._forward_flashmla_sparse)).parameters)
    ours = list(inspect.signature(dsa.DSADecode.__call__).parameters)
    assert kernel == ours[:len(kernel)] and kernel[-1] in ("topk_length", "attn_sink")  # 0.5.17: no attn_sink


def test_forward_decode_hands_the_kernel_translated_slots_and_topk_lengths():
    """SGLang's decode translates the indexer's positions through its page table with page_size 1 (the result is
    KV-pool slots) and calls _forward_flashmla_sparse with them and the clipped lengths, for "flashmla_sparse"."""
    source = inspect.getsource(inspect.unwrap(DeepseekSparseAttnBackend.forward_decode))
    assert "transform_index_page_table_decode(" in source and "page_size=1" in source
    # 0.5.21 and 0.5.23 dispatch on dsa_impl (the implementation after the index_kpool remap), 0.5.17 on the attribute
    start = max(source.find(f'if dsa_impl == "{dsa.STAND_IN}":'),
                source.find(f'if self.dsa_decode_impl == "{dsa.STAND_IN}":'))
    assert start > 0
    call = source[start:source.index("elif", start)]
    assert "self._forward_flashmla_sparse(" in call and "page_table_1=page_table_1" in call
    assert "topk_length=metadata.dsa_cache_seqlens_int32" in call
    assert ("attn_sink=attn_sink" in call) == sinks_supported()


def test_constructor_sets_the_attributes_read():
    source = init_source()
    for name in INIT_ATTRIBUTES:
        assert f"self.{name} =" in source or f"self.{name}:" in source, name
    assert "self.dsa_decode_impl: _DSA_IMPL_T = " in source and "dsa_decode_backend" in source
    # read with a default of 1 where SGLang does not set them: index_kpool (not in 0.5.17), dcp_size (0.5.23 only)
    for name in ("dsa_index_kpool", "dcp_size"):
        assert (f"self.{name} =" in source) == hasattr(make_backend(), name), name


def test_sglangs_fp8_dsa_token_is_fp8_ds_mla():
    """SGLang's DSA FP8 row: kv_lora_rank e4m3 bytes, one float32 scale per quant_block_size channels, bf16 rope;
    its quantizer writes nope | scales | rope in that order with scale = max |x| / 448 (multiplied back)."""
    assert DSATokenToKVPool.quant_block_size == fp8_ds_mla.GROUP
    assert DSATokenToKVPool.rope_storage_dtype == torch.bfloat16
    assert make_pool(True).kv_cache_dim == fp8_ds_mla.TOKEN_BYTES
    source = inspect.getsource(inspect.getmodule(dsa_backend.quantize_k_cache))
    assert "[..., :dim_nope]" in source
    assert "[..., dim_nope : dim_nope + num_tiles * 4].view(torch.float32)" in source
    assert "[..., dim_nope + num_tiles * 4 :].view(torch.bfloat16)" in source
    assert "tl.max(tl.abs(y)) / FP8_MAX" in source


def sglang_torch_quantizer():
    module = inspect.getmodule(dsa_backend.quantize_k_cache)
    return getattr(module, "_quantize_k_cache_ref", None)


def test_sglangs_pytorch_quantizer_bytes_read_as_fp8_ds_mla():
    quantize = sglang_torch_quantizer()
    if quantize is None:
        pytest.skip("this SGLang ships its DSA FP8 quantizer as a Triton kernel only (0.5.21 has a PyTorch one)")
    torch.manual_seed(0)
    values = (torch.randn(2, PAGE_SIZE, 1, HEAD_DIM_K) * 3).to(torch.bfloat16)
    stored = quantize(values)
    assert stored.shape == (2, PAGE_SIZE, 1, fp8_ds_mla.TOKEN_BYTES)
    back = fp8_ds_mla.dequantize(stored)
    exact = values.float()
    assert torch.equal(back[..., HEAD_DIM_V:], exact[..., HEAD_DIM_V:])           # rope bytes as stored
    err = (back[..., :HEAD_DIM_V] - exact[..., :HEAD_DIM_V]).abs()
    group_max = exact[..., :HEAD_DIM_V].abs().view(2, PAGE_SIZE, 1, 4, 128).amax(-1, keepdim=True)
    assert (err.view(2, PAGE_SIZE, 1, 4, 128) <= group_max / 16 + 1e-6).all()      # within e4m3's half ulp


# ---- the flag ------------------------------------------------------------------------------------------------

def test_without_the_variable_nothing_is_hooked(monkeypatch):
    monkeypatch.delenv(dsa.DSA_DECODE_ENV, raising=False)
    assert dsa.register_hooks() is False
    assert not any(t in HookRegistry._hooks for t in TARGETS)
    assert not hasattr(DeepseekSparseAttnBackend.forward_decode, "__wrapped__")


def test_with_the_variable_sglangs_registry_applies_the_hooks(dsa_hooks):
    for name in ("__init__", "forward_decode", "_forward_flashmla_sparse"):
        assert hasattr(DeepseekSparseAttnBackend.__dict__[name], "__wrapped__"), name
    assert set(TARGETS) <= HookRegistry._patched


def test_plugin_register_registers_them(monkeypatch):
    """flashmla_backend.sglang.register (the entry point) registers the DSA hooks with the variable set."""
    import flashmla_backend.sglang as plugin

    registered = []
    monkeypatch.setenv(dsa.DSA_DECODE_ENV, "1")
    monkeypatch.setattr(plugin, "_hooks_registered", False)
    monkeypatch.setattr("flashmla_backend.sglang.hooks.register_hooks", lambda: None)
    monkeypatch.setattr(HookRegistry, "register", classmethod(lambda cls, target, *a, **k: registered.append(target)))
    plugin.register(apply_hooks=False)
    assert registered == list(TARGETS)


def test_missing_backend_class_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(dsa.DSA_DECODE_ENV, "1")
    monkeypatch.setattr(dsa, "BACKEND_MODULE", "sglang.srt.layers.attention.no_such_backend")
    with pytest.raises(RuntimeError, match="0.5.17, 0.5.21 and 0.5.23") as info:
        dsa.register_hooks()
    assert dsa.DSA_DECODE_ENV in str(info.value)


# ---- start-up: what is served, what is refused ------------------------------------------------------------------

@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("heads", [64, 128])
def test_served_configurations_are_adopted(fp8, heads):
    backend = make_backend(heads, fp8)
    decoder = dsa.adopt(backend, runner())
    assert backend.dsa_decode_impl == dsa.STAND_IN and getattr(backend, dsa.ATTR) is decoder
    assert decoder.fp8 is fp8 and decoder.page_size == PAGE_SIZE


def raw_fp8_pool():
    """SGLang's fp8 pool when both DSA backends are tilelang: 576 e4m3 bytes a token, no scales."""
    return DSATokenToKVPool(size=POOL_TOKENS, page_size=PAGE_SIZE, kv_lora_rank=HEAD_DIM_V, dtype=torch.float8_e4m3fn,
                            qk_rope_head_dim=ROPE_DIM, layer_num=1, device="cpu", index_head_dim=128,
                            enable_memory_saver=False, kv_cache_dim=HEAD_DIM_K)


@pytest.mark.parametrize("case,message,works", [
    (dict(heads=16), "got 16", "64 or 128"),
    (dict(heads=32), "got 32", "64 or 128"),
    (dict(raw_fp8=True), "without per-tile scales", "flashmla_kv / flashmla_sparse / fa3"),
    (dict(model_dtype=torch.float16), "model dtype", "bf16 model"),
    (dict(kv_lora_rank=256), "kv_lora_rank 256", "kv_lora_rank 512"),
    (dict(dsa_index_kpool=2), "index_kpool 2", "index_kpool 1"),
    (dict(dcp_size=2), "--dcp-size 2", "--dcp-size 1"),
    (dict(hisparse_coordinator=object()), "--enable-hisparse", "leave it off"),
    (dict(spec="EAGLE"), "speculative decoding", "without --speculative-algorithm"),
    (dict(draft=True), "speculative decoding", "without --speculative-algorithm"),
])
def test_refusals_name_what_works(case, message, works):
    case = dict(case)
    run = runner(case.pop("model_dtype", torch.bfloat16), case.pop("spec", None), case.pop("draft", False))
    heads = case.pop("heads", 64)
    pool = raw_fp8_pool() if case.pop("raw_fp8", False) else None
    backend = make_backend(heads, True, pool, **case)
    with pytest.raises(NotImplementedError) as info:
        dsa.adopt(backend, run)
    text = str(info.value)
    assert message in text and works in text and dsa.DSA_DECODE_ENV in text
    assert backend.dsa_decode_impl != dsa.STAND_IN and not hasattr(backend, dsa.ATTR)


def test_page_size_other_than_64_refused():
    backend = make_backend()
    backend.token_to_kv_pool.page_size = 32
    with pytest.raises(NotImplementedError, match="--page-size 32; use 64"):
        dsa.adopt(backend, runner())


def test_float16_cache_refused_naming_the_served_ones():
    backend = make_backend(fp8=False, kv_cache_dtype=torch.float16)
    with pytest.raises(NotImplementedError) as info:
        dsa.adopt(backend, runner(torch.float16))
    assert "'float16'" in str(info.value) and all(n in str(info.value) for n in ("bfloat16", "fp8_e4m3"))


def test_cuda_device_refused_until_the_decode_runs_on_gpus(monkeypatch):
    monkeypatch.delenv(dsa.SPARSE_GPU_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: (9, 0))
    backend = make_backend(device="cuda:0")
    with pytest.raises(RuntimeError, match="the DSA decode does not run on GPUs yet") as info:
        dsa.adopt(backend, runner())
    assert dsa.DSA_DECODE_ENV in str(info.value) and not hasattr(backend, dsa.ATTR)
    assert f"{dsa.SPARSE_GPU_ENV}=1 runs it anyway on a Hopper GPU (--kv-cache-dtype fp8_e4m3 or bfloat16)" in \
        str(info.value)


@pytest.mark.parametrize("fp8, capability, words", [
    (True, (9, 0), None),                                  # adopted: the kernel on a Hopper GPU
    (False, (9, 0), None),                                # the 16-bit cache: gathered for the dense kernel
    (True, (10, 0), "this one is sm_100"),                # not a Hopper GPU
    (False, (10, 0), r"\(a 16-bit cache\), this one is sm_100"),
])
def test_cuda_device_with_the_opt_in(fp8, capability, words, monkeypatch):
    monkeypatch.setenv(dsa.SPARSE_GPU_ENV, "1")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: capability)
    backend = make_backend(device="cuda:0", fp8=fp8, **({} if fp8 else {"kv_cache_dtype": torch.bfloat16}))
    if words is None:
        assert isinstance(dsa.adopt(backend, runner()), dsa.DSADecode) and hasattr(backend, dsa.ATTR)
    else:
        with pytest.raises(NotImplementedError, match=words) as info:
            dsa.adopt(backend, runner())
        assert dsa.SPARSE_GPU_ENV in str(info.value) and not hasattr(backend, dsa.ATTR)


def test_constructor_hook_adopts_after_sglangs_constructor():
    """The hooked constructor runs SGLang's (stood in for here: it needs CUDA) and then adopt()."""
    calls = []

    def sglang_constructor(self, model_runner, *args, **kwargs):
        calls.append("sglang")
        for name, value in vars(make_backend()).items():
            setattr(self, name, value)

    backend = DeepseekSparseAttnBackend.__new__(DeepseekSparseAttnBackend)
    dsa.init_hook(sglang_constructor, backend, runner())
    assert calls == ["sglang"] and backend.dsa_decode_impl == dsa.STAND_IN and hasattr(backend, dsa.ATTR)
    refused = DeepseekSparseAttnBackend.__new__(DeepseekSparseAttnBackend)
    with pytest.raises(NotImplementedError, match="speculative"):
        dsa.init_hook(sglang_constructor, refused, runner(spec="EAGLE"))


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("heads", [64, 128])
def test_sglangs_constructor_is_adopted(dsa_hooks, monkeypatch, fp8, heads):
    backend = real_backend(monkeypatch, heads, fp8)
    decoder = getattr(backend, dsa.ATTR)
    assert backend.dsa_decode_impl == dsa.STAND_IN and backend.num_q_heads == heads and decoder.fp8 is fp8
    assert backend.dsa_kv_cache_store_fp8 is fp8 and backend.kv_cache_dim == (656 if fp8 else 576)


def test_sglangs_constructor_unhooked_keeps_sglangs_decode(monkeypatch):
    monkeypatch.delenv(dsa.DSA_DECODE_ENV, raising=False)
    backend = real_backend(monkeypatch)
    assert not hasattr(backend, dsa.ATTR) and backend.dsa_decode_impl != dsa.STAND_IN


@pytest.mark.parametrize("case,message", [
    (dict(heads=16), "got 16"),
    (dict(spec="EAGLE"), "speculative decoding"),
    (dict(index_kpool=2), "index_kpool 2"),
])
def test_sglangs_constructor_refuses(dsa_hooks, monkeypatch, case, message):
    if "index_kpool" in case and "self.dsa_index_kpool =" not in init_source():
        pytest.skip("this SGLang's DSA backend has no index_kpool (0.5.21 and 0.5.23 do)")
    with pytest.raises(NotImplementedError, match=message):
        real_backend(monkeypatch, **case)


# ---- decode through SGLang's forward_decode ------------------------------------------------------------------

def sglang_translation(page_table, topk_indices, result=None, page_size=1):
    """transform_index_page_table_decode's contract (its docstring), in PyTorch: the Triton kernel needs a GPU."""
    assert page_size == 1
    picked = page_table.gather(1, topk_indices.clamp(min=0).long())
    return torch.where(topk_indices >= 0, picked, -1).to(torch.int32)


class Batch:
    """Requests with KV in SGLang's DSA pool on shuffled pages (page 0 is SGLang's padding page), their
    req_to_token rows, the indexer's top-k positions (valid ones first, then -1) and the DSAMetadata of a
    decode step."""

    def __init__(self, pool, lens, topk=TOPK, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.pool, self.lens, self.topk = pool, list(lens), topk
        pages = (torch.randperm(POOL_TOKENS // PAGE_SIZE, generator=g) + 1).tolist()
        self.pages = []                       # pages of each request, in order
        width = max(math.ceil(n / PAGE_SIZE) for n in lens) * PAGE_SIZE
        self.req_to_token = torch.zeros(len(lens), width, dtype=torch.int32)
        for r, n in enumerate(lens):
            own = [pages.pop() for _ in range(math.ceil(n / PAGE_SIZE))]
            self.pages.append(own)
            for pos in range(n):
                self.req_to_token[r, pos] = own[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        slots = pool.get_key_buffer(0).shape[0]
        self.values = torch.randn(slots, HEAD_DIM_K, generator=g).to(torch.bfloat16)   # every slot has a value
        buffer = pool.get_key_buffer(0)
        if pool.dsa_kv_cache_store_fp8:
            quantize = sglang_torch_quantizer()
            if quantize is not None:   # SGLang's own writer where it ships one on CPU
                stored = quantize(self.values.view(-1, PAGE_SIZE, 1, HEAD_DIM_K)).view(slots, 1, -1)
            else:
                stored = fp8_ds_mla.quantize(self.values).view(slots, 1, -1)
            buffer.view(torch.uint8).copy_(stored.view(torch.uint8))
        else:
            buffer.copy_(self.values.view(slots, 1, HEAD_DIM_K))
        self.topk_indices = torch.full((len(lens), topk), -1, dtype=torch.int32)
        for r, n in enumerate(lens):
            count = min(n, topk)
            self.topk_indices[r, :count] = torch.randperm(n, generator=g)[:count].to(torch.int32)
        self.topk_length = torch.tensor([min(n, topk) for n in lens], dtype=torch.int32)

    def expected_indices(self):
        """Each chosen position as page * 64 + offset (from the page assignment, not from req_to_token)."""
        out = torch.full_like(self.topk_indices, -1)
        for r in range(len(self.lens)):
            for j, pos in enumerate(self.topk_indices[r].tolist()):
                if pos >= 0:
                    out[r, j] = self.pages[r][pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        return out

    def metadata(self) -> DSAMetadata:
        seq = torch.tensor(self.lens, dtype=torch.int32)
        cu = torch.nn.functional.pad(seq.cumsum(0), (1, 0)).to(torch.int32)
        known = dict(page_size=PAGE_SIZE, cache_seqlens_int32=seq, max_seq_len_q=1, max_seq_len_k=max(self.lens),
                     cu_seqlens_q=torch.arange(len(self.lens) + 1, dtype=torch.int32), cu_seqlens_k=cu,
                     page_table_1=self.req_to_token, real_page_table=self.req_to_token[:, ::PAGE_SIZE] // PAGE_SIZE,
                     dsa_cache_seqlens_int32=self.topk_length,
                     dsa_cu_seqlens_q=torch.arange(len(self.lens) + 1, dtype=torch.int32),
                     dsa_cu_seqlens_k=torch.nn.functional.pad(self.topk_length.cumsum(0), (1, 0)).to(torch.int32),
                     dsa_extend_seq_lens_list=[1] * len(self.lens), dsa_seqlens_expanded=seq)
        required = [f.name for f in dataclasses.fields(DSAMetadata)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [n for n in required if n not in known]
        assert not missing, f"DSAMetadata needs fields this test does not fill: {missing}"
        return DSAMetadata(**{n: known[n] for n in required})


def dense_over_chosen(q, batch: Batch, scale, sink=None):
    """Attention of each query over the tokens its row names (the stored values, dequantized), in float64."""
    buffer = batch.pool.get_key_buffer(0).squeeze(1)
    kv = (fp8_ds_mla.dequantize(buffer, torch.float64) if batch.pool.dsa_kv_cache_store_fp8 else buffer.double())
    outs = []
    for r, slots in enumerate(batch.expected_indices().tolist()):
        keys = kv[[s for s in slots if s >= 0]]                       # [n, 576]
        scores = (q[r].double() @ keys.T) * scale                      # [heads, n]
        lse = torch.logsumexp(scores, -1, keepdim=True)
        out = torch.softmax(scores, -1) @ keys[:, :HEAD_DIM_V]
        if sink is not None:
            out = out * (1 / (1 + torch.exp(sink.double()[:, None] - lse)))
        outs.append(out)
    return torch.stack(outs)


def run_decode(backend, batch: Batch, q, monkeypatch, sink=None):
    """SGLang's forward_decode for a decode step of `batch`. The indexer's output it is handed: the top-k positions
    (SGLang then translates them through the page table), or with SGLang's fused top-k (use_fused_topk) the
    indexer's already translated slots, which the backend passes on as they are."""
    monkeypatch.setattr(dsa_backend, "transform_index_page_table_decode", sglang_translation)
    topk = batch.topk_indices
    if backend.use_fused_topk:
        topk = sglang_translation(batch.req_to_token, topk)
    backend.forward_metadata = batch.metadata()
    layer = RadixAttention(num_heads=q.shape[1], head_dim=HEAD_DIM_K, scaling=SCALE, num_kv_heads=1, layer_id=0,
                           v_head_dim=HEAD_DIM_V)
    extra = dict(attn_sink=sink) if sink is not None else {}
    return backend.forward_decode(q.reshape(q.shape[0], -1), None, None, layer, SimpleNamespace(),
                                  save_kv_cache=False, topk_indices=topk, **extra)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("heads", [64, 128])
def test_decode_runs_flashmla_backend_with_page_offset_indices(dsa_hooks, monkeypatch, fp8, heads, fused):
    pool = make_pool(fp8)
    batch = Batch(pool, lens=[150, 40, 96 + 7], seed=heads + fp8)
    backend = real_backend(monkeypatch, heads, fp8, pool, fused=fused)
    q = torch.randn(len(batch.lens), heads, HEAD_DIM_K, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out = run_decode(backend, batch, q, monkeypatch)
    assert out.shape == (len(batch.lens), heads, HEAD_DIM_V) and out.dtype == torch.bfloat16

    buffer = pool.get_key_buffer(0)
    k_cache = buffer.view(-1, PAGE_SIZE, 1, buffer.shape[-1])
    sched_meta, _ = flashmla_backend.get_mla_metadata()
    direct, _ = flashmla_backend.flash_mla_with_kvcache(
        q.unsqueeze(1), k_cache, None, None, HEAD_DIM_V, sched_meta, None, softmax_scale=SCALE, causal=False,
        is_fp8_kvcache=fp8, indices=batch.expected_indices().unsqueeze(1), topk_length=batch.topk_length)
    assert torch.equal(out, direct.squeeze(1))
    torch.testing.assert_close(out.double(), dense_over_chosen(q, batch, SCALE), atol=1e-2, rtol=1e-2)


def test_attention_sink_reaches_the_kernel(dsa_hooks, monkeypatch):
    if not sinks_supported():
        pytest.skip("this SGLang's DSA decode takes no attention sinks (0.5.21 and 0.5.23 do)")
    pool = make_pool(False)
    batch = Batch(pool, lens=[70, 130], seed=3)
    backend = real_backend(monkeypatch, 64, False, pool)
    q = torch.randn(2, 64, HEAD_DIM_K, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    sink = torch.linspace(-2, 2, 64).to(torch.bfloat16)
    out = run_decode(backend, batch, q, monkeypatch, sink=sink)
    torch.testing.assert_close(out.double(), dense_over_chosen(q, batch, SCALE, sink.float()), atol=1e-2, rtol=1e-2)
    plain = run_decode(backend, batch, q, monkeypatch)
    assert not torch.allclose(out.float(), plain.float(), atol=1e-3)


def test_padded_rows_and_empty_batches(dsa_hooks, monkeypatch):
    """Rows SGLang pads (topk rows of -1 for q rows without indexer output) give 0; no tokens give no rows."""
    pool = make_pool(True)
    batch = Batch(pool, lens=[80], seed=5)
    backend = make_backend(64, True, pool)
    dsa.adopt(backend, runner())
    decoder = getattr(backend, dsa.ATTR)
    q = torch.randn(2, 64, HEAD_DIM_K, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    table = torch.cat([sglang_translation(batch.req_to_token, batch.topk_indices),
                       torch.full((1, TOPK), -1, dtype=torch.int32)])
    out = decoder(q, pool.get_key_buffer(0), HEAD_DIM_V, table, SCALE, torch.tensor([80, 0], dtype=torch.int32))
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0].abs().sum() > 0
    empty = decoder(q[:0], pool.get_key_buffer(0), HEAD_DIM_V, table[:0], SCALE)
    assert empty.shape == (0, 64, HEAD_DIM_V)
    with pytest.raises(ValueError, match="v_head_dim must be 512"):
        decoder(q, pool.get_key_buffer(0), 128, table, SCALE)


def test_one_schedule_a_call_shape_is_filled_once_and_kept(dsa_hooks):
    """Every layer of every step with the same shape (and the CUDA graphs SGLang captures after its eager warm-up
    runs) reads one FlashMLASchedMeta, filled by the first call of that shape."""
    pool = make_pool(True)
    batch = Batch(pool, lens=[80, 33], seed=7)
    backend = make_backend(64, True, pool)
    dsa.adopt(backend, runner())
    decoder = getattr(backend, dsa.ATTR)
    q = torch.randn(2, 64, HEAD_DIM_K, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    table = sglang_translation(batch.req_to_token, batch.topk_indices)
    first = decoder(q, pool.get_key_buffer(0), HEAD_DIM_V, table, SCALE)
    assert list(decoder._sched_metas) == [(2, 64, TOPK)]
    meta = decoder._sched_metas[(2, 64, TOPK)]
    assert meta.config == flashmla_backend.FlashMLASchedMeta.Config(2, 1, 64, 64, 1, False, True, TOPK)
    again = decoder(q, pool.get_key_buffer(0), HEAD_DIM_V, table, SCALE)  # the next layer
    assert decoder._sched_metas[(2, 64, TOPK)] is meta and again.shape == first.shape
    decoder(q[:1], pool.get_key_buffer(0), HEAD_DIM_V, table[:1], SCALE)  # another batch size
    assert set(decoder._sched_metas) == {(2, 64, TOPK), (1, 64, TOPK)}


def test_topk_length_is_honoured(dsa_hooks, monkeypatch):
    """SGLang's topk_length counts a row's leading entries: fewer counted entries change the result like the
    reference with the same lengths."""
    pool = make_pool(False)
    batch = Batch(pool, lens=[150, 150], seed=7)
    backend = real_backend(monkeypatch, 64, False, pool, fused=False)
    q = torch.randn(2, 64, HEAD_DIM_K, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    batch.topk_length = torch.tensor([TOPK, 10], dtype=torch.int32)
    out = run_decode(backend, batch, q, monkeypatch)
    buffer = pool.get_key_buffer(0)
    sched_meta, _ = flashmla_backend.get_mla_metadata()
    direct, _ = flashmla_backend.flash_mla_with_kvcache(
        q.unsqueeze(1), buffer.view(-1, PAGE_SIZE, 1, HEAD_DIM_K), None, None, HEAD_DIM_V, sched_meta, None,
        softmax_scale=SCALE, causal=False, is_fp8_kvcache=False, indices=batch.expected_indices().unsqueeze(1),
        topk_length=batch.topk_length)
    assert torch.equal(out, direct.squeeze(1))
    batch.topk_indices[1, 10:] = -1
    torch.testing.assert_close(out.double()[1], dense_over_chosen(q, batch, SCALE)[1], atol=1e-2, rtol=1e-2)


def test_kernel_call_outside_decode_stays_sglangs(dsa_hooks, monkeypatch):
    """_forward_flashmla_sparse from forward_extend (prefill with --dsa-prefill-backend flashmla_sparse) is SGLang's:
    the hook passes it on to SGLang's method, which reaches for SGLang's FlashMLA kernel (absent on CPU)."""
    pool = make_pool(False)
    backend = make_backend(64, False, pool)
    dsa.adopt(backend, runner())
    calls = []
    monkeypatch.setattr(dsa.DSADecode, "__call__", lambda self, *a, **k: calls.append(1))
    q = torch.zeros(1, 64, HEAD_DIM_K, dtype=torch.bfloat16)
    table = torch.full((1, TOPK), -1, dtype=torch.int32)
    with pytest.raises(ImportError):   # SGLang's kernel package: sgl_kernel (0.5.17, 0.5.21), flash_mla (0.5.23)
        backend._forward_flashmla_sparse(q_all=q, kv_cache=pool.get_key_buffer(0), v_head_dim=HEAD_DIM_V,
                                         page_table_1=table, sm_scale=SCALE)
    assert calls == []
    assert getattr(backend, dsa.ATTR).active is False


def test_backends_not_adopted_keep_sglangs_decode(dsa_hooks, monkeypatch):
    """A backend the constructor hook did not adopt keeps SGLang's decode path (the hook is a pass-through)."""
    pool = make_pool(False)
    batch = Batch(pool, lens=[70], seed=9)
    backend = make_backend(64, False, pool, dsa_decode_impl=dsa.STAND_IN)
    calls = []
    monkeypatch.setattr(dsa.DSADecode, "__call__", lambda self, *a, **k: calls.append(1))
    q = torch.zeros(1, 64, HEAD_DIM_K, dtype=torch.bfloat16)
    with pytest.raises(ImportError):   # SGLang's own kernel call, as in the test above
        run_decode(backend, batch, q, monkeypatch)
    assert calls == []


# ---- integration/sglang_run.py's DeepSeek-V3.2 runs (sglang_engine_check.sh, group dsa) ----------------------------

def _sglang_run():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    import sglang_run

    return sglang_run


def test_dsa_serve_command_parses_with_this_sglang():
    """`sglang_run.py serve --backend dsa --dsa-decode-backend flashmla_kv`: this SGLang's own argument parser reads
    the DSA backend, SGLang's decode kernel and the FP8 cache from the command."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    sglang_run = _sglang_run()
    args = SimpleNamespace(model="/tmp/m", backend="dsa", kv_cache_dtype="fp8_e4m3", dcp=1,
                           dsa_decode_backend="flashmla_kv")
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(sglang_run.launch_server_cmd(args, 30000)[3:])
    assert (ns.attention_backend, ns.dsa_decode_backend, ns.kv_cache_dtype) == ("dsa", "flashmla_kv", "fp8_e4m3")
    ns = parser.parse_args(sglang_run.launch_server_cmd(SimpleNamespace(**{**vars(args), "dsa_decode_backend": None}),
                                                        30000)[3:])
    assert ns.attention_backend == "dsa" and ns.dsa_decode_backend is None   # ours: SGLang resolves its own choice
    # the bfloat16 steps (dsa-*-bf16): the 16-bit cache, SGLang's FlashMLA sparse kernel as the reference
    bf16 = SimpleNamespace(**{**vars(args), "kv_cache_dtype": "bfloat16", "dsa_decode_backend": "flashmla_sparse"})
    ns = parser.parse_args(sglang_run.launch_server_cmd(bf16, 30000)[3:])
    assert (ns.dsa_decode_backend, ns.kv_cache_dtype) == ("flashmla_sparse", "bfloat16")


def test_dsa_run_engine_arguments_are_this_sglangs_server_arguments(tmp_path, monkeypatch):
    """`run --backend dsa --dsa-decode-backend flashmla_kv --kv-cache-dtype fp8_e4m3`: the sglang.Engine it starts
    (a stand-in recording its arguments) gets fields of this SGLang's ServerArgs, the DSA backend and SGLang's decode
    kernel among them, and the result says whose decode ran."""
    import json

    import sglang
    from sglang.srt.server_args import ServerArgs

    sglang_run = _sglang_run()
    import sglang_dcp_run

    seen = {}

    class Engine:
        def __init__(self, **kw):
            seen.update(kw)

        def generate(self, input_ids, **kw):
            return [{"meta_info": {"output_token_logprobs": [(-0.5, 7, "")], "output_top_logprobs": [[(-0.5, 7, "")]]}}
                    for _ in input_ids]

        def shutdown(self):
            pass

    monkeypatch.setattr(sglang, "Engine", Engine, raising=False)
    monkeypatch.setattr(sglang_run, "_declare_entry_point", lambda run_dir: None)
    (tmp_path / "prompts.json").write_text(json.dumps([[1, 2, 3]]))
    out = tmp_path / "ref.json"
    monkeypatch.delenv(dsa.DSA_DECODE_ENV, raising=False)
    assert sglang_run.main(["run", "--model", "/tmp/m", "--backend", "dsa", "--prompts", str(tmp_path / "prompts.json"),
                            "--out", str(out), "--kv-cache-dtype", "fp8_e4m3", "--dsa-decode-backend",
                            "flashmla_kv"]) == 0
    assert set(seen) <= sglang_dcp_run.server_arg_names(ServerArgs), set(seen) - sglang_dcp_run.server_arg_names(
        ServerArgs)
    assert (seen["attention_backend"], seen["dsa_decode_backend"], seen["kv_cache_dtype"]) == (
        "dsa", "flashmla_kv", "fp8_e4m3")
    assert json.loads(out.read_text())["dsa_decode"] == "sglang"


def test_dsa_logcheck_follows_the_environment(tmp_path, monkeypatch, capsys):
    """`logcheck --backend dsa LOG`: our decode's start-up line required with FLASHMLA_BACKEND_DSA_DECODE set and
    refused without it (a reference run that our decode replaced); the line is the one adopt() logs."""
    sglang_run = _sglang_run()
    assert sglang_run.DSA_LOG_LINE in inspect.getsource(dsa.adopt)
    ours = tmp_path / "ours.log"
    ours.write_text(f"INFO flashmla_backend: {sglang_run.DSA_LOG_LINE} 0.1 sparse decode (...)\n")
    theirs = tmp_path / "ref.log"
    theirs.write_text("INFO SGLang's own decode\n")
    for env, log, rc in [("1", ours, 0), ("1", theirs, 1), ("0", ours, 1), ("0", theirs, 0), (None, theirs, 0)]:
        if env is None:
            monkeypatch.delenv(dsa.DSA_DECODE_ENV, raising=False)
        else:
            monkeypatch.setenv(dsa.DSA_DECODE_ENV, env)
        assert sglang_run.main(["logcheck", "--backend", "dsa", str(log)]) == rc, (env, log.name)
        assert sglang_run.main(["logcheck", "--backend", "flashmla_backend", str(log)]) == 0  # dense runs: no check
    assert "SGLang's own decode ran" in capsys.readouterr().out
