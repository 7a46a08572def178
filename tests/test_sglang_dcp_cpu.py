"""Decode context parallelism (--dcp-size N) in the SGLang plugin, against SGLang's real classes on CPU.

SGLang's DCP KV layout (0.5.17-0.5.23): req_to_token holds widened slots from pages of 64 * N slots; slot s
belongs to rank s % N, stored at row s // N of that rank's MLATokenToKVPool (what set_mla_kv_buffer writes).
Each simulated rank here has its own runner and pool holding only its rows (every other row NaN), builds the
backend through SGLang's attention registry under SGLang's own parallel context (attn_dcp_size / _rank), and
decodes the query heads of the whole group; the ranks' (out, lse) are merged as SGLang's merge does
(correct_attn_out: lse in base 2 for backends other than its flashmla, +inf / NaN count as -inf) and compared
with the unsharded decode of flashmla_backend's CPU reference. SGLang's merge itself needs a process group and
a Triton kernel, so the merge here is a local one with the same arithmetic.

Run them with `bash tests/run.sh --engines` (SGLang in its own environment under .test-envs/).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

import test_sglang_cpu as base  # noqa: E402  (imports SGLang as those tests do: the torchvision stand-in)
import torch  # noqa: E402

import flashmla_backend  # noqa: E402
from flashmla_backend.geometry import HEAD_DIM_K, HEAD_DIM_V, PAGE_SIZE, ROPE_DIM  # noqa: E402
from flashmla_backend.sglang import BACKEND_NAME  # noqa: E402
from flashmla_backend.sglang import backend as sglang_backend  # noqa: E402
from flashmla_backend.sglang import hooks as plugin_hooks  # noqa: E402
from flashmla_backend.sglang.backend import check_model_runner  # noqa: E402
from flashmla_backend.sglang.metadata import dcp_local_lens  # noqa: E402

from sglang.srt.arg_groups import overrides  # noqa: E402
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.layers.dcp.layout import get_dcp_lens  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
import sglang.srt.models.deepseek_common.utils as deepseek_utils  # noqa: E402
import sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla as forward_mla  # noqa: E402

LOCAL_HEADS = 4  # query heads per rank before the DCP gather
SCALE = (128 + 64) ** -0.5


@pytest.fixture(autouse=True)
def no_speculation(monkeypatch):
    """SGLang's parallel context as it is; its speculative-decoding namespace is published only by a server
    (what the plugin reads of it: no speculation)."""
    monkeypatch.setattr(sglang_backend, "_runtime",
                        lambda: (get_parallel(), SimpleNamespace(speculative_eagle_topk=None,
                                                                 speculative_num_draft_tokens=0,
                                                                 speculative_algorithm=None)))


@pytest.fixture(autouse=True)
def absorb_list_restored():
    """route_dcp_decode adds our name to DeepSeek's list of absorbed-MLA backends: undo it after each test."""
    saved = list(deepseek_utils.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS)
    yield
    deepseek_utils.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS[:] = saved


def rank_context(size: int, rank: int):
    return get_parallel().override(attn_tp_size=1, attn_dcp_size=size, attn_dcp_rank=rank)


def runner_fields(**kw):
    """What check_model_runner reads from SGLang's ModelRunner, for a served configuration."""
    fields = dict(use_mla_backend=True, page_size=PAGE_SIZE, dtype=torch.bfloat16, kv_cache_dtype=torch.bfloat16,
                  kv_cache_dtype_str="auto", kv_index_translator=None,
                  model_config=SimpleNamespace(kv_lora_rank=HEAD_DIM_V, qk_rope_head_dim=ROPE_DIM))
    fields.update(kw)
    return SimpleNamespace(**fields)


# ---- selection ----------------------------------------------------------------------------------------

def test_without_dcp_the_runner_is_accepted():
    with get_parallel().override(attn_dcp_size=1):
        assert check_model_runner(runner_fields(), skip_prefill=False) == []


@pytest.mark.parametrize("size", [2, 4])
def test_dcp_with_a_16bit_cache_is_accepted(size):
    with rank_context(size, size - 1):
        assert get_parallel().attn_dcp_size == size
        assert check_model_runner(runner_fields(), skip_prefill=False) == []


