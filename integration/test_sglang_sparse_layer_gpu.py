"""Layer-level GPU tests of the plugin's DeepSeek-V3.2 decode in SGLang's DSA backend, against SGLang's own decode.

    python -m pytest integration/test_sglang_sparse_layer_gpu.py -v -s     (a Hopper GPU with SGLang 0.5.17)

SGLang's attention kit (sglang/test/kits/attention_unittest/attention_methods/dsa_attention.py, shipped in the
wheel) builds a DSA model runner with SGLang's real ReqToTokenPool and DSATokenToKVPool (fp8_e4m3 656-byte tokens
or bf16), the "dsa" backend through SGLang's ATTENTION_BACKENDS, a tiny DeepSeek-V3.2 attention module (kv_lora_rank
512, rope 64, one latent KV head) whose context it writes through the pool's own writer (SGLang's FP8 quantizer for
the FP8 cache) on shuffled pages, and the indexer's top-k rows of positions. Each case builds that fixture twice
from the same seed:
  * SGLang's own decode: --dsa-decode-backend flashmla_kv on the FP8 cache, flashmla_sparse on bf16 (the
    reference decodes of integration/sglang_engine_check.sh's dsa and dsa-bf16 groups, sgl_kernel's FlashMLA);
  * ours: the same, with FLASHMLA_BACKEND_DSA_DECODE=1 (the plugin's hooks applied by SGLang's HookRegistry, so
    SGLang's constructor adopts the backend and its forward_decode calls flashmla_backend's sparse decode) and
    FLASHMLA_BACKEND_SPARSE_GPU=1 (the opt-in for GPUs, README "Environment variables").
One decode step runs through the module's RadixAttention (SGLang's forward_decode, its metadata, its top-k
translation through the page table, or with SGLang's fused top-k the slots handed in as its indexer hands them);
the step writes the decode token into the pool, and both fixtures must then hold the same cache bytes. The
reference is attention in fp64 over those bytes (the FP8 tokens dequantized), each query over the slots its row
names. Required: our kernel ran (SGLang's did not) and SGLang's did not run ours; both outputs finite; ours within
atol = rtol = 1e-2 of the reference; SGLang's within a relative norm of 1e-2 (a check of the test's own inputs);
ours no further from the reference than SGLang's by relative norm (x 1.25 + 1e-3, as the vLLM sparse layer test);
with the scale-breaking test hook (FLASHMLA_BACKEND_DEBUG_BREAK_SCALE=1) that last criterion must fail. Printed:
both relative norms and max |diff|. A CUDA-graph case runs the kit's own capture and replay runner for DSA decode
with our decode in it (its reference and tolerance), and counts our kernel calls during it.

Top-k 2048 (DeepSeek-V3.2's) over contexts of 700-4000 tokens, rows that pick the first and last 1024 positions of
longer contexts (so they read sparsely) and every position of shorter ones (-1 padding after), 64 and 128 heads.
"""
from __future__ import annotations

import sys
import unittest
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the sparse decode kernel needs a Hopper GPU (sm_90)", allow_module_level=True)
pytest.importorskip("sglang")
try:
    from sglang.test.kits.attention_unittest.attention_methods import dsa_attention as kit
except ImportError as exc:   # the kit's DSA fixtures exist in 0.5.17, 0.5.21 and 0.5.23
    pytest.skip(f"this SGLang's attention kit has no DSA fixtures: {exc}", allow_module_level=True)

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context  # noqa: E402

from flashmla_backend import fp8_ds_mla  # noqa: E402
from flashmla_backend._env import DEBUG_BREAK_SCALE_ENV, SPARSE_GPU_ENV  # noqa: E402
from flashmla_backend.geometry import HEAD_DIM_V, PAGE_SIZE  # noqa: E402
from flashmla_backend.sglang import dsa  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from sglang_dsa_hooks import applied_dsa_hooks  # noqa: E402

TOPK = 2048
OUT_ATOL = OUT_RTOL = 1e-2
THEIRS_REL_NORM = 1e-2
REL_RATIO, REL_SLACK = 1.25, 1e-3
SGLANG_DECODE = {True: "flashmla_kv", False: "flashmla_sparse"}   # SGLang's own decode for the FP8 / bf16 cache


