#!/usr/bin/env python3
"""Where a vLLM decode step's GPU time goes, per backend: the kernels of the throughput benchmark's decode steps.

    python integration/profile_vllm_decode.py --configs CUSTOM:auto,FLASHMLA:auto
    python integration/profile_vllm_decode.py --configs CUSTOM:auto,FLASHMLA:auto --steps 128 --num-prompts 64
    python integration/profile_vllm_decode.py --model integration/models/tiny-deepseek-v32-h128-8layer

integration/bench_vllm_throughput.py measures decode tokens/s end to end; when two backends differ there while their
attention kernels alone differ the other way (benchmarks/RESULTS.md), this script says whether the difference is in
the kernels a step launches or outside them. Each config runs in its own process with the benchmark's model, prompts
and engine arguments (bench_vllm_throughput.engine_kwargs, one GPU: no --dcp), vLLM's engine core in the same process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, so that torch.profiler sees the GPU work), CUDA graphs as in the benchmark. After a
warm-up generation it adds every prompt to the engine and steps it until each request has its first token and
WARM_STEPS more (the prefill stays outside), then profiles --steps engine steps of the whole batch decoding with
torch.profiler's CUDA activity (decode_window: every request must gain the same number of tokens in them, else the
run fails). A kernel's figure is its device time in that window divided by the tokens each request gained (one a
decode step). A DeepSeek-V3.2 --model (sparse attention) takes the throughput benchmark's sparse configs (default
CUSTOM:fp8,FLASHMLA_SPARSE:fp8; CUSTOM runs with FLASHMLA_BACKEND_SPARSE_GPU=1). Printed per config: wall ms per
decode step (the in-process engine's; the benchmark's multiprocess engine may differ), the kernels' µs per step summed
("busy"), and the kernels by µs per step; then one table with the kernels of all configs side by side (the top --top
of each). Results: $FLASHMLA_BACKEND_RUN_DIR/profile-decode.json (--results).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import bench_vllm_throughput as bench  # noqa: E402


def kernel_totals(prof) -> dict[str, tuple[float, int]]:
    """{kernel name: (device µs summed over its launches, launches)} of a finished torch.profiler run."""
    totals: dict[str, tuple[float, int]] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", None)
        if us is None:
            us = getattr(ev, "self_cuda_time_total", 0.0)
        if us and getattr(ev, "device_type", None) is not None and "CUDA" in str(ev.device_type):
            t, n = totals.get(ev.key, (0.0, 0))
            totals[ev.key] = (t + float(us), n + int(ev.count))
    return totals


DEFAULT_CONFIGS = "CUSTOM:auto,FLASHMLA:auto"
WARM_STEPS = 4          # decode steps every request has taken before the profiled window
MAX_SETUP_STEPS = 100_000
# Tokens a request may generate before the window: with chunked prefill the first requests decode while the rest of
# the batch is still being prefilled (64 x 7000 tokens of the tiny DeepSeek-V3.2 took more decode tokens than the
# window's own margin, and a request finished inside it).
SETUP_TOKENS = 2048


def per_step(totals: dict[str, tuple[float, int]], steps: int) -> dict[str, dict]:
    """Per kernel: µs and launches per decode step, from a profile of `steps` decode steps."""
    return {name: {"us": t / steps, "launches": n / steps} for name, (t, n) in totals.items() if t > 0 or n > 0}


class TokenCounts:
    """The generated-token count of each profiled request, updated from the engine's step() outputs (cumulative
    outputs: len(outputs[0].token_ids) is the count so far)."""

    def __init__(self, engine, request_ids: list[str]):
        self.engine = engine
        self.tokens = dict.fromkeys(request_ids, 0)

    def step(self) -> None:
        for out in self.engine.step():
            if out.request_id not in self.tokens:
                continue
            if out.finished:
                raise RuntimeError(f"request {out.request_id} finished while being profiled: its max_tokens is too low")
            self.tokens[out.request_id] = len(out.outputs[0].token_ids)


def decode_window(engine, request_ids: list[str], steps: int, profiler, sync, warm_steps: int = WARM_STEPS):
    """Steps `engine` until every request has its first token and warm_steps more (prefill and warm-up stay outside
    the window), then `steps` steps inside `profiler` (a context manager; sync() around them). Returns (wall seconds
    of the window, tokens each request gained in it). Raises when the requests gained different counts or none: the
    window was not steps of the whole batch decoding."""
    counts = TokenCounts(engine, request_ids)
    taken = 0
    while min(counts.tokens.values()) < 1 + warm_steps:
        counts.step()
        taken += 1
        if taken > MAX_SETUP_STEPS:
            raise RuntimeError(f"the requests did not all reach {1 + warm_steps} tokens in {MAX_SETUP_STEPS} steps")
    before = dict(counts.tokens)
    sync()
    with profiler:
        t = time.perf_counter()
        for _ in range(steps):
            counts.step()
        sync()
        wall = time.perf_counter() - t
    gained = {r: counts.tokens[r] - before[r] for r in request_ids}
    kinds = sorted(set(gained.values()))
    if len(kinds) != 1 or kinds[0] < 1:
        raise RuntimeError(f"the requests gained {kinds} tokens in the {steps} profiled steps: not one decode batch")
    return wall, kinds[0]


def short_name(name: str, width: int = 70) -> str:
    """A kernel's name without template arguments and parameter lists, cut to width."""
    base = name.split("(")[0]
    depth, kept = 0, []
    for ch in base:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            kept.append(ch)
    text = "".join(kept).replace("void ", "").strip() or name
    return text if len(text) <= width else text[: width - 3] + "..."