def test_dcp_with_fp8_is_refused_naming_what_works():
    with rank_context(2, 0):
        (reason,) = check_model_runner(runner_fields(kv_cache_dtype=base.FP8, kv_cache_dtype_str="fp8_e4m3"),
                                       skip_prefill=False)
    assert "--dcp-size 2" in reason and "FP8" in reason and "16-bit KV cache" in reason


def test_dcp_with_speculative_decoding_is_refused(monkeypatch):
    monkeypatch.setattr(sglang_backend, "_runtime", lambda: (get_parallel(), SimpleNamespace(
        speculative_eagle_topk=1, speculative_num_draft_tokens=2, speculative_algorithm=None)))
    with rank_context(2, 1):
        (reason,) = check_model_runner(runner_fields(), skip_prefill=False)
    assert "speculative decoding" in reason and "--dcp-size 2" in reason


def test_server_args_decode_only_under_dcp():
    """SGLang's page-size pass (where the plugin checks server arguments): under --dcp-size ours may be the decode
    backend, not the prefill one, and the cache must be 16-bit."""
    view = base.page_view
    ok = overrides._mla_backend_page_constraints(view(prefill_attention_backend="flashinfer",
                                                      decode_attention_backend=BACKEND_NAME, dcp_size=2))
    assert ok == {"page_size": 64}
    for bad in (dict(attention_backend=BACKEND_NAME), dict(prefill_attention_backend=BACKEND_NAME,
                                                           decode_attention_backend=BACKEND_NAME)):
        with pytest.raises(ValueError, match="--prefill-attention-backend flashinfer"):
            overrides._mla_backend_page_constraints(view(dcp_size=2, **bad))
    with pytest.raises(ValueError, match="16-bit KV cache only"):
        overrides._mla_backend_page_constraints(view(prefill_attention_backend="flashinfer", dcp_size=2,
                                                     decode_attention_backend=BACKEND_NAME,
                                                     kv_cache_dtype="fp8_e4m3"))
    # without DCP ours still serves prefill
    assert overrides._mla_backend_page_constraints(view(attention_backend=BACKEND_NAME, dcp_size=1)) == {
        "page_size": 64}


def test_dcp_serve_command_parses_with_this_sglang():
    """integration/sglang_run.py serve --dcp 2: the launch_server command parses with this SGLang's own argument
    parser into ours as the decode backend only, flashinfer for prefill, TP 2 + DCP 2 (what the page-size pass
    above accepts), SGLang's custom all-reduce off (integration/sglang_dcp_run.py says why); without --dcp ours is
    the one attention backend."""
    import argparse
    import sys
    from pathlib import Path

    from sglang.srt.server_args import ServerArgs

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    import sglang_run

    def parsed(dcp):
        args = SimpleNamespace(model="/tmp/m", backend=BACKEND_NAME, kv_cache_dtype="auto", dcp=dcp,
                               dsa_decode_backend=None)
        cmd = sglang_run.launch_server_cmd(args, 30000)
        assert cmd[1:3] == ["-m", "sglang.launch_server"]
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        return parser.parse_args(cmd[3:])

    ns = parsed(2)
    assert (ns.prefill_attention_backend, ns.decode_attention_backend) == ("flashinfer", BACKEND_NAME)
    assert ns.attention_backend is None and (ns.tp_size, ns.dcp_size) == (2, 2) and ns.disable_custom_all_reduce
    assert ns.enforce_disable_flashinfer_allreduce_fusion
    ns = parsed(1)
    assert ns.attention_backend == BACKEND_NAME and ns.dcp_size in (None, 1) and not ns.disable_custom_all_reduce
    assert not ns.enforce_disable_flashinfer_allreduce_fusion


def test_dcp_engine_overrides_are_this_sglangs_server_arguments():
    """integration/sglang_dcp_run.py's sglang.Engine arguments are fields of this SGLang's ServerArgs."""
    import sys
    from pathlib import Path

    from sglang.srt.server_args import ServerArgs

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    import sglang_dcp_run

    kw = sglang_dcp_run.engine_overrides(2, "flashinfer", BACKEND_NAME)
    names = sglang_dcp_run.server_arg_names(ServerArgs)
    assert "dcp_size" in names and set(kw) <= names
    assert kw["dcp_size"] == kw["tp_size"] == 2 and kw["disable_custom_all_reduce"] is True
    assert kw["enforce_disable_flashinfer_allreduce_fusion"] is True


