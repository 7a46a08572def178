"""Decode context parallelism (DCP) in the vLLM plugin, on CPU against vLLM's real classes.

What vLLM does with DCP N (read in 0.26.0 and 0.33.0): every rank keeps the tokens of a request whose
position p has (p // I) % N == its rank (I = --cp-kv-cache-interleave-size), gathers the decode queries of
the N ranks by head, runs the backend's forward_mqa on its shard and merges the N (out, lse) pairs by lse.
Here a DCP group is simulated in one process: vLLM's DCP group object is a stand-in holding world size and
rank (vLLM's own unit tests run without a group too), each simulated rank gets its own paged cache, filled
with the placement formula of vLLM's slot-mapping kernel, and the rank-local lengths of vLLM's
get_dcp_local_seq_lens. The plugin's builder and impl run per rank as vLLM runs them; the ranks are merged
with the release's own CPU merge (_lse_weighted_combine, the reference of its DCP combine kernels) and
compared with the unsharded decode. CPU tensors run flashmla_backend's PyTorch reference behind the same
public API.

Run them with `bash tests/run.sh --engines` (vLLM in its own environment under .test-envs/).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

import flashmla_backend  # noqa: E402
from flashmla_backend import engine_support  # noqa: E402
from flashmla_backend._versions import in_range  # noqa: E402
from flashmla_backend.reference import mla_decode_reference  # noqa: E402
from flashmla_backend.vllm import register  # noqa: E402
from flashmla_backend.vllm.backend import FlashMLAPluginBackend  # noqa: E402
from flashmla_backend.vllm.builder import dcp_interleave_problem  # noqa: E402
from flashmla_backend.vllm.impl import FlashMLAPluginImpl, lse_for_merge  # noqa: E402

import test_vllm_cpu as base  # noqa: E402  (the plugin as a vLLM worker builds it; tests/ is on sys.path)

from vllm.config.vllm import set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens  # noqa: E402

HEAD, LATENT, KERNEL_BLOCK = base.HEAD, base.LATENT, base.KERNEL_BLOCK
FP8 = torch.float8_e4m3fn
V033 = in_range(vllm.__version__, (0, 33, 0), (1, 0, 0))


def release_merge():
    """vLLM's CPU reference of its DCP combine: _lse_weighted_combine(outputs [N, T, H, D], lses [N, T, H],
    return_lse, is_lse_base_on_e) -> (out [T, H, D], lse [T, H]). 0.33: vllm/v1/attention/ops/dcp.py;
    0.26: vllm/v1/attention/ops/dcp_alltoall.py."""
    try:
        from vllm.v1.attention.ops.dcp import _lse_weighted_combine
    except ImportError:
        from vllm.v1.attention.ops.dcp_alltoall import _lse_weighted_combine
    return _lse_weighted_combine


def test_the_release_merge_is_importable_on_cpu():
    """The merge below is vLLM's, not a copy: fail loudly if a release moves it."""
    assert callable(release_merge())


# ---- a simulated DCP group -----------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def registered():
    register()
    yield


