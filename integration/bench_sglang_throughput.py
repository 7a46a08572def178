"""End-to-end decode throughput of SGLang's MLA attention backends, ours (flashmla_backend) included, with 16-bit and
FP8 KV caches: the SGLang counterpart of bench_vllm_throughput.py, whose order, statistics and measurement it shares.

Commands (each prints its plan first, one progress line per engine process, and a Markdown table at the end):

    python integration/bench_sglang_throughput.py
        flashmla_backend:fp8_e4m3:accurate, flashmla_backend:fp8_e4m3:fast, flashmla:fp8_e4m3: 1 round x 2 repeats
    python integration/bench_sglang_throughput.py --configs flashmla_backend:fp8_e4m3:fast,flashmla:fp8_e4m3 \\
        --rounds 2 --repeats 2
        configs are BACKEND[:KVDTYPE[:MODE]]: BACKEND an --attention-backend of SGLang (flashmla_backend is ours;
        flashmla, triton, flashinfer, fa3 SGLang's), KVDTYPE auto or fp8_e4m3 (default auto), MODE accurate or fast
        (flashmla_backend with fp8_e4m3 only; FLASHMLA_BACKEND_FP8_MODE in that engine's environment; default the
        plugin's SGLang default, accurate, made explicit in the label)
    python integration/bench_sglang_throughput.py --dry-run [other options]
        prints the plan and starts nothing

Shape: the 8-layer, 128-head DeepSeek-V3 config of integration/models/tiny-deepseek-v3-h128-8layer with SGLang's dummy
weights (load_format dummy, no tokenizer: token-id prompts), 64 prompts of 7000 random tokens, the radix cache off,
greedy with ignore_eos, CUDA graphs. Every config runs in its own engine process (sglang.Engine in a subprocess of
this script, the plugin declared as bench_vllm_throughput's engines get it); each warms up once, then takes --repeats
measurements:
    decode time = time(generate N tokens) - time(generate 1 token)     (N = --output-len, default 2049)
decode tokens/s = prompts x (N - 1) / decode time. (Duration, measured on an H200 with SGLang 0.5.17: SGLang prefills
the default prompts at about 8,500 tokens/s, so t(1) is about 54 s and one process with two repeats about 4.5
minutes; the default plan of three configs about a quarter of an hour a round.) --rounds R runs R processes per
config, the order of the configs forward in odd rounds and reversed in even ones. The table gives per config min / median / max of decode tokens/s,
ms per step and t(1) at the median, and each config's median relative to --reference (default flashmla:fp8_e4m3 when
it ran), marked "apart" when the [min, max] ranges do not overlap and "overlap" when they do (bench_vllm_throughput.py
says why single runs are not evidence).

A flashmla_backend run's log must show the plugin's decode line, with an FP8 cache the mode asked for; a run that
fails or whose log does not is reported and left out of the table (exit code 1). Results: the measurements, failures
and the run's metadata as JSON in $FLASHMLA_BACKEND_RUN_DIR/bench-sglang.json (--results).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_vllm_throughput as vbench  # noqa: E402  (shared: Config, round_orders, summarize, versus, prompts)
import harness  # noqa: E402

Config = vbench.Config
OURS = "flashmla_backend"
KV_DTYPES = ("auto", "fp8_e4m3")
FP8_MODES = vbench.FP8_MODES
FP8_MODE_ENV = vbench.FP8_MODE_ENV
DEFAULT_FP8_MODE = "accurate"   # the plugin's SGLang mode with FP8_MODE_ENV unset (engine_support.DEFAULT_FP8_MODES)
DEFAULT_CONFIGS = "flashmla_backend:fp8_e4m3:accurate,flashmla_backend:fp8_e4m3:fast,flashmla:fp8_e4m3"
DEFAULT_REFERENCE = "flashmla:fp8_e4m3"
OUR_LOG_LINE = "MLA decode attention runs on flashmla_backend"   # flashmla_backend/sglang/backend.py
FP8_LOG_LINE = "FP8 (e4m3) KV cache read in place"


def parse_config(item: str) -> Config:
    """BACKEND[:KVDTYPE[:MODE]] -> Config (names as SGLang spells them); flashmla_backend with fp8_e4m3 gets the
    plugin's default mode in the label when none is given."""
    parts = [p.strip() for p in item.strip().split(":")]
    if not parts[0] or len(parts) > 3 or any(not p for p in parts):
        raise ValueError(f"config {item!r}: expected BACKEND[:KVDTYPE[:MODE]], e.g. flashmla_backend:fp8_e4m3:fast "
                         "or flashmla:fp8_e4m3")
    backend = parts[0].lower()
    if not backend.replace("_", "").isalnum():
        raise ValueError(f"config {item!r}: backend {parts[0]!r} is not an SGLang --attention-backend name")
    kv = parts[1].lower() if len(parts) > 1 else "auto"
    if kv not in KV_DTYPES:
        raise ValueError(f"config {item!r}: KV-cache dtype {kv!r}; expected one of {', '.join(KV_DTYPES)}")
    mode = parts[2].lower() if len(parts) > 2 else None
    if mode is not None:
        if mode not in FP8_MODES:
            raise ValueError(f"config {item!r}: mode {mode!r}; expected one of {', '.join(FP8_MODES)}")
        if backend != OURS or kv != "fp8_e4m3":
            raise ValueError(f"config {item!r}: a mode applies only to {OURS} with an fp8_e4m3 KV cache "
                             f"({FP8_MODE_ENV} is read by the plugin)")
    if backend == OURS and kv == "fp8_e4m3" and mode is None:
        mode = DEFAULT_FP8_MODE
    return Config(backend, kv, mode)