# ---- the simulated ranks -----------------------------------------------------------------------------

class ShardedRequests:
    """Requests on SGLang's DCP layout: widened pages of 64 * N slots, shuffled; position p of request b has
    widened slot own[b][p // (64N)] * 64N + p % (64N), owned by rank slot % N at its row slot // N."""

    def __init__(self, size: int, lens: list[int], seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.size, self.lens = size, lens
        span = PAGE_SIZE * size
        max_pages = (base.MAX_CONTEXT + PAGE_SIZE) // PAGE_SIZE - 1  # physical pages of one rank's pool, page 0 apart
        pages = (torch.randperm(max_pages - 1, generator=gen) + 1).tolist()
        self.req_rows = torch.randperm(base.POOL_REQS, generator=gen)[:len(lens)]
        self.slots, self.rows = [], []
        for n in lens:
            own = [pages.pop() for _ in range(-(-n // span))]
            self.slots.append(torch.tensor([own[p // span] * span + p % span for p in range(n)], dtype=torch.int64))
            self.rows.append(torch.randn((n, HEAD_DIM_K), generator=gen).to(torch.bfloat16))
        self.q = torch.randn((len(lens), LOCAL_HEADS * size, HEAD_DIM_K), generator=gen).to(torch.bfloat16)

    def install(self, runner, rank: int) -> None:
        """This rank's pool and req_to_token: its own rows at slot // N, NaN elsewhere (a wrong read shows)."""
        kv = runner.token_to_kv_pool.kv_buffer[0]
        kv.fill_(float("nan"))
        for b, (slots, rows) in enumerate(zip(self.slots, self.rows)):
            runner.req_to_token_pool.req_to_token[self.req_rows[b], :len(slots)] = slots.to(torch.int32)
            mine = slots % self.size == rank
            kv[slots[mine] // self.size, 0] = rows[mine]

    def forward_batch(self):
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        bs = len(self.lens)
        seq = torch.tensor(self.lens, dtype=torch.int32)
        return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=torch.zeros(bs, dtype=torch.int64),
                            req_pool_indices=self.req_rows.to(torch.int32), seq_lens=seq, seq_lens_cpu=seq.clone(),
                            out_cache_loc=torch.stack([s[-1] for s in self.slots]), seq_lens_sum=sum(self.lens),
                            positions=torch.tensor([n - 1 for n in self.lens], dtype=torch.int64))

    def unsharded(self):
        """Decode of every request over all its keys, by flashmla_backend's CPU reference through the public API."""
        bs, heads = len(self.lens), self.q.shape[1]
        width = max(-(-n // PAGE_SIZE) for n in self.lens)
        cache = torch.full((bs * width + 1, PAGE_SIZE, 1, HEAD_DIM_K), float("nan"), dtype=torch.bfloat16)
        table = torch.zeros((bs, width), dtype=torch.int32)
        for b, rows in enumerate(self.rows):
            for j in range(-(-len(rows) // PAGE_SIZE)):
                page = 1 + b * width + j
                chunk = rows[j * PAGE_SIZE:(j + 1) * PAGE_SIZE]
                cache[page, :len(chunk), 0] = chunk
                table[b, j] = page
        lens = torch.tensor(self.lens, dtype=torch.int32)
        md, splits = flashmla_backend.get_mla_metadata(lens, heads, 1)
        return flashmla_backend.flash_mla_with_kvcache(self.q.unsqueeze(1), cache, table, lens, HEAD_DIM_V, md, splits,
                                                       softmax_scale=SCALE)


def dcp_layer(size: int) -> RadixAttention:
    """DeepSeek's attn_mqa_for_dcp_decode: the group's heads (local heads x dcp size) on the shared latent head."""
    return RadixAttention(num_heads=LOCAL_HEADS * size, head_dim=HEAD_DIM_K, scaling=SCALE, num_kv_heads=1,
                          layer_id=0, v_head_dim=HEAD_DIM_V)


def run_rank(runners, req: ShardedRequests, rank: int):
    """Build the backend on rank `rank` and decode as DeepSeek's DCP path calls it (absorbed form, no KV write:
    the step's row is already in the pool). Returns (backend, out [bs, heads, 512], lse [bs, heads])."""
    with rank_context(req.size, rank):
        runner = runners()
        backend = ATTENTION_BACKENDS[BACKEND_NAME](runner)
        req.install(runner, rank)
        fb = req.forward_batch()
        backend.init_forward_metadata(fb)
        q = req.q
        out, lse = backend.forward(q[..., :HEAD_DIM_V].contiguous(), None, None, dcp_layer(req.size), fb,
                                   save_kv_cache=False, q_rope=q[..., HEAD_DIM_V:].contiguous(), k_rope=None)
    return backend, out.view(len(req.lens), -1, HEAD_DIM_V), lse


def merge_base2(outs, lses):
    """SGLang's DCP merge arithmetic (correct_attn_out + the reduce), lse in base 2: +inf / NaN as -inf."""
    lse = torch.stack(lses).float()
    lse = torch.where(torch.isnan(lse) | (lse == math.inf), torch.full_like(lse, -math.inf), lse)
    top = lse.max(dim=0).values
    top = torch.where(top == -math.inf, torch.zeros_like(top), top)
    total = torch.log2(torch.exp2(lse - top).sum(0)) + top
    weights = torch.nan_to_num(torch.exp2(lse - total), nan=0.0, posinf=0.0)
    return sum(w.unsqueeze(-1) * o.float() for w, o in zip(weights, outs)), total


@pytest.fixture
def runners():
    made = []

    def make():
        r = base.make_runner()
        made.append(r)
        return r

    yield make
    for r in reversed(made):
        base.restore_server_args(r)


CASES = [(2, [1, 63, 64, 300]), (2, [129, 200, 2, 65]), (3, [1, 2, 5, 400]), (3, [64, 191, 193, 3])]


@pytest.mark.parametrize("size,lens", CASES)
def test_metadata_is_the_local_shard(runners, size, lens):
    """Local lengths are SGLang's own get_dcp_lens (lengths not divisible by N, empty shards); page k of the local
    table holds position rank + 64 * N * k, at row slot // N of this rank's pool."""
    req = ShardedRequests(size, lens, seed=sum(lens))
    seen_empty = False
    for rank in range(size):
        backend, _, _ = run_rank(runners, req, rank)
        md = backend.decode_metadata
        want = get_dcp_lens(torch.tensor(lens), size, rank).tolist()
        assert md.cache_seqlens.tolist() == want
        seen_empty |= 0 in want
        for b, n in enumerate(want):
            for k in range(-(-n // PAGE_SIZE)):
                assert int(md.block_table[b, k]) == int(req.slots[b][rank + PAGE_SIZE * size * k]) // size // PAGE_SIZE
            assert not md.block_table[b, -(-n // PAGE_SIZE):].any()
        plan_md, plan_splits = flashmla_backend.get_mla_metadata(md.cache_seqlens, LOCAL_HEADS * size, 1)
        assert torch.equal(md.tile_scheduler_metadata, plan_md) and torch.equal(md.num_splits, plan_splits)
    if lens[0] == 1:
        assert seen_empty


def test_local_lengths_match_sglang():
    lens = torch.arange(0, 400)
    for size in (2, 3, 4, 8):
        for rank in range(size):
            assert torch.equal(dcp_local_lens(lens, size, rank), get_dcp_lens(lens, size, rank))


@pytest.mark.parametrize("size,lens", CASES[:1] + CASES[2:3])
def test_lse_layout_and_base(runners, size, lens):
    """lse [bs, heads] float32 in base 2 (SGLang reads every backend but its flashmla's as base 2): each rank's is
    the natural-log lse of the reference over that rank's keys, times log2(e); an empty shard gives +inf."""
    req = ShardedRequests(size, lens, seed=7)
    for name in ("is_mla_dcp_lse_base_on_e", "_is_mla_dcp_lse_base_on_e"):
        fn = getattr(forward_mla, name, None)
        if fn is not None:
            assert fn(BACKEND_NAME) is False and fn("flashmla") is True
            break
    else:
        pytest.fail("SGLang's base-of-lse predicate not found in forward_mla")
    for rank in range(size):
        _, out, lse = run_rank(runners, req, rank)
        assert lse.shape == (len(lens), LOCAL_HEADS * size) and lse.dtype == torch.float32
        assert out.shape == (len(lens), LOCAL_HEADS * size, HEAD_DIM_V)
        for b, n in enumerate(lens):
            keys = req.rows[b][torch.arange(n) % size == rank].float()
            if len(keys) == 0:
                assert torch.all(lse[b] == math.inf)
                continue
            natural = torch.logsumexp(req.q[b].float() @ keys.T * SCALE, dim=-1)
            torch.testing.assert_close(lse[b], natural / math.log(2.0), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("size,lens", CASES)
def test_merged_ranks_equal_the_unsharded_decode(runners, size, lens):
    req = ShardedRequests(size, lens, seed=3 * sum(lens))
    outs, lses = [], []
    for rank in range(size):
        _, out, lse = run_rank(runners, req, rank)
        assert torch.isfinite(out).all()  # NaN rows of other ranks, other pages and page 0 never read
        outs.append(out)
        lses.append(lse)
    merged, total = merge_base2(outs, lses)
    want_out, want_lse = req.unsharded()
    # Each rank's partial output is rounded to bf16 before the merge (as on the GPU); the lse is fp32 throughout.
    torch.testing.assert_close(total, want_lse[..., 0] / math.log(2.0), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(merged, want_out[:, 0].float(), atol=1e-2, rtol=1e-2)


def test_decode_routed_through_deepseeks_dcp_path(runners):
    """Building the backend under DCP puts our name in DeepSeek's absorbed-MLA list, the only route to its DCP
    decode (gathered heads, (out, lse) merged); without DCP nothing changes."""
    names = deepseek_utils.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS
    assert forward_mla.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS is names
    with rank_context(1, 0):
        ATTENTION_BACKENDS[BACKEND_NAME](runners())
    assert BACKEND_NAME not in names
    req = ShardedRequests(2, [5], seed=1)
    run_rank(runners, req, 0)
    assert names.count(BACKEND_NAME) == 1
    run_rank(runners, req, 1)
    assert names.count(BACKEND_NAME) == 1


def test_new_token_written_through_set_mla_kv_buffer(runners, monkeypatch):
    """The step's row goes to the pool's DCP-aware door (set_mla_kv_buffer with the widened location, which keeps
    the rows this rank owns), never set_kv_buffer (which SGLang 0.5.21+ refuses under DCP)."""
    req = ShardedRequests(2, [10, 3], seed=5)
    calls = []
    with rank_context(2, 1):
        runner = runners()
        backend = ATTENTION_BACKENDS[BACKEND_NAME](runner)
        req.install(runner, 1)
        fb = req.forward_batch()
        backend.init_forward_metadata(fb)
        pool = runner.token_to_kv_pool
        monkeypatch.setattr(pool, "set_mla_kv_buffer", lambda *a: calls.append(a))
        monkeypatch.setattr(pool, "set_kv_buffer", lambda *a, **k: pytest.fail("set_kv_buffer under DCP"))
        k_nope = torch.randn((2, 1, HEAD_DIM_V)).to(torch.bfloat16)
        k_rope = torch.randn((2, 1, ROPE_DIM)).to(torch.bfloat16)
        q = req.q
        layer = dcp_layer(2)
        backend.forward(q[..., :HEAD_DIM_V].contiguous(), k_nope, k_nope, layer, fb, save_kv_cache=True,
                        q_rope=q[..., HEAD_DIM_V:].contiguous(), k_rope=k_rope)
    ((got_layer, loc, got_nope, got_rope),) = calls
    assert got_layer is layer and got_nope is k_nope and got_rope is k_rope
    loc = getattr(loc, "loc", loc)
    assert torch.equal(torch.as_tensor(loc), fb.out_cache_loc)


def test_extend_under_dcp_is_refused(runners):
    with rank_context(2, 0):
        backend = ATTENTION_BACKENDS[BACKEND_NAME](runners())
        fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND)
        with pytest.raises(RuntimeError, match="serves only decode under decode context parallelism"):
            backend.forward_extend(None, None, None, dcp_layer(2), fb)