@pytest.fixture
def dcp(monkeypatch):
    """dcp(size, rank): vLLM's DCP group as its attention classes read it (world_size, rank_in_group)."""
    from vllm.distributed import parallel_state

    if V033:  # 0.33's MLA builder takes the layer's DCP collective manager; it is only stored on this path
        from vllm.v1.attention.ops.dcp import MLADCPManager

        class NoCollectives(MLADCPManager):
            def __init__(self):
                pass

            def init_kv_gather(self, *args, **kwargs):
                pass

        monkeypatch.setattr(base.LayerDouble, "dcp_manager", NoCollectives(), raising=False)

    # vLLM needs its chunked-prefill workspace (decode-only batches never use it) to split evenly over the DCP
    # ranks; the tiny config's default does for 2 ranks, not for 3: round it down to a multiple of 12.
    from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder

    workspace = MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size
    monkeypatch.setattr(MLACommonMetadataBuilder, "determine_chunked_prefill_workspace_size",
                        staticmethod(lambda cfg: workspace(cfg) // 12 * 12))

    def set_group(size: int, rank: int = 0):
        monkeypatch.setattr(parallel_state, "_DCP", SimpleNamespace(world_size=size, rank_in_group=rank))

    return set_group


def dcp_config(size: int, interleave: int = 1, manager_block_size: int = 64, **kw):
    cfg = base.vllm_config(manager_block_size, **kw)
    cfg.parallel_config.decode_context_parallel_size = size
    cfg.parallel_config.cp_kv_cache_interleave_size = interleave
    return cfg


def rank_plugins(dcp, cfg, size: int) -> list:
    """One plugin (builder + impl) per simulated rank, each made while the DCP group says that rank."""
    plugins = []
    for rank in range(size):
        dcp(size, rank)
        plugins.append(base.Plugin(cfg))
    return plugins


# ---- sharded batches -----------------------------------------------------------------------------

class ShardedBatch:
    """A decode batch (s_q = 1) whose KV cache is sharded over N ranks as vLLM's DCP shards it.

    seq_lens[i] tokens of request i, 0 marking a CUDA-graph padding request. The KV manager hands out
    blocks of M tokens per rank (M * N tokens per virtual block); one block table, a random permutation of
    block ids 1.. (0 is the null block), serves all ranks, each rank holding its own cache. Position p goes
    to rank (o // I) % N at row (o // (N * I)) * I + o % I of block table[p // (M * N)], o = p % (M * N)
    (vLLM's slot-mapping kernel). Slots no rank's token owns hold NaN. q holds the gathered heads.
    """

    def __init__(self, seq_lens: list[int], *, size: int, interleave: int, manager_block_size: int, heads: int,
                 dtype=torch.bfloat16, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        N, I, M = size, interleave, manager_block_size
        k = M // KERNEL_BLOCK
        self.seq_lens, self.size, self.dtype, self.heads = seq_lens, size, dtype, heads
        B = len(seq_lens)
        self.tokens = [torch.randn((n, HEAD), generator=gen).to(dtype) for n in seq_lens]
        per_req = [-(-n // (M * N)) for n in seq_lens]
        num_blocks = sum(per_req) + 2 + 1
        perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        width = max(max(per_req), 1) + 1
        self.manager_table = torch.zeros((B, width), dtype=torch.int32)
        self.caches = [torch.full((num_blocks * k, KERNEL_BLOCK, HEAD), float("nan"), dtype=dtype) for _ in range(N)]
        self.owned = [[0] * B for _ in range(N)]
        for i, n in enumerate(seq_lens):
            blocks = [perm.pop() for _ in range(per_req[i])]
            self.manager_table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            for p in range(n):
                v, o = divmod(p, M * N)
                rank = (o // I) % N
                slot = blocks[v] * M + (o // (N * I)) * I + o % I
                self.caches[rank][slot // KERNEL_BLOCK, slot % KERNEL_BLOCK] = self.tokens[i][p]
                self.owned[rank][i] += 1
        self.q = torch.randn((B, heads, HEAD), generator=gen).to(dtype)  # [T = B, gathered heads, 576]
        self.kernel_tables = [torch.tensor([[b * k + j for b in row for j in range(k)] for row in
                                            self.manager_table.tolist()], dtype=torch.int32)]

    def local_lens(self, rank: int, interleave: int) -> torch.Tensor:
        """vLLM's own rank-local lengths (what its model runner puts in dcp_local_seq_lens)."""
        lens = get_dcp_local_seq_lens(torch.tensor(self.seq_lens, dtype=torch.int32), self.size, rank, interleave)
        assert lens.tolist() == self.owned[rank]  # the placement above is the one vLLM counts
        return lens.to(torch.int32)

    def common(self, rank: int, interleave: int):
        """vLLM's CommonAttentionMetadata for this rank: full lengths, the rank's lengths, the block table."""
        B = len(self.seq_lens)
        q_lens = [1 if n > 0 else 0 for n in self.seq_lens]
        qsl = torch.zeros(B + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
        seq = torch.tensor(self.seq_lens, dtype=torch.int32)
        local = self.local_lens(rank, interleave)
        return base.common_attn_metadata(
            query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=seq.clone(), num_reqs=B,
            num_actual_tokens=B, max_query_len=1, max_seq_len=max(self.seq_lens), block_table_tensor=self.manager_table,
            slot_mapping=torch.zeros(B, dtype=torch.int64), causal=True, _seq_lens_cpu=seq.clone(),
            seq_lens_cpu_upper_bound=seq.clone(), is_prefilling=torch.zeros(B, dtype=torch.bool),
            dcp_local_seq_lens=local.clone(), dcp_local_seq_lens_cpu=local.clone(),
            dcp_local_seq_lens_cpu_upper_bound=local.clone())

    def unsharded(self, scale: float, *, q=None, k_scale: float | None = None, q_scale: float | None = None,
                  compute=None):
        """The decode over every token of each request, one rank's view of nothing: (out [T, H, 512], lse [T, H]).

        k_scale: the rows as an FP8 cache stores them; q (e4m3) with q_scale: the fast mode's query;
        compute: run in this dtype (fp64 for the merge-math check)."""
        B = len(self.seq_lens)
        q = self.q if q is None else q
        pages = [max(-(-n // KERNEL_BLOCK), 0) for n in self.seq_lens]
        stored = FP8 if k_scale is not None else (compute or self.dtype)
        dense = torch.zeros((max(sum(pages), 1), KERNEL_BLOCK, 1, HEAD), dtype=stored)
        table = torch.zeros((B, max(max(pages), 1)), dtype=torch.int32)
        start = 0
        for i, rows in enumerate(self.tokens):
            flat = dense[start: start + pages[i]].view(-1, HEAD)
            flat[: rows.shape[0]] = (rows.float() / k_scale).to(FP8) if k_scale is not None else rows.to(stored)
            table[i, : pages[i]] = torch.arange(start, start + pages[i], dtype=torch.int32)
            start += pages[i]
        scales = {}
        if k_scale is not None:
            scales["descale_k"] = torch.tensor([k_scale], dtype=torch.float32)
        if q.dtype == FP8:
            scales["descale_q"] = torch.tensor([q_scale], dtype=torch.float32)
        elif compute is not None:
            q = q.to(compute)
        out, lse = mla_decode_reference(q.reshape(B, 1, self.heads, HEAD), dense, table,
                                        torch.tensor(self.seq_lens, dtype=torch.int32), LATENT, softmax_scale=scale,
                                        compute_dtype=compute or torch.float32, **scales)
        return out.reshape(B, self.heads, LATENT), lse_for_merge(lse)


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor], base_e: bool = True):
    """The N ranks' (out [T, H, 512], lse [T, H]) merged by vLLM's CPU reference merge, in fp32 or wider."""
    wide = torch.float64 if outs[0].dtype == torch.float64 else torch.float32
    return release_merge()(torch.stack([o.to(wide) for o in outs]), torch.stack([x.to(wide) for x in lses]),
                           return_lse=True, is_lse_base_on_e=base_e)


# ---- the impl's declarations, per release --------------------------------------------------------

def test_impl_declares_dcp_support_with_a_natural_log_lse():
    assert FlashMLAPluginImpl.can_return_lse_for_decode is True
    assert FlashMLAPluginImpl.supports_dcp is True
    assert FlashMLAPluginImpl.lse_base_on_e is True
    assert FlashMLAPluginImpl.supports_mtp_with_cp_non_trivial_interleave_size is False
    if hasattr(FlashMLAPluginBackend, "supports_dcp"):  # 0.33's selector asks the backend, which asks the impl
        assert FlashMLAPluginBackend.supports_dcp()


@pytest.mark.parametrize("size", [1, 2])
def test_impl_returns_the_lse_only_when_vllm_asks(dcp, size):
    dcp(size)
    plugin = base.Plugin(dcp_config(size))
    assert plugin.impl.need_to_return_lse_for_decode is (size > 1)  # set by vLLM from the group, per rank
    assert plugin.impl.dcp_world_size in (size, -1)  # 0.26 fills it in at the layer's first forward


def test_selection_with_dcp_accepts_the_plugin():
    """0.33 passes use_dcp to validate_configuration ("DCP not supported" for impls without supports_dcp);
    0.26 selects without it. Either way the plugin is valid with DCP."""
    from vllm.v1.attention.selector import AttentionSelectorConfig

    fields = dict(head_size=HEAD, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=64, use_mla=True,
                  has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                  attn_type="decoder", use_dcp=True)
    selector = AttentionSelectorConfig(**{k: v for k, v in fields.items() if k in AttentionSelectorConfig._fields})
    assert FlashMLAPluginBackend.validate_configuration(device_capability=base.HOPPER, **selector._asdict()) == []
    if "use_dcp" in AttentionSelectorConfig._fields:
        class Refusing(FlashMLAPluginImpl):
            supports_dcp = False

        class RefusingBackend(FlashMLAPluginBackend):
            @staticmethod
            def get_impl_cls():
                return Refusing

        reasons = RefusingBackend.validate_configuration(device_capability=base.HOPPER, **selector._asdict())
        assert "DCP not supported" in reasons  # the check the plugin's declaration answers


def cp_check(cfg, impl):
    """vLLM's start-up DCP check (vllm/v1/worker/cp_utils.py) on an attention layer holding `impl`."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.worker.cp_utils import check_attention_cp_compatibility

    class Layer(AttentionLayerBase):
        def __init__(self):
            self.impl = impl

        def get_attn_backend(self):
            return FlashMLAPluginBackend

        def get_kv_cache_spec(self, vllm_config):
            return None

    cfg.compilation_config.static_forward_context["model.layers.9.self_attn.attn"] = Layer()
    check_attention_cp_compatibility(cfg)


def test_vllms_start_up_dcp_check_accepts_the_plugin(dcp):
    dcp(2)
    cfg = dcp_config(2)
    plugin = base.Plugin(cfg)
    cp_check(cfg, plugin.impl)


def test_mtp_with_an_interleave_above_one_is_refused_by_vllm(dcp):
    """vLLM refuses speculative decoding with --cp-kv-cache-interleave-size > 1 for impls that do not declare
    supports_mtp_with_cp_non_trivial_interleave_size; the plugin does not (its causal mask needs contiguous keys)."""
    dcp(2)
    cfg = dcp_config(2, interleave=2, query_len=2)
    plugin = base.Plugin(cfg)
    with pytest.raises(AssertionError, match="MTP with cp_kv_cache_interleave_size > 1.*FlashMLAPluginImpl"):
        cp_check(cfg, plugin.impl)


def test_spec_decode_with_dcp_verifies_through_prefill(dcp):
    """With DCP vLLM lowers the decode threshold to 1 for builders without supports_dcp_with_varlen, so MTP
    verification batches (query length 2..) go to the prefill path and the decode kernel sees s_q = 1 only."""
    dcp(2)
    plugin = base.Plugin(dcp_config(2, query_len=3))
    assert plugin.builder.reorder_batch_threshold == 1
    dcp(1)
    plugin = base.Plugin(base.vllm_config(64, query_len=3))
    assert plugin.builder.reorder_batch_threshold == 128  # without DCP: the plugin's own, above 1 + 2 drafts


def test_multi_token_decode_under_dcp_is_refused(dcp):
    dcp(2)
    plugin = base.Plugin(dcp_config(2))
    seq = torch.tensor([70, 300], dtype=torch.int32)
    with pytest.raises(ValueError, match="causal mask.*contiguous"):
        plugin.builder._build_decode(
            block_table_tensor=torch.zeros((2, 8), dtype=torch.int32), seq_lens_device=seq, max_seq_len=300,
            query_start_loc_cpu=torch.tensor([0, 2, 4], dtype=torch.int32),
            query_start_loc_device=torch.tensor([0, 2, 4], dtype=torch.int32), num_decode_tokens=4,
            dcp_tot_seq_lens_device=seq * 2)


@pytest.mark.parametrize("interleave,block_size", [(1, 64), (2, 64), (64, 64), (128, 256), (3, 192)])
def test_interleave_sizes_that_divide_the_block_size_work(interleave, block_size):
    assert dcp_interleave_problem(interleave, block_size) is None


@pytest.mark.parametrize("interleave,block_size", [(3, 64), (128, 64), (0, 64)])
def test_other_interleave_sizes_are_refused_naming_what_works(dcp, interleave, block_size):
    problem = dcp_interleave_problem(interleave, block_size)
    assert problem is not None and f"interleave-size {interleave}" in problem
    assert "1, 2, 4, 8, 16, 32, 64" in problem
    if interleave < 1:
        return  # vLLM's own builder divides by it before the plugin's check runs (0.33: ZeroDivisionError)
    dcp(2)
    cfg = dcp_config(2, interleave=interleave, manager_block_size=block_size)
    with pytest.raises(ValueError, match="1, 2, 4, 8, 16, 32, 64"):
        base.Plugin(cfg)


# ---- metadata for the local shard ----------------------------------------------------------------

@pytest.mark.parametrize("full_cuda_graphs", [False, True])
def test_metadata_is_built_for_the_local_shard(dcp, full_cuda_graphs):
    size, interleave = 2, 1
    cfg = dcp_config(size, interleave, manager_block_size=128, full_cuda_graphs=full_cuda_graphs)
    heads = cfg.model_config.get_num_attention_heads(cfg.parallel_config)
    seq_lens = [1, 77, 500, 0]  # rank 1 holds nothing of request 0; request 3 is CUDA-graph padding
    batch = ShardedBatch(seq_lens, size=size, interleave=interleave, manager_block_size=128, heads=heads * size)
    for rank, plugin in enumerate(rank_plugins(dcp, cfg, size)):
        assert plugin.builder.num_q_heads == heads * size and plugin.builder.plan.num_q_heads == heads * size
        md = plugin.build(batch.common(rank, interleave))
        local = batch.local_lens(rank, interleave)
        assert md.decode.seq_lens.tolist() == local.tolist() == batch.owned[rank]
        assert md.decode.dcp_tot_seq_lens.tolist() == seq_lens
        assert md.decode.num_q_heads == heads * size and md.decode.query_len == 1
        for i, n in enumerate(batch.owned[rank]):  # the rank's pages, in 64-token kernel blocks
            pages = -(-n // KERNEL_BLOCK)
            assert md.decode.block_table[i, :pages].tolist() == batch.kernel_tables[0][i, :pages].tolist()
        want_md, want_splits = flashmla_backend.get_mla_metadata(local, heads * size, 1)
        assert torch.equal(md.decode.tile_scheduler_metadata, want_md)
        assert torch.equal(md.decode.num_splits, want_splits)
        if full_cuda_graphs:
            plan = plugin.builder.plan
            assert md.decode.tile_scheduler_metadata.data_ptr() == plan.cg_tile_scheduler_metadata.data_ptr()
            assert md.decode.num_splits.data_ptr() == plan.cg_num_splits.data_ptr()


def test_forward_mqa_refuses_queries_that_were_not_gathered(dcp):
    """A rank's own heads only (the DCP all-gather missing) would run a plan made for other shapes."""
    size = 2
    cfg = dcp_config(size)
    heads = cfg.model_config.get_num_attention_heads(cfg.parallel_config)
    batch = ShardedBatch([40, 90], size=size, interleave=1, manager_block_size=64, heads=heads, seed=3)
    (plugin, _) = rank_plugins(dcp, cfg, size)
    md = plugin.build(batch.common(0, 1))
    with pytest.raises(RuntimeError, match=f"{heads} query heads.*planned for {heads * size}"):
        plugin.forward_mqa(batch.q, batch.caches[0], md)


# ---- lse: layout and base ------------------------------------------------------------------------

def test_lse_for_merge_is_token_major():
    lse = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)  # [batch 2, heads 3, s_q 4]
    flat = lse_for_merge(lse)
    assert flat.shape == (8, 3) and flat.is_contiguous()
    for b in range(2):
        for s in range(4):
            assert flat[b * 4 + s].tolist() == lse[b, :, s].tolist()  # row = request b's query token s


def test_forward_mqa_lse_is_natural_log_per_token_and_head(dcp):
    size = 2
    cfg = dcp_config(size)
    heads = cfg.model_config.get_num_attention_heads(cfg.parallel_config) * size
    batch = ShardedBatch([1, 3, 130, 0], size=size, interleave=1, manager_block_size=64, heads=heads, seed=4)
    plugins = rank_plugins(dcp, cfg, size)
    for rank, plugin in enumerate(plugins):
        out, lse = plugin.forward_mqa(batch.q, batch.caches[rank], plugin.build(batch.common(rank, 1)))
        assert lse.shape == (len(batch.seq_lens), heads) and lse.dtype == torch.float32 and lse.is_contiguous()
        for i, n in enumerate(batch.seq_lens):
            mine = [batch.tokens[i][p].float() for p in range(n) if p % size == rank]
            if not mine:  # this rank holds none of request i's tokens: out 0 and lse +inf (FlashMLA's convention)
                assert torch.isposinf(lse[i]).all() and not out[i].any()
                continue
            scores = torch.einsum("hd,nd->hn", batch.q[i].float(), torch.stack(mine)) * plugin.scale
            torch.testing.assert_close(lse[i], torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)
            assert not torch.allclose(lse[i], torch.logsumexp(scores, -1) / math.log(2), rtol=1e-3)


# ---- merged ranks against the unsharded decode ---------------------------------------------------

MERGE_CASES = {
    # name: (DCP size, interleave, manager block size, seq_lens); 0 = CUDA-graph padding request
    "dcp2_i1": (2, 1, 64, [1, 2, 3, 65, 129, 777, 1001]),
    "dcp3_i1": (3, 1, 64, [1, 2, 4, 100, 301, 1000]),
    "dcp2_i8_bs128": (2, 8, 128, [5, 9, 17, 250, 999]),
    "dcp3_i64_bs64": (3, 64, 64, [1, 63, 64, 65, 130, 200, 700]),
    "dcp2_padded": (2, 1, 256, [1, 700, 0, 0]),
}


@pytest.mark.parametrize("case", list(MERGE_CASES))
def test_merged_ranks_match_the_unsharded_decode_in_fp64(case):
    """The sharding and the merge alone, in fp64 through the reference the CPU path runs: each rank's share
    read through its paged cache and kernel block table, merged by vLLM's merge, equals the unsharded decode
    to fp32 precision and better (empty shards included)."""
    size, interleave, M, seq_lens = MERGE_CASES[case]
    heads, scale = 8, 0.0917
    batch = ShardedBatch(seq_lens, size=size, interleave=interleave, manager_block_size=M, heads=heads,
                         dtype=torch.float64, seed=len(seq_lens) + size)
    q = batch.q.reshape(len(seq_lens), 1, heads, HEAD)
    outs, lses = [], []
    for rank in range(size):
        local = batch.local_lens(rank, interleave)
        out, lse = mla_decode_reference(q, batch.caches[rank].unsqueeze(-2), batch.kernel_tables[0], local, LATENT,
                                        softmax_scale=scale, compute_dtype=torch.float64)
        outs.append(out.reshape(len(seq_lens), heads, LATENT))
        lses.append(lse_for_merge(lse))
        empty = local == 0
        assert torch.isposinf(lses[-1][empty]).all() and not outs[-1][empty].any()
    assert any((batch.local_lens(r, interleave) == 0).any() and max(seq_lens) > 0 for r in range(size))
    merged, merged_lse = merge(outs, lses)
    want, want_lse = batch.unsharded(scale, compute=torch.float64)
    real = torch.tensor(seq_lens) > 0
    torch.testing.assert_close(merged[real], want[real].to(merged.dtype), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(merged_lse[real], want_lse[real].to(merged_lse.dtype), rtol=1e-6, atol=1e-6)
    assert not merged[~real].any()


PLUGIN_CASES = {
    # name: (DCP size, interleave, manager block size, seq_lens, KV cache, FP8 mode)
    "dcp2_bf16": (2, 1, 64, [1, 2, 3, 65, 129, 777, 1001], "auto", None),
    "dcp3_bf16_bs128": (3, 1, 128, [1, 2, 4, 100, 301, 1000], "auto", None),
    "dcp2_i64_bf16": (2, 64, 64, [1, 63, 64, 65, 130, 700], "auto", None),
    "dcp3_bf16_padded": (3, 2, 64, [5, 900, 0], "auto", None),
    "dcp2_fp8_accurate": (2, 1, 64, [1, 2, 3, 65, 777, 1001], "fp8", "accurate"),
    "dcp3_fp8_fast": (3, 1, 256, [1, 2, 4, 301, 1000], "fp8", "fast"),
    "dcp2_i64_fp8_accurate": (2, 64, 128, [1, 63, 64, 65, 130, 700], "fp8", "accurate"),
    "dcp2_i64_fp8_fast": (2, 64, 128, [1, 63, 64, 65, 130, 700], "fp8", "fast"),
}


@pytest.mark.parametrize("case", list(PLUGIN_CASES))
def test_plugin_ranks_merged_match_the_unsharded_decode(dcp, monkeypatch, case):
    """Each simulated rank runs vLLM's builder (with the rank-local lengths vLLM computes) and the plugin's
    forward_mqa on its own cache shard; vLLM's merge of the N results equals the unsharded decode: the lse to
    fp32 precision, the output to the 16-bit rounding of each rank's output."""
    size, interleave, M, seq_lens, kv_dtype, mode = PLUGIN_CASES[case]
    if mode is not None:
        monkeypatch.setenv(engine_support.FP8_MODE_ENV, mode)
    cfg = dcp_config(size, interleave, manager_block_size=M, kv_cache_dtype=kv_dtype)
    heads = cfg.model_config.get_num_attention_heads(cfg.parallel_config) * size
    batch = ShardedBatch(seq_lens, size=size, interleave=interleave, manager_block_size=M, heads=heads,
                         seed=sum(seq_lens) + size)
    plugins = rank_plugins(dcp, cfg, size)
    k_scale, q_scale = (0.05, 0.03) if kv_dtype == "fp8" else (None, None)
    q = batch.q
    if mode == "fast":
        q = (batch.q.float() / q_scale).clamp(-448.0, 448.0).to(FP8)  # vLLM's concat + quant, before the gather
    outs, lses = [], []
    for rank, plugin in enumerate(plugins):
        assert plugin.impl.need_to_return_lse_for_decode
        cache = batch.caches[rank]
        if k_scale is not None:
            plugin.layer.set_scales(k_scale, q_scale)
            cache = (cache.float() / k_scale).to(FP8).view(torch.uint8)  # vLLM's FP8 cache bytes
        with set_current_vllm_config(cfg):
            md = plugin.build(batch.common(rank, interleave))
        out, lse = plugin.forward_mqa(q, cache, md)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        outs.append(out)
        lses.append(lse)
    merged, merged_lse = merge(outs, lses, base_e=plugins[0].impl.lse_base_on_e)
    want, want_lse = batch.unsharded(plugins[0].scale, q=q, k_scale=k_scale, q_scale=q_scale)
    real = torch.tensor(seq_lens) > 0
    torch.testing.assert_close(merged_lse[real], want_lse[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged[real], want[real].float(), atol=base.OUT_ATOL, rtol=base.OUT_RTOL)
    assert not merged[~real].any()
    # Any one rank alone is not the answer (the merge matters), and the merge is not a plain average.
    assert (outs[0][real].float() - want[real].float()).abs().max() > 0.05
    assert (torch.stack([o.float() for o in outs]).mean(0)[real] - want[real].float()).abs().max() > 0.02
