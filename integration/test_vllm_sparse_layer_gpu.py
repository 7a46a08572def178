"""Layer-level GPU tests of the plugin's sparse MLA backend (DeepSeek-V3.2) against vLLM's FLASHMLA_SPARSE.

    python -m pytest integration/test_vllm_sparse_layer_gpu.py -v -s      (a Hopper GPU with vLLM 0.26.0)

The backend refuses CUDA devices unless FLASHMLA_BACKEND_SPARSE_GPU is set (README, "Environment variables"); this
file sets it while its own tests run. Each case is a fake step of tests/test_vllm_sparse_cpu.py (its SparseBatch:
64-token kernel blocks in a random permutation, block 0 the null block, NaN bytes in every slot no request owns, the
indexer's top-k positions per query token with its own skips and one stale position past each short request's
length) on the fp8_ds_mla cache, the one the Hopper sparse kernel reads. Ours runs first on that buffer (the stale
positions must be skipped); then, the stale positions set to -1 as vLLM's indexer leaves its buffer (FLASHMLA_SPARSE
reads whatever slot a position names), two layers read the same cache bytes and the same top-k buffer:
  * ours: the plugin's sparse builder and impl as a vLLM worker builds them (the CPU test's SparsePlugin, here with
    its builder and the indexer's buffer on the GPU), forward_mqa on the sparse decode kernel;
  * vLLM's FLASHMLA_SPARSE: its own builder (per-request index conversion with its Triton kernel, its FlashMLA
    schedule) and impl, forward_mqa on vLLM's bundled FlashMLA sparse kernel.
Both are compared with flashmla_backend's reference on a compact copy of each request's tokens with the indices
written out from the positions (the CPU test's SparseBatch.expected: fp32 arithmetic on CPU tensors, no block
table). Required: every output finite on the real tokens, ours within atol = rtol = 1e-2 of the reference, vLLM's
within a relative norm of 1e-2 (a check of the test's own inputs; its bf16-rounded keys put a few elements past the
element-wise bound), ours no further from the reference than vLLM's by relative norm (x 1.25 + 1e-3), and the
CUDA-graph padding tokens zero. Printed: each backend's max |diff| and relative norm.

A CUDA-graph case captures our forward_mqa once and replays it after the indexer's buffer and the lengths changed
in place (the builder's persistent buffers and the schedule it filled ahead), against an eager run and the
reference.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import harness

INTEGRATION = Path(__file__).resolve().parent
TESTS = INTEGRATION.parent / "tests"
sys.path[:0] = [str(TESTS)]

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the sparse decode kernel needs a Hopper GPU (sm_90)", allow_module_level=True)

from flashmla_backend._env import SPARSE_GPU_ENV  # noqa: E402

import test_vllm_sparse_cpu as sp  # noqa: E402  (the CPU test's batches and plugin wrapper)

from vllm.config import DeviceConfig  # noqa: E402
from vllm.config.vllm import set_current_vllm_config  # noqa: E402

DEVICE = torch.device("cuda", 0)
KV = "fp8_ds_mla"
THEIRS_LAYER = "model.layers.0.self_attn.attn_flashmla_sparse"
REL_RATIO, REL_SLACK = 1.25, 1e-3
THEIRS_REL_NORM = 1e-2

CASES = {
    # name: (heads, seq_lens, query_lens, KV-manager block size)
    "decode_h64": (64, [1, 37, 64, 65, 300, 1000], [1] * 6, 64),
    "decode_h128": (128, [2, 64, 129, 700, 1000], [1] * 5, 64),
    "mtp2_h64": (64, [2, 70, 129, 999], [2] * 4, 64),
    "padded_h128": (128, [100, 600, 0, 0], [1, 1, 0, 0], 64),
    "block256_h64": (64, [5, 255, 257, 900], [1] * 4, 256),
}


_factory: list = []


@pytest.fixture(scope="module", autouse=True)
def vllm_process_state(tmp_path_factory):
    """The backend's GPU opt-in for this module's tests, one-rank distributed state (vLLM's impls may ask for the
    tensor-parallel size), the plugin registered, vLLM's workspace manager (FLASHMLA_SPARSE's impl takes its buffers
    from it)."""
    from vllm.distributed import parallel_state as ps
    from vllm.v1.worker import workspace

    env = pytest.MonkeyPatch()
    env.setenv(SPARSE_GPU_ENV, "1")
    _factory.append(tmp_path_factory)
    sp.register()
    torch.cuda.set_device(DEVICE)
    if not ps.model_parallel_is_initialized():
        cfg = gpu_config(64, 1, 64)
        with set_current_vllm_config(cfg):
            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="nccl",
                                            distributed_init_method=f"tcp://127.0.0.1:{harness.free_port()}")
            ps.ensure_model_parallel_initialized(1, 1)
    if not workspace.is_workspace_manager_initialized():
        workspace.init_workspace_manager(DEVICE)
    yield
    env.undo()


def gpu_config(heads: int, s_q: int, manager_block_size: int):
    cfg = sp.make_vllm_config(sp.v32_model_config(_factory[0], heads), kv_cache_dtype=KV, query_len=s_q,
                              manager_block_size=manager_block_size)
    cfg.device_config = DeviceConfig(device="cuda")
    return cfg


class Theirs:
    """vLLM's FLASHMLA_SPARSE as a worker builds it, reading the same top-k buffer."""

    def __init__(self, cfg, ours: sp.SparsePlugin):
        from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
        from vllm.v1.worker import utils as worker_utils

        self.cfg, self.scale = cfg, ours.scale
        self.backend = FlashMLASparseBackend
        self.layer = sp.base.LayerDouble(cfg, self.scale)
        cfg.compilation_config.static_forward_context[THEIRS_LAYER] = self.layer
        self.group = worker_utils.AttentionGroup(self.backend, [THEIRS_LAYER], ours.spec, 0)
        with set_current_vllm_config(cfg):
            self.group.create_metadata_builders(cfg, DEVICE, ours.kernel_block_size)
            hf = cfg.model_config.hf_text_config
            self.impl = self.backend.get_impl_cls()(
                num_heads=ours.num_heads, head_size=sp.HEAD, scale=self.scale, num_kv_heads=1, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype=KV, logits_soft_cap=None, attn_type="decoder",
                kv_sharing_target_layer_name=None, q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
                qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim,
                qk_head_dim=hf.qk_nope_head_dim + hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim, kv_b_proj=None,
                indexer=None, topk_indices_buffer=ours.topk_buffer)
        self.builder = self.group.get_metadata_builder()

    build_mapped = sp.SparsePlugin.build_mapped   # reads cfg, group and builder, which this class has too

    def forward_mqa(self, q, kv_cache, metadata):
        with set_current_vllm_config(self.cfg):
            return self.impl.forward_mqa(q, kv_cache, metadata, self.layer)