def parse_configs(text: str) -> list[Config]:
    return vbench.checked_configs([parse_config(item) for item in text.split(",") if item.strip()])


def config_env(cfg: Config, base: dict | None = None) -> dict:
    """The engine process's environment: the harness's, with FLASHMLA_BACKEND_FP8_MODE only where the config has a
    mode (a caller's setting never leaks into the other configs)."""
    env = dict(harness.engine_env() if base is None else base)
    env.pop(FP8_MODE_ENV, None)
    if cfg.mode:
        env[FP8_MODE_ENV] = cfg.mode
    return env


def log_problem(log: str, cfg: Config) -> str | None:
    """None when the log shows what the config asked for: for flashmla_backend our decode line (with an FP8 cache,
    the FP8 line and the mode); for SGLang's own backends, not our line."""
    ours = [line for line in log.splitlines() if OUR_LOG_LINE in line]
    if cfg.backend != OURS:
        return f"the log shows {OUR_LOG_LINE!r} in a {cfg.backend} run" if ours else None
    if not ours:
        return f"the log does not show flashmla_backend running decode attention ({OUR_LOG_LINE!r})"
    if cfg.kv == "fp8_e4m3" and not any(FP8_LOG_LINE in line and f"mode {cfg.mode}," in line for line in ours):
        return f"our decode line does not say {FP8_LOG_LINE!r} and 'mode {cfg.mode}': {ours[0].strip()!r}"
    if cfg.kv == "auto" and any(FP8_LOG_LINE in line for line in ours):
        return f"a 16-bit run's decode line says {FP8_LOG_LINE!r}"
    return None


def engine_kwargs(cfg: Config, args) -> dict:
    """sglang.Engine(...) arguments of a config: dummy weights, no tokenizer, no radix cache, CUDA graphs."""
    kwargs = dict(model_path=args.model, attention_backend=cfg.backend, load_format="dummy", skip_tokenizer_init=True,
                  disable_radix_cache=True, mem_fraction_static=args.mem_fraction_static,
                  max_running_requests=args.num_prompts, context_length=args.prompt_len + args.output_len + 64,
                  sampling_backend="pytorch", grammar_backend="none", random_seed=0, log_level="info")
    if cfg.kv != "auto":
        kwargs["kv_cache_dtype"] = cfg.kv
    return kwargs