def report(label: str, rec: dict, top: int) -> str:
    kernels = sorted(rec["kernels"].items(), key=lambda kv: -kv[1]["us"])
    busy = sum(k["us"] for _, k in kernels)
    lines = [f"[profile] {label}: {rec['wall_ms_per_step']:.3f} ms per decode step (wall, in-process engine), kernels "
             f"{busy / 1e3:.3f} ms per step ({100 * busy / 1e3 / rec['wall_ms_per_step']:.0f}% of it)"]
    for name, k in kernels[:top]:
        lines.append(f"[profile]   {k['us']:9.1f} us  {k['launches']:6.1f} launches  {short_name(name)}")
    return "\n".join(lines)


def side_by_side(records: dict[str, dict], top: int) -> str:
    """Markdown: the union of each config's top kernels, µs per decode step in each config."""
    labels = list(records)
    names: list[str] = []
    for rec in records.values():
        for name, _ in sorted(rec["kernels"].items(), key=lambda kv: -kv[1]["us"])[:top]:
            if name not in names:
                names.append(name)
    rows = ["| kernel | " + " | ".join(f"{lb} µs/step" for lb in labels) + " |",
            "|---|" + "---|" * len(labels)]
    for name in names:
        cells = [f"{records[lb]['kernels'][name]['us']:.1f}" if name in records[lb]["kernels"] else "-" for lb in labels]
        rows.append(f"| `{short_name(name, 60)}` | " + " | ".join(cells) + " |")
    busy = [sum(k["us"] for k in records[lb]["kernels"].values()) for lb in labels]
    rows.append("| all kernels | " + " | ".join(f"{b:.1f}" for b in busy) + " |")
    rows.append("| wall per step | " + " | ".join(f"{records[lb]['wall_ms_per_step'] * 1e3:.1f}" for lb in labels)
                + " |")
    return "\n".join(rows)


def worker(args) -> int:
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = bench.parse_config(args.worker, sparse=bench.is_sparse_model(args.model))
    args.dcp, args.kv_cache_memory_bytes = 1, None
    args.output_len = 1 + SETUP_TOKENS + WARM_STEPS + args.steps + 16  # no request finishes inside the window
    prompts = [TokensPrompt(prompt_token_ids=ids)
               for ids in bench.token_prompts(args.model, args.num_prompts, args.prompt_len, args.seed)]
    llm = LLM(**bench.engine_kwargs(cfg, args))
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    llm.generate(prompts, warm, use_tqdm=False)  # compilation and graph capture outside the profile
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    ids = [f"profile-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    prof = profile(activities=[ProfilerActivity.CUDA])
    wall, tokens = decode_window(engine, ids, args.steps, prof, torch.cuda.synchronize)
    engine.abort_request(ids)
    print(f"[profile] {cfg.label}: {args.steps} steps of {len(ids)} decoding requests in {wall:.3f} s, {tokens} "
          f"token(s) each", flush=True)
    rec = {"config": cfg.label, "steps": args.steps, "tokens_per_request": tokens,
           "wall_ms_per_step": wall / tokens * 1e3, "kernels": per_step(kernel_totals(prof), tokens),
           "gpu": torch.cuda.get_device_name()}
    Path(args.worker_out).write_text(json.dumps(rec))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", help="BACKEND[:KVDTYPE[:MODE]],... as the throughput benchmark takes them (default "
                    f"{DEFAULT_CONFIGS}; for a DeepSeek-V3.2 --model {bench.DEFAULT_SPARSE_CONFIGS})")
    ap.add_argument("--steps", type=int, default=128, help="decode steps profiled (default 128)")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per config (default 12)")
    ap.add_argument("--model", default=str(bench.MODEL_DIR), help="a directory with a DeepSeek-V3 or DeepSeek-V3.2 "
                    "config.json")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=7000)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=harness.RUN_TIMEOUT_S, help="seconds per engine process")
    ap.add_argument("--results", help="results JSON (default RUN_DIR/profile-decode.json)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    for name in ("steps", "top", "num_prompts", "prompt_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.worker:
        return worker(args)
    try:
        sparse = bench.is_sparse_model(args.model)
        configs = bench.parse_configs(args.configs or (bench.DEFAULT_SPARSE_CONFIGS if sparse else DEFAULT_CONFIGS),
                                      sparse=sparse)
    except ValueError as e:
        ap.error(str(e))
    results_path = Path(args.results) if args.results else harness.RUN_DIR / "profile-decode.json"
    records, failures = {}, []
    env = harness.engine_env()
    for i, cfg in enumerate(configs, 1):
        print(f"\n[profile] process {i}/{len(configs)}: {cfg.label}, {args.steps} decode steps of {args.num_prompts} "
              f"prompts of {args.prompt_len} tokens", flush=True)
        name = f"profile-decode-{cfg.slug}"
        out = harness.RUN_DIR / f"{name}.json"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--worker", cfg.label, "--worker-out", str(out), "--model", args.model,
               "--num-prompts", str(args.num_prompts), "--prompt-len", str(args.prompt_len), "--steps",
               str(args.steps), "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--seed", str(args.seed)]
        try:
            _, records[cfg.label] = bench.run_engine_process(name, cmd, cfg, env, out, args.timeout)
            print(report(cfg.label, records[cfg.label], args.top), flush=True)
        except harness.RunFailed as e:
            failures.append({"config": cfg.label, "why": str(e).splitlines()[0]})
            print(e, flush=True)
        harness.write_json(results_path, {"records": records, "failures": failures, "git": bench.git_describe()})
    if records:
        print("\n" + side_by_side(records, args.top), flush=True)
    print(f"\n[profile] results: {results_path}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