def device_common(batch: sp.SparseBatch, ours: sp.SparsePlugin):
    """The batch's CommonAttentionMetadata in the blocks the release's builder takes (SparsePlugin.in_kernel_blocks),
    its tensors on the GPU."""
    common = ours.in_kernel_blocks(batch.common)
    for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping", "is_prefilling"):
        value = getattr(common, name, None)
        if isinstance(value, torch.Tensor):
            common = common.replace(**{name: value.to(DEVICE)})
    return common


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    got, want = out.float().cpu(), ref.float()
    return (got - want).abs().max().item(), ((got - want).norm() / want.norm()).item()


def setup(case: str, seed: int = 0):
    heads, seq_lens, query_lens, M = CASES[case]
    cfg = gpu_config(heads, max(query_lens), M)
    ours = sp.SparsePlugin(cfg, DEVICE)   # the plugin's builder and the indexer's buffer on the GPU
    theirs = Theirs(cfg, ours)
    batch = sp.SparseBatch(ours, seq_lens, query_lens, seed=seed or sum(seq_lens))
    ours.topk_buffer.fill_(-1)
    ours.topk_buffer[: batch.num_tokens] = batch.positions.to(DEVICE)
    common = device_common(batch, ours)
    cache = batch.kv_cache.to(DEVICE)
    q = tuple(t.to(DEVICE) for t in batch.q())
    return ours, theirs, batch, common, cache, q