class _Case(unittest.TestCase):
    """The kit's builders take a unittest.TestCase (for skipTest); pytest reports unittest.SkipTest as a skip."""

    def runTest(self):
        pass


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts flashmla_backend's DSA decode calls (the adopted backends' kernel call)."""
    calls = []
    original = dsa.DSADecode.__call__

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(dsa.DSADecode, "__call__", counted)
    return calls


def _hooks():
    """FLASHMLA_BACKEND_DSA_DECODE=1 with the GPU opt-in: the plugin's hooks registered and applied by SGLang's
    HookRegistry to the real class while the block runs; the class's methods and the registry restored after."""
    return applied_dsa_hooks({dsa.DSA_DECODE_ENV: "1", SPARSE_GPU_ENV: "1"})


def make_case(name: str, heads: int, prefix_lens: tuple[int, ...]):
    return kit.DSAAttentionCase(name=name, backend="dsa", forward_mode=ForwardMode.DECODE, num_heads=heads,
                                num_kv_heads=1, page_size=PAGE_SIZE, prefix_lens=prefix_lens)


def build(case, fp8: bool, fused: bool, monkeypatch):
    """The kit's sparse fixture (the same seed for ours and SGLang's: same weights, inputs, cache bytes and rows).
    fused: SGLang's fused top-k (SGLANG_DSA_FUSE_TOPK, read by the backend's constructor)."""
    monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "1" if fused else "0")
    fixture = kit.build_dsa_sparse_attention_fixture(
        _Case(), case, device="cuda", dsa_decode_backend=SGLANG_DECODE[fp8], fp8_kv_cache=fp8, index_topk=TOPK,
        index_pattern="head_tail", max_context_len=max(case.seq_lens))
    assert fixture.backend.use_fused_topk is fused
    return fixture


def slots_of(fixture) -> torch.Tensor:
    """The KV-pool slot of every position each row names (-1 kept): req_to_token of the row's request."""
    batch = fixture.forward_batch
    table = fixture.runner.req_to_token_pool.req_to_token[batch.req_pool_indices.long()]   # [requests, width]
    rows = fixture.topk_indices.long()                                                      # [requests, TOPK]
    picked = table.gather(1, rows.clamp(min=0)).to(torch.int64)
    return torch.where(rows >= 0, picked, torch.full_like(picked, -1))


def decode_step(fixture):
    """One decode step through the module's RadixAttention (SGLang's forward_decode); returns o [tokens, heads,
    512] and the query [tokens, heads, 576] the step attended with. With SGLang's fused top-k its indexer hands
    over pool slots, which the decode passes on as they are; else positions, which the decode translates."""
    module = fixture.actual_module
    heads = fixture.case.num_heads
    topk = slots_of(fixture).to(torch.int32) if fixture.backend.use_fused_topk else fixture.topk_indices
    q_nope, q_rope = module.project_q(fixture.input_hidden)
    k_nope, k_rope = module.project_k(fixture.input_hidden)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=fixture.backend)):
        fixture.backend.init_forward_metadata(fixture.forward_batch)
        out = module.attn(q_nope, k_nope, k_nope, fixture.forward_batch, k_rope=k_rope, q_rope=q_rope,
                          topk_indices=topk)
    q = torch.cat([q_nope.view(-1, heads, HEAD_DIM_V), q_rope.view(-1, heads, q_rope.shape[-1])], dim=-1)
    return out.view(-1, heads, HEAD_DIM_V), q


def pool_bytes(fixture) -> torch.Tensor:
    return fixture.runner.token_to_kv_pool.get_key_buffer(fixture.actual_module.attn.layer_id)


def reference(fixture, q: torch.Tensor) -> torch.Tensor:
    """Attention in fp64 over the pool's bytes (FP8 tokens dequantized), each query over the slots its row names."""
    buffer = pool_bytes(fixture).squeeze(1)
    keys_all = (fp8_ds_mla.dequantize(buffer, torch.float64) if fixture.runner.token_to_kv_pool.dsa_kv_cache_store_fp8
                else buffer.double())
    scale = fixture.actual_module.attn.scaling
    outs = []
    for r, row in enumerate(slots_of(fixture)):
        keys = keys_all[row[row >= 0]]
        probs = torch.softmax((q[r].double() @ keys.T) * scale, dim=-1)
        outs.append(probs @ keys[:, :HEAD_DIM_V])
    return torch.stack(outs)