def worker(args) -> int:
    """Runs inside the per-config subprocess; writes its measurements to --worker-out."""
    import sglang_run

    sglang_run._declare_entry_point(Path(args.worker_out).resolve().parent)
    import sglang
    import torch

    cfg = parse_config(args.worker)
    prompts = vbench.token_prompts(args.model, args.num_prompts, args.prompt_len, args.seed)
    kwargs = engine_kwargs(cfg, args)
    print(f"[bench] {cfg.label}: sglang.Engine({json.dumps({k: v for k, v in kwargs.items() if k != 'model_path'})})",
          flush=True)
    t0 = time.time()
    engine = sglang.Engine(**kwargs)
    init_s = time.time() - t0
    try:
        def timed(max_tokens: int) -> float:
            t = time.time()
            res = engine.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": max_tokens,
                                                                      "ignore_eos": True})
            dt = time.time() - t
            got = sorted({r["meta_info"]["completion_tokens"] for r in res})
            if got != [max_tokens] or len(res) != len(prompts):
                raise RuntimeError(f"asked {len(prompts)} x {max_tokens} tokens, got {len(res)} responses of {got}")
            return dt

        steps = args.output_len - 1
        timed(8)  # warm-up outside the measurement
        measurements = []
        for k in range(args.repeats):
            t_1, t_n = timed(1), timed(args.output_len)
            decode_s = t_n - t_1
            m = {"repeat": k + 1, "t_1": t_1, "t_n": t_n, "decode_s": decode_s,
                 "decode_tok_s": args.num_prompts * steps / decode_s if decode_s > 0 else None,
                 "ms_per_step": decode_s / steps * 1e3}
            measurements.append(m)
            rate = f"{m['decode_tok_s']:,.0f}" if m["decode_tok_s"] else "n/a"
            print(f"[bench] {cfg.label}: repeat {k + 1}/{args.repeats}: t(1) {t_1:.2f} s, t({args.output_len}) "
                  f"{t_n:.2f} s, decode {rate} tok/s ({m['ms_per_step']:.3f} ms/step)", flush=True)
    finally:
        engine.shutdown()
    result = {"config": cfg.label, "sglang_version": sglang.__version__, "torch_version": torch.__version__,
              "gpu": torch.cuda.get_device_name(), "init_s": init_s, "measurements": measurements}
    Path(args.worker_out).write_text(json.dumps(result))
    return 0


# ---- the driver ---------------------------------------------------------------------------------

def table(results: dict, reference: str) -> str:
    labels = results["meta"]["configs"]
    stats = vbench.summarize(results["measurements"], labels)
    t1 = vbench.summarize(results["measurements"], labels, key="t_1")
    lines = [f"| config | n | decode tok/s min | median | max | ms/step (median) | t(1) s (median) | vs {reference} |",
             "|---|---|---|---|---|---|---|---|"]
    for label in labels:
        if label not in stats:
            continue
        s = stats[label]
        ms = results["meta"]["num_prompts"] / s["median"] * 1e3   # decode time / steps at the median rate
        lines.append(f"| {label} | {s['n']} | {s['min']:,.0f} | {s['median']:,.0f} | {s['max']:,.0f} | {ms:.3f} | "
                     f"{t1[label]['median']:.2f} | {vbench.versus(stats, label, reference)} |")
    return "\n".join(lines)