def without_stale(batch: sp.SparseBatch) -> torch.Tensor:
    """The batch's positions with every position at or past its request's length set to -1: the indexer's buffer as
    vLLM's own indexer leaves it (it never names a token the request has not written; FLASHMLA_SPARSE relies on that
    and reads such a slot, NaN here, while ours skips it)."""
    lens = torch.tensor([n for n, s_q in zip(batch.seq_lens, batch.query_lens) for _ in range(s_q)], dtype=torch.int32)
    positions = batch.positions.clone()
    rows = positions[: lens.numel()]
    rows[rows >= lens[:, None]] = -1
    return positions


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_forward_matches_flashmla_sparse_and_the_reference(case):
    """Ours first on the buffer with the stale positions (skipped: the reference is the same), then both backends on
    the buffer without them."""
    ours, theirs, batch, common, cache, q = setup(case)
    mapped = sum(batch.query_lens)
    ref = batch.expected(ours.scale)[:mapped]
    out_stale, _ = ours.forward_mqa(q, cache, ours.build_mapped(common))
    torch.cuda.synchronize()
    assert torch.isfinite(out_stale[:mapped]).all(), "a stale position was read (it names a NaN slot)"
    torch.testing.assert_close(out_stale[:mapped].float().cpu(), ref.float(), atol=sp.OUT_ATOL, rtol=sp.OUT_RTOL)
    clean = without_stale(batch)
    assert not torch.equal(clean, batch.positions)  # the case has stale positions to remove
    ours.topk_buffer[: batch.num_tokens] = clean.to(DEVICE)
    out, lse = ours.forward_mqa(q, cache, ours.build_mapped(common))
    torch.cuda.synchronize()
    assert lse is None and out.shape == (batch.num_tokens, ours.num_heads, sp.LATENT) and out.is_cuda
    ref_out, _ = theirs.forward_mqa(q, cache, theirs.build_mapped(common))
    torch.cuda.synchronize()
    e_ours, e_theirs = errors(out[:mapped], ref), errors(ref_out[:mapped], ref)
    print(f"\n[{case}] vs the reference: ours max |diff| {e_ours[0]:.3g}, rel-norm {e_ours[1]:.3g}; FLASHMLA_SPARSE "
          f"{e_theirs[0]:.3g}, {e_theirs[1]:.3g}", flush=True)
    assert torch.isfinite(out[:mapped]).all(), "an index landed on a NaN slot (null, spare or stale)"
    # vLLM's kernel, a check of the test's own inputs: finite and close by relative norm. Not element by element: it
    # rounds the dequantized keys to bf16, which on these tokens (spread-out group scales) leaves a few outputs 1-2e-2
    # off (rel-norm 3.4-5.0e-3 measured on an H200, max |diff| up to 0.031).
    assert torch.isfinite(ref_out[:mapped]).all(), "FLASHMLA_SPARSE read a NaN slot (the test's inputs?)"
    assert e_theirs[1] <= THEIRS_REL_NORM, f"FLASHMLA_SPARSE against the reference (the test's inputs?): {e_theirs}"
    torch.testing.assert_close(out[:mapped].float().cpu(), ref.float(), atol=sp.OUT_ATOL, rtol=sp.OUT_RTOL)
    assert e_ours[1] <= REL_RATIO * e_theirs[1] + REL_SLACK
    assert not out[mapped:].any()  # CUDA-graph padding tokens: no indices, zeros


def test_the_comparison_fails_when_the_indices_are_wrong():
    """Requests 0 and 1 swapped in our metadata's block table: ours reads other tokens and must not match."""
    ours, _, batch, common, cache, q = setup("decode_h64")
    md = ours.build_mapped(common)
    md.block_table[[0, 1]] = md.block_table[[1, 0]].clone()
    out, _ = ours.forward_mqa(q, cache, md)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out.float().cpu(), batch.expected(ours.scale).float(), atol=sp.OUT_ATOL,
                                   rtol=sp.OUT_RTOL)


@pytest.mark.parametrize("case", ["decode_h64", "mtp2_h64"])
def test_cuda_graph_replay_follows_new_indices_and_lengths(case):
    """Capture forward_mqa once; then, as in the next step of a captured batch shape, the indexer writes new positions
    into its buffer and the runner writes shorter lengths into its persistent seq_lens (positions at or past a
    request's length must then be skipped), and the builder runs again on the same buffers. The replay must give the
    eager run's output on the new inputs, and the reference's."""
    ours, _, batch, common, cache, q = setup(case)
    md = ours.build_mapped(common)
    ours.forward_mqa(q, cache, md)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = ours.forward_mqa(q, cache, md)
    # The next step: every request one token shorter where it has more than its query tokens (the cache keeps the
    # dropped token, so only the length masks it), positions drawn for the new lengths plus each old last position.
    s_q = max(batch.query_lens)
    new_lens = [n - 1 if n > s_q else n for n in batch.seq_lens]
    positions = sp.draw_positions(new_lens, batch.query_lens, batch.num_tokens,
                                  torch.Generator().manual_seed(sum(new_lens) + 7), stale=False)
    t = 0
    for n, n_new, q_len in zip(batch.seq_lens, new_lens, batch.query_lens):
        for _ in range(q_len):
            if n_new < n:
                positions[t, -1] = n - 1   # written by the request's last step, past its new length: skipped
            t += 1
    batch.positions, batch.seq_lens = positions, new_lens
    ours.topk_buffer[: batch.num_tokens] = positions.to(DEVICE)
    common.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    lens_cpu = torch.tensor(new_lens, dtype=torch.int32)
    fields = {"max_seq_len": max(new_lens)}
    for name in ("_seq_lens_cpu", "seq_lens_cpu_upper_bound"):
        if getattr(common, name, None) is not None:
            fields[name] = lens_cpu.clone()
    md2 = ours.build_mapped(common.replace(**fields))
    assert md2.decode_sched_meta is md.decode_sched_meta  # filled ahead, kept for this batch shape
    graph.replay()
    torch.cuda.synchronize()
    eager, _ = ours.forward_mqa(q, cache, md2)
    torch.cuda.synchronize()
    mapped = sum(batch.query_lens)
    assert torch.equal(captured[:mapped], eager[:mapped])
    torch.testing.assert_close(captured[:mapped].float().cpu(), batch.expected(ours.scale)[:mapped].float(),
                               atol=sp.OUT_ATOL, rtol=sp.OUT_RTOL)
