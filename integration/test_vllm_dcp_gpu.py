"""Decode context parallelism (DCP) on two GPUs: the plugin at DCP 2 against the unsharded decode.

    python -m pytest integration/test_vllm_dcp_gpu.py -v        (2+ GPUs, vLLM 0.26.0; skipped on fewer)

Layer tests (test_layer_*): two processes (torch.multiprocessing, NCCL), vLLM's distributed state with tensor
parallel 2 and DCP 2 (the DCP group is the two TP ranks). Each rank builds the plugin as a vLLM worker does
(vLLM's AttentionGroup, the plugin's builder on the rank's GPU, the impl), fills its own paged cache with its
share of every request (vLLM's placement: position p on rank (p // I) % 2; tests/test_vllm_dcp_cpu.py's
ShardedBatch, same seed on both ranks), builds metadata from vLLM's rank-local lengths, runs forward_mqa with
the 16 gathered query heads on the kernel, and merges through the release's own collective: 0.26
cp_lse_ag_out_rs over vLLM's DCP group (all-gather of lse, Triton correction, reduce-scatter by head), 0.33
the layer's MLADCPManager.combine. Each rank's 8 heads must match the fp32 unsharded reference (MHA-free,
absorbed form) within atol = rtol = 1e-2 (the FP8 fast mode, whose kernel rounds P to e4m3: relative norm below
4e-2); lengths not divisible by 2 and requests with no token on one rank
included; bf16 and FP8 caches (the FP8 accurate mode at interleave 1 and 64, the fast mode with vLLM's e4m3 q);
interleave 1 and 64.

Engine tests (test_engine_*): the tiny DeepSeek-V3 checkpoint at TP 2 + DCP 2 through integration/vllm_dcp_run.py
(vllm_run.py with --decode-context-parallel-size), CUDA graphs on: ours (CUSTOM) against vLLM's FLASHMLA at the
same DCP (the engine test's comparison: greedy tokens and logprobs, near-tie flips judged by the fp32 model),
ours at DCP 2 against ours at TP 2 without DCP (printed: the other layers reduce in another order), the
scale-breaking hook must fail the comparison, and the KV capacity vLLM logs ("GPU KV cache size") must grow
with DCP (each rank keeps half the tokens: about 2x, at least 1.8x asserted).
Serving (test_serve_dcp2_*): `vllm serve` at TP 2 + DCP 2 with the engine test's 64 concurrent completions, 16-bit
and FP8 caches; every response complete, our DCP decode line in the server log.
Throughput (ours vs FLASHMLA at DCP 2, alternating): integration/README.md gives the commands.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip(f"decode context parallelism needs 2 GPUs; this machine has {torch.cuda.device_count()}",
                allow_module_level=True)

import harness  # noqa: E402

INTEGRATION = Path(__file__).resolve().parent
TESTS = INTEGRATION.parent / "tests"
WORLD = 2
ATOL = RTOL = 1e-2

LAYER_CASES = {
    # name: (interleave, manager block size, seq_lens, kv cache dtype, FP8 query mode)
    "bf16_i1": (1, 64, [1, 2, 3, 65, 129, 777, 1001, 4000], "auto", None),
    "bf16_i64_bs128": (64, 128, [1, 63, 64, 65, 130, 700, 2500], "auto", None),
    "bf16_padded": (1, 64, [5, 900, 0, 0], "auto", None),
    "fp8_accurate_i1": (1, 64, [1, 2, 3, 65, 777, 3001], "fp8", "accurate"),
    "fp8_accurate_i64_bs128": (64, 128, [1, 63, 64, 65, 130, 700, 2500], "fp8", "accurate"),
    # the fast mode: vLLM's concat + quant hands the plugin an e4m3 q with the layer's q scale; the reference
    # reads the same e4m3 q (tests/test_vllm_dcp_cpu.py does the same on the CPU)
    "fp8_fast_i1": (1, 64, [1, 2, 3, 65, 777, 3001], "fp8", "fast"),
    "fp8_fast_i64_bs128": (64, 128, [1, 63, 64, 65, 130, 700, 2500], "fp8", "fast"),
}
Q_SCALE = 0.03  # the fast mode's q scale: |q| ~ N(0, 1) stays far inside e4m3's range after dividing by it


# ---- layer level: two processes ------------------------------------------------------------------

def _rank(rank: int, port: int, case: str, out_dir: str) -> None:
    """One DCP rank (spawned): builds the plugin, runs forward_mqa on its shard, merges through vLLM's collective,
    writes its heads' errors against the unsharded reference to out_dir/rank<r>.json."""
    sys.path[:0] = [str(TESTS), str(INTEGRATION)]
    interleave, M, seq_lens, kv, mode = LAYER_CASES[case]
    os.environ["FLASHMLA_BACKEND_FP8_MODE"] = mode or "accurate"
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)

    import test_vllm_cpu as base
    import test_vllm_dcp_cpu as dcp_cpu
    from vllm.config import DeviceConfig
    from vllm.config.vllm import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    from vllm.v1.worker import utils as worker_utils

    import flashmla_backend.vllm

    flashmla_backend.vllm.register()
    cfg = dcp_cpu.dcp_config(WORLD, interleave, manager_block_size=M, kv_cache_dtype=kv)
    cfg.device_config = DeviceConfig(device="cuda")
    cfg.parallel_config.tensor_parallel_size = WORLD
    with set_current_vllm_config(cfg):
        ps.init_distributed_environment(world_size=WORLD, rank=rank, local_rank=rank, backend="nccl",
                                        distributed_init_method=f"tcp://127.0.0.1:{port}")
        ps.initialize_model_parallel(tensor_model_parallel_size=WORLD, decode_context_model_parallel_size=WORLD)
    try:
        heads = cfg.model_config.get_num_attention_heads(cfg.parallel_config)  # per TP rank (16 / 2)
        scale = base.layer_scale(cfg)
        backend = AttentionBackendEnum.CUSTOM.get_class()
        spec = MLAAttentionSpec(block_size=M, num_kv_heads=1, head_size=base.HEAD, dtype=torch.bfloat16,
                                cache_dtype_str=kv)
        layer = base.LayerDouble(cfg, scale)
        layer.num_heads = heads
        layer._k_scale, layer._q_scale = layer._k_scale.to(device), layer._q_scale.to(device)
        k_scale = 0.05 if kv == "fp8" else None
        q_scale = Q_SCALE if mode == "fast" else None
        if k_scale is not None:
            layer.set_scales(k_scale, q_scale if q_scale is not None else 1.0)
        combine = None
        with set_current_vllm_config(cfg):
            try:  # 0.33: the layer owns the DCP collectives; its builder takes them from the layer
                from vllm.v1.attention.ops.dcp import MLADCPManager

                layer.dcp_manager = MLADCPManager(
                    vllm_config=cfg, device=device, num_heads=heads, query_head_dim=base.HEAD,
                    output_head_dim=base.LATENT, query_dtype=torch.bfloat16, output_dtype=torch.bfloat16,
                    padded_num_heads=None, is_lse_base_on_e=True, use_pcp=False)
                combine = layer.dcp_manager.combine
            except ImportError:  # 0.26: the layer calls cp_lse_ag_out_rs over the DCP group
                from vllm.v1.attention.ops.common import cp_lse_ag_out_rs

                def combine(out, lse, seq_lens=None, query_start_loc=None):
                    return cp_lse_ag_out_rs(out, lse, ps.get_dcp_group(), is_lse_base_on_e=True)
            cfg.compilation_config.static_forward_context[base.LAYER_NAME] = layer
            plugin = object.__new__(base.Plugin)  # base.Plugin's fields, built on this rank's GPU
            plugin.cfg, plugin.scale, plugin.backend, plugin.layer = cfg, scale, backend, layer
            plugin.manager_block_size, plugin.torch_dtype, plugin._kernel_table = M, torch.bfloat16, None
            plugin.kernel_block_size = base.select_kernel_block_size(M, backend, spec)
            plugin.group = worker_utils.AttentionGroup(backend, [base.LAYER_NAME], spec, 0)
            plugin.group.create_metadata_builders(cfg, device, plugin.kernel_block_size)
            plugin.builder = plugin.group.get_metadata_builder()
            plugin.impl = base.make_impl(backend, cfg, scale, kv)
        assert plugin.impl.need_to_return_lse_for_decode and plugin.builder.num_q_heads == heads * WORLD

        batch = dcp_cpu.ShardedBatch(seq_lens, size=WORLD, interleave=interleave, manager_block_size=M,
                                     heads=heads * WORLD, seed=sum(seq_lens))
        common = batch.common(rank, interleave)
        if not hasattr(plugin.group, "build_metadata"):  # 0.26: the runner maps to kernel blocks (on the host here)
            common = common.replace(block_table_tensor=plugin.kernel_block_table(common.block_table_tensor))
        for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping", "dcp_local_seq_lens",
                     "is_prefilling"):
            if getattr(common, name, None) is not None:
                common = common.replace(**{name: getattr(common, name).to(device)})
        cache = batch.caches[rank]
        if k_scale is not None:
            cache = (cache.float() / k_scale).to(torch.float8_e4m3fn).view(torch.uint8)
        cache = cache.to(device)
        with set_current_vllm_config(cfg):
            if hasattr(plugin.group, "build_metadata"):  # 0.33: maps manager blocks to kernel blocks itself
                md = plugin.group.build_metadata(common)
            else:
                md = plugin.builder.build(common_prefix_len=0, common_attn_metadata=common)
        q = batch.q
        if mode == "fast":
            q = (batch.q.float() / q_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)  # vLLM's concat + quant
            assert plugin.impl.supports_quant_query_input
        out, lse = plugin.forward_mqa(q.to(device), cache, md)
        merged = combine(out, lse, seq_lens=md.decode.seq_lens, query_start_loc=md.query_start_loc)
        want, _ = batch.unsharded(scale, q=q, k_scale=k_scale, q_scale=q_scale)
        mine = slice(rank * heads, (rank + 1) * heads)  # the reduce-scatter leaves this rank its TP heads
        real = torch.tensor(seq_lens) > 0
        got, ref = merged.float().cpu()[real], want[:, mine].float()[real]
        err = (got - ref).abs()
        rel = ((got - ref).norm() / ref.norm()).item()
        ok = rel < harness.FAST_MODE_REL if mode == "fast" else bool(torch.allclose(got, ref, atol=ATOL, rtol=RTOL))
        result = {"max_abs": err.max().item(), "rel_norm": rel, "ok": ok,
                  "finite": bool(torch.isfinite(merged).all()), "shape": list(merged.shape),
                  "rank_alone_max_abs": (out[:, mine].float().cpu()[real] - ref).abs().max().item()}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_dcp2_merged_matches_the_unsharded_decode(case, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(harness.free_port(), case, str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        print(f"[{case}] rank {rank}: merged vs unsharded max |diff| {r['max_abs']:.3g}, rel-norm {r['rel_norm']:.3g} "
              f"(this rank's shard alone: "
              f"{r['rank_alone_max_abs']:.3g}); merged shape {r['shape']}", flush=True)
        assert r["finite"] and r["ok"], r
        assert r["rank_alone_max_abs"] > 0.05  # the merge matters: one shard alone is not the answer


# ---- engine level: TP 2 + DCP 2 ------------------------------------------------------------------

def _engine_test_module():
    spec = importlib.util.spec_from_file_location("vllm_engine_test_for_dcp", INTEGRATION / "test_vllm_engine_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


eng = _engine_test_module()
checkpoint, prompts_file = eng.checkpoint, eng.prompts_file  # the engine test's session fixtures
_runs: dict = {}


def dcp_generate(checkpoint: Path, prompts_file: Path, backend: str, *, dcp: int, broken: bool = False) -> dict:
    """One engine run at TP 2 (and DCP `dcp` when > 1) with CUDA graphs; result as vllm_run.py writes it, plus
    the KV capacity the log states."""
    key = (backend, dcp, broken)
    if key in _runs:
        return _runs[key]
    name = f"{backend.lower()}-graphs-tp2" + (f"-dcp{dcp}" if dcp > 1 else "") + ("-BROKEN" if broken else "")
    out = harness.RUN_DIR / f"{name}.json"
    out.unlink(missing_ok=True)
    run = [str(INTEGRATION / "vllm_run.py")] if dcp == 1 else [str(INTEGRATION / "vllm_dcp_run.py"), "--dcp",
                                                                  str(dcp), "--"]
    cmd = [sys.executable, *run, "--model", str(checkpoint), "--backend", backend, "--prompts", str(prompts_file),
           "--out", str(out), "--max-tokens", str(eng.MAX_TOKENS), "--logprobs", str(eng.LOGPROBS), "--tp", "2"]
    env = harness.engine_env({"FLASHMLA_BACKEND_DEBUG_BREAK_SCALE": "1" if broken else "0"})
    log = harness.run_logged(name, cmd, env)
    problems = eng.run_log_problems(log, backend, broken=broken)
    if backend == "CUSTOM" and dcp > 1 and harness.OUR_DCP_LOG_WORDS not in log:
        problems.append("our decode line does not mention decode context parallelism")
    assert not problems, f"{name}: " + "; ".join(problems)
    result = json.loads(out.read_text())
    result["name"] = name
    sizes = [int(m.group(1).replace(",", "")) for m in re.finditer(r"GPU KV cache size: ([\d,]+) tokens", log)]
    result["kv_cache_tokens"] = max(sizes) if sizes else None
    _runs[key] = result
    return result


def test_engine_dcp2_agrees_with_flashmla_dcp2(checkpoint, prompts_file):
    flashmla = dcp_generate(checkpoint, prompts_file, "FLASHMLA", dcp=2)
    ours = dcp_generate(checkpoint, prompts_file, "CUSTOM", dcp=2)
    assert eng.agrees(ours, flashmla, checkpoint, prompts_file)
    eng.compare(ours, dcp_generate(checkpoint, prompts_file, "CUSTOM", dcp=1))  # printed, not asserted


def test_engine_dcp2_broken_attention_fails_the_comparison(checkpoint, prompts_file):
    flashmla = dcp_generate(checkpoint, prompts_file, "FLASHMLA", dcp=2)
    broken = dcp_generate(checkpoint, prompts_file, "CUSTOM", dcp=2, broken=True)
    assert not eng.compare(broken, flashmla)["ok"]


def test_engine_dcp2_doubles_the_kv_capacity(checkpoint, prompts_file):
    plain = dcp_generate(checkpoint, prompts_file, "CUSTOM", dcp=1)
    sharded = dcp_generate(checkpoint, prompts_file, "CUSTOM", dcp=2)
    print(f"\n[kv capacity] TP 2: {plain['kv_cache_tokens']} tokens; TP 2 + DCP 2: {sharded['kv_cache_tokens']} tokens",
          flush=True)
    assert plain["kv_cache_tokens"] and sharded["kv_cache_tokens"]
    assert sharded["kv_cache_tokens"] >= 1.8 * plain["kv_cache_tokens"]


# ---- vllm serve at TP 2 + DCP 2 --------------------------------------------------------------------

@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_serve_dcp2_64_concurrent_completions(kv, checkpoint):
    """`vllm serve --attention-backend CUSTOM --tensor-parallel-size 2 --decode-context-parallel-size 2` (with
    --kv-cache-dtype fp8: the plugin's default query mode) and the engine test's 64 concurrent completions: every
    request returns all its tokens, and the server log shows our decode line naming DCP on the ranks."""
    log = eng.serve_64_concurrent(checkpoint, kv, f"serve-custom{'-fp8' if kv == 'fp8' else ''}-tp2-dcp2",
                                  ("--tensor-parallel-size", "2", "--decode-context-parallel-size", "2"))
    problems = eng.run_log_problems(log, "CUSTOM", kv=kv, mode=eng.DEFAULT_FP8_MODE if kv == "fp8" else None)
    if harness.OUR_DCP_LOG_WORDS not in log:
        problems.append(f"our decode line does not mention decode context parallelism ({harness.OUR_DCP_LOG_WORDS!r})")
    assert not problems, f"server log: {'; '.join(problems)}"