def render(results: dict, reference: str) -> str:
    meta = results["meta"]
    out = ["### SGLang decode throughput (integration/bench_sglang_throughput.py)", "",
           f"- date {meta['date']}; GPU {meta.get('gpu', 'unknown')}; SGLang {meta.get('sglang_version', 'unknown')}; "
           f"flashmla_backend {meta['git']}",
           f"- command: `{meta['command']}`",
           f"- model {Path(meta['model']).name}, {meta['num_prompts']} prompts x {meta['prompt_len']} tokens, "
           f"{meta['output_len'] - 1} decode steps (t({meta['output_len']} tokens) - t(1 token)), radix cache off, "
           f"CUDA graphs; {meta['rounds']} round(s) (order alternating) x {meta['repeats']} repeats per config", "",
           table(results, reference), ""]
    out += [f"FAILED: {f['config']} (round {f['round']}): {f['why']}" for f in results["failures"]]
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"BACKEND[:KVDTYPE[:MODE]],... (default "
                                                                f"{DEFAULT_CONFIGS})")
    ap.add_argument("--reference", default=DEFAULT_REFERENCE, help="the config the table's ratios are of (default "
                                                                   f"{DEFAULT_REFERENCE})")
    ap.add_argument("--rounds", type=int, default=1, help="engine processes per config, order alternating (default 1)")
    ap.add_argument("--first-round", type=int, default=1, help="number of the first round (its order; default 1)")
    ap.add_argument("--repeats", type=int, default=2, help="measurements per process (default 2)")
    ap.add_argument("--model", default=str(vbench.MODEL_DIR), help="a directory with a DeepSeek-V3 config.json "
                                                                    "(default: the 128-head tiny model)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=7000)
    ap.add_argument("--output-len", type=int, default=2049, help="N of t(N) - t(1) (default 2049: 2048 decode steps)")
    ap.add_argument("--mem-fraction-static", type=float, default=0.85)
    ap.add_argument("--seed", type=int, default=0, help="the prompts' seed")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per engine process (default 900)")
    ap.add_argument("--results", help="results JSON (default $FLASHMLA_BACKEND_RUN_DIR/bench-sglang.json)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and start nothing")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker(args)
    for name in ("rounds", "repeats", "num_prompts", "prompt_len"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.output_len < 2:
        raise SystemExit(f"--output-len must be at least 2 (t(N) - t(1) needs N > 1), got {args.output_len}")
    try:
        configs = parse_configs(args.configs)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    plan = vbench.round_orders(configs, args.rounds, args.first_round)
    est = vbench.estimate_s(len(plan), args.repeats, args.output_len)
    print(f"[bench] plan: {len(plan)} engine processes ({len(configs)} configs x {args.rounds} rounds, order "
          f"alternating), {args.repeats} repeats each, about {est / 60:.0f} min", flush=True)
    for i, (r, cfg) in enumerate(plan):
        print(f"[bench]   {i + 1}. round {r}: {cfg.label}", flush=True)
    if args.dry_run:
        return 0
    results = {"kind": "sglang-throughput", "measurements": [], "failures": [], "processes": [],
               "meta": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "git": vbench.git_describe(),
                        "command": "python integration/bench_sglang_throughput.py " + " ".join(argv or sys.argv[1:]),
                        "configs": [c.label for c in configs], "model": args.model, "num_prompts": args.num_prompts,
                        "prompt_len": args.prompt_len, "output_len": args.output_len, "rounds": args.rounds,
                        "repeats": args.repeats}}
    harness.RUN_DIR.mkdir(parents=True, exist_ok=True)
    results_path = Path(args.results) if args.results else harness.RUN_DIR / "bench-sglang.json"
    t0 = time.time()
    for i, (r, cfg) in enumerate(plan):
        name = f"bench-sglang-r{r}-{cfg.slug}"
        out = harness.RUN_DIR / f"{name}.json"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", cfg.label, "--worker-out", str(out),
               "--model", args.model, "--num-prompts", str(args.num_prompts), "--prompt-len", str(args.prompt_len),
               "--output-len", str(args.output_len), "--repeats", str(args.repeats), "--seed", str(args.seed),
               "--mem-fraction-static", str(args.mem_fraction_static)]
        print(f"[bench] process {i + 1}/{len(plan)}: round {r}"
              f"{' (reversed order)' if r % 2 == 0 else ''}, {cfg.label}", flush=True)
        try:
            log = harness.run_logged(name, cmd, config_env(cfg), timeout_s=args.timeout)
            problem = log_problem(log, cfg)
            if problem:
                raise harness.RunFailed(problem)
            rec = json.loads(out.read_text())
        except (harness.RunFailed, OSError, ValueError) as e:
            why = str(e).splitlines()[0] if str(e) else repr(e)
            print(f"[bench] FAILED: {cfg.label} (round {r}): {why}", flush=True)
            results["failures"].append({"config": cfg.label, "round": r, "why": why})
            continue
        for key in ("gpu", "sglang_version", "torch_version"):
            results["meta"].setdefault(key, rec.get(key))
        results["processes"].append({"config": cfg.label, "round": r, "init_s": rec.get("init_s")})
        results["measurements"] += [{**m, "config": cfg.label, "round": r} for m in rec["measurements"]]
        results_path.write_text(json.dumps(results, indent=1))
    results_path.write_text(json.dumps(results, indent=1))
    reference = args.reference if args.reference in results["meta"]["configs"] else results["meta"]["configs"][0]
    print(f"\n[bench] {len(plan)} processes in {time.time() - t0:.0f} s; results: {results_path}\n")
    print(render(results, reference))
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