def rel_norm(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


CASES = {
    # name: (heads, prefix lengths): contexts of 65-4001 keys (the decode token included); rows of top-k 2048
    "h64": (64, (2500, 700, 4000)),
    "h128": (128, (3000, 1200, 2048, 64)),
}


def run_both(name, fp8, fused, monkeypatch, kernel_calls, broken=False):
    heads, prefix = CASES[name]
    case = make_case(f"flashmla_backend_{name}", heads, prefix)
    theirs_fx = build(case, fp8, fused, monkeypatch)
    assert not hasattr(theirs_fx.backend, dsa.ATTR)
    out_theirs, q_theirs = decode_step(theirs_fx)
    assert kernel_calls == [], "SGLang's own decode called flashmla_backend"

    with _hooks():   # active through the step too: SGLang's forward_decode reaches our kernel through them
        ours_fx = build(case, fp8, fused, monkeypatch)
        assert hasattr(ours_fx.backend, dsa.ATTR), "the hooked constructor did not adopt the backend"
        if broken:
            monkeypatch.setenv(DEBUG_BREAK_SCALE_ENV, "1")
        out_ours, q_ours = decode_step(ours_fx)
        monkeypatch.delenv(DEBUG_BREAK_SCALE_ENV, raising=False)
    assert kernel_calls, "flashmla_backend's decode did not run"
    torch.cuda.synchronize()

    assert torch.equal(q_ours, q_theirs)
    assert torch.equal(pool_bytes(ours_fx).view(torch.uint8), pool_bytes(theirs_fx).view(torch.uint8)), \
        "the two fixtures' pools differ: the comparison would not be on the same cache bytes"
    assert out_ours.dtype == out_theirs.dtype and out_ours.shape == out_theirs.shape
    ref = reference(ours_fx, q_ours)
    e_ours, e_theirs = rel_norm(out_ours, ref), rel_norm(out_theirs, ref)
    print(f"\n[{name} {'fp8_e4m3' if fp8 else 'bf16'} fused={fused}{' broken' if broken else ''}] rel-norm ours "
          f"{e_ours:.2e} (max |diff| {(out_ours.double() - ref).abs().max().item():.3e}), SGLang "
          f"{SGLANG_DECODE[fp8]} {e_theirs:.2e} (max |diff| {(out_theirs.double() - ref).abs().max().item():.3e})")
    assert torch.isfinite(out_ours).all() and torch.isfinite(out_theirs).all()
    assert e_theirs <= THEIRS_REL_NORM, f"SGLang's decode against the reference (the test's inputs?): {e_theirs}"
    return out_ours, ref, e_ours, e_theirs


@pytest.mark.parametrize("fused", [True, False], ids=["fused_topk", "positions"])
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8_e4m3", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_decode_no_further_from_reference_than_sglangs(name, fp8, fused, monkeypatch, kernel_calls):
    out, ref, e_ours, e_theirs = run_both(name, fp8, fused, monkeypatch, kernel_calls)
    torch.testing.assert_close(out.double(), ref, atol=OUT_ATOL, rtol=OUT_RTOL)
    assert e_ours <= REL_RATIO * e_theirs + REL_SLACK


def test_broken_scale_fails_the_criterion(monkeypatch, kernel_calls):
    """The criterion above must catch a wrong decode: the test hook multiplies the softmax scale by 1.5."""
    _, _, e_ours, e_theirs = run_both("h64", True, True, monkeypatch, kernel_calls, broken=True)
    assert e_ours > REL_RATIO * e_theirs + REL_SLACK, f"a broken scale passed: {e_ours} against {e_theirs}"


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8_e4m3", "bf16"])
def test_cuda_graph_decode_replay(fp8, monkeypatch, kernel_calls):
    """The kit's CUDA-graph decode runner (capture, replays with new inputs, its reference and tolerance) with our
    decode adopted by SGLang's constructor. SGLang's top-k translation: the kit's rows are positions."""
    monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "0")
    case = make_case("flashmla_backend_cg", 64, (64, 300, 1000))
    with _hooks():
        from sglang.test.kits.attention_unittest.runner_modes import cuda_graph_decode_runner as cg

        # The runner builds its fixture with the kit's default top-k (128), which SGLang's own translation of
        # positions refuses (transform_index asserts the model's 2048); the runner looks the builder up in its
        # module at call time, so give it the model's top-k there.
        kit_build = cg.build_dsa_sparse_attention_fixture
        monkeypatch.setattr(cg, "build_dsa_sparse_attention_fixture",
                            lambda *a, **kw: kit_build(*a, **{**kw, "index_topk": TOPK}))
        cg.run_dsa_sparse_cuda_graph_decode_case(_Case(), case, dsa_decode_backend=SGLANG_DECODE[fp8],
                                                 fp8_kv_cache=fp8)
    assert kernel_calls, "flashmla_backend's decode did not run in the kit's CUDA-graph runner"
