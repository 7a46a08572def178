#!/usr/bin/env python3
"""One SGLang engine run (offline `sglang.Engine`), greedy, with logprobs; and the comparison of two runs.

    python integration/sglang_run.py run --model DIR --backend flashmla_backend --prompts prompts.json \
        --out ours.json [--max-tokens 32] [--logprobs 5] [--disable-cuda-graph] [--kv-cache-dtype fp8_e4m3]
    python integration/sglang_run.py compare ours.json triton.json [--expect disagree] [--tie-gap-from calib.json]
    python integration/sglang_run.py calibrate a.json,b.json [c.json,d.json ...] --out calib.json
    python integration/sglang_run.py serve --model DIR --log serve.log [--requests 64] [--kv-cache-dtype fp8_e4m3] \
        [--dcp 2]
    FLASHMLA_BACKEND_DSA_DECODE=1 FLASHMLA_BACKEND_SPARSE_GPU=1 python integration/sglang_run.py run \
        --model V32_DIR --backend dsa --kv-cache-dtype fp8_e4m3 --prompts prompts.json --out dsa-ours.json
    python integration/sglang_run.py logcheck --backend dsa dsa-ours.log

prompts.json: a list of prompts, each a list of token ids. The result has the same format as
integration/vllm_run.py's ({"outputs": [{"token_ids": [...], "logprobs": [{"<id>": logprob, ...}, ...]}]}),
so `compare` applies the vLLM engine test's criteria (integration/test_vllm_engine_gpu.py: compare()).

The plugin is found through SGLang's `sglang.srt.plugins` entry point. In a source checkout that is not
pip-installed (the GPU machine: sources + an in-place build on PYTHONPATH), `run` declares the entry point
from a minimal dist-info folder put on PYTHONPATH before SGLang starts, so every SGLang process loads the
plugin through its normal mechanism. Start-up options: page size is forced to 64 by the plugin; sampling
runs in PyTorch and grammar is off (neither needs FlashInfer nor xgrammar's native library).

--kv-cache-dtype (run, serve): SGLang's option, default auto (the model's 16-bit dtype, as before);
fp8_e4m3 runs an FP8 KV cache (e4m3 with the layers' k scales; the tiny checkpoints carry none, so the default
scale 1.0). `serve` with fp8_e4m3 and our backend also checks the server log for the plugin's FP8 line and for
its default-scale line.

--dcp N (serve): TP N + DCP N on N GPUs (SGLang's --dcp-size), the backend as decode backend and flashinfer for
prefill; the server log must also show the plugin's DCP routing line.

DeepSeek-V3.2 (run, serve): --backend dsa is SGLang's DSA attention backend (indexer, prefill, KV writes SGLang's);
--dsa-decode-backend picks SGLang's own decode kernel for it (flashmla_kv: its FlashMLA, the reference). With
FLASHMLA_BACKEND_DSA_DECODE=1 (and, on a GPU, FLASHMLA_BACKEND_SPARSE_GPU=1) in the environment the plugin's hooks
put flashmla_backend's sparse decode in its place (flashmla_backend/sglang/dsa.py). `logcheck --backend dsa LOG`
(run with the same environment as the run) and `serve` require the plugin's DSA line in the log with the variable
set, and its absence without it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENTRY_POINT = "flashmla_backend = flashmla_backend.sglang:register"
# Below this mean accept length (tokens per verification step) the drafts carry too little signal to judge.
MIN_INFORMATIVE_ACCEPT = 1.3
# The plugin's start-up line when SGLang's DSA decode runs on flashmla_backend (flashmla_backend/sglang/dsa.py).
DSA_LOG_LINE = "SGLang's DSA decode runs on flashmla_backend"


def _dsa_decode_requested() -> bool:
    from flashmla_backend._env import DSA_DECODE_ENV, flag

    return flag(DSA_DECODE_ENV)


def _dsa_log_problem(backend: str, log_text: str) -> str | None:
    """With --backend dsa: whose decode the log shows against the one asked for (None when they match)."""
    if backend != "dsa":
        return None
    want, seen = _dsa_decode_requested(), DSA_LOG_LINE in log_text
    if want and not seen:
        return f"FLASHMLA_BACKEND_DSA_DECODE is set but the log lacks {DSA_LOG_LINE!r}: SGLang's own decode ran"
    if seen and not want:
        return f"the log shows {DSA_LOG_LINE!r} without FLASHMLA_BACKEND_DSA_DECODE: the reference is not SGLang's own"
    return None


def _declare_entry_point(run_dir: Path) -> None:
    from importlib.metadata import entry_points

    if any(ep.name == "flashmla_backend" for ep in entry_points(group="sglang.srt.plugins")):
        return
    sys.path.insert(0, str(HERE))
    from harness import entry_point_shim

    shim = entry_point_shim(run_dir / "sglang-plugin-entry-point", "sglang", "sglang.srt.plugins", ENTRY_POINT)
    sys.path.insert(0, str(shim))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(shim), str(HERE.parent),
                                                            os.environ.get("PYTHONPATH", "")] if p)
    print(f"[sglang_run] declared the sglang.srt.plugins entry point from {shim}", flush=True)


def run(args) -> int:
    _declare_entry_point(Path(args.out).resolve().parent)
    import sglang

    prompts = json.loads(Path(args.prompts).read_text())
    t0 = time.time()
    extra = {}
    if args.mtp:
        # DeepSeek MTP: the checkpoint's NextN layer drafts (SGLang sets the draft path to the model), topk 1.
        # Steps >= 2 exercise the multi-step draft decoder (step i reads the i + 1 tokens drafted so far).
        extra.update(speculative_algorithm="EAGLE", speculative_num_steps=args.mtp, speculative_eagle_topk=1,
                     speculative_num_draft_tokens=args.mtp + 1)
    if args.kv_splits:
        extra["triton_attention_num_kv_splits"] = args.kv_splits
    if args.kv_cache_dtype != "auto":  # the default runs as before: SGLang's own default
        extra["kv_cache_dtype"] = args.kv_cache_dtype
    if args.dsa_decode_backend:
        extra["dsa_decode_backend"] = args.dsa_decode_backend
    engine = sglang.Engine(model_path=args.model, attention_backend=args.backend, skip_tokenizer_init=True,
                           sampling_backend="pytorch", grammar_backend="none", mem_fraction_static=0.5,
                           disable_cuda_graph=args.disable_cuda_graph,
                           context_length=4096, log_level="info", random_seed=0, **extra)
    init_s = time.time() - t0
    try:
        t0 = time.time()
        res = engine.generate(input_ids=prompts,
                              sampling_params={"temperature": 0.0, "max_new_tokens": args.max_tokens,
                                               "ignore_eos": True},
                              return_logprob=True, top_logprobs_num=args.logprobs)
        gen_s = time.time() - t0
    finally:
        engine.shutdown()
    outputs = []
    for r in res:
        meta = r["meta_info"]
        chosen = meta["output_token_logprobs"]  # [(logprob, token_id, text)]
        tops = meta["output_top_logprobs"]  # per position: [(logprob, token_id, text), ...]
        token_ids = [int(t[1]) for t in chosen]
        lps = []
        for (lp, tid, _), top in zip(chosen, tops):
            d = {str(int(t[1])): float(t[0]) for t in (top or [])}
            d[str(int(tid))] = float(lp)
            lps.append(d)
        outputs.append({"token_ids": token_ids, "logprobs": lps,
                        "spec_accept_length": meta.get("spec_accept_length")})
    result = {"backend": args.backend, "sglang_version": sglang.__version__, "options": extra,
              "init_s": init_s, "generate_s": gen_s, "outputs": outputs}
    if args.backend == "dsa":
        result["dsa_decode"] = "flashmla_backend" if _dsa_decode_requested() else "sglang"
    accept = [o["spec_accept_length"] for o in outputs if o["spec_accept_length"] is not None]
    if args.mtp:
        if len(accept) != len(outputs):
            print(f"[sglang_run] speculative run without spec_accept_length in {len(outputs) - len(accept)} "
                  "outputs: SGLang did not run the draft model", flush=True)
            return 1
        # Tokens per verification step: 1 + accepted drafts. Wrong draft attention shows here (the target
        # model's verification keeps the tokens right whatever the drafts are).
        result["spec_accept_length_mean"] = sum(accept) / len(accept)
    Path(args.out).write_text(json.dumps(result))
    acc = f", accept length {result['spec_accept_length_mean']:.3f}" if args.mtp else ""
    print(f"[sglang_run] {args.backend} {extra or ''}: {len(prompts)} prompts, init {init_s:.1f} s, "
          f"generate {gen_s:.1f} s{acc}", flush=True)
    return 0


def _load(path: str) -> dict:
    r = json.loads(Path(path).read_text())
    r["name"] = f"{r['backend']}({Path(path).stem})"
    return r


def calibrate(args) -> int:
    """Tie gap for SGLang from pairs of correct runs (same prompts, two correct configurations each):
    the largest gap at which two correct runs diverged, never below the vLLM test's TIE_GAP."""
    sys.path.insert(0, str(HERE))
    import test_vllm_engine_gpu as crit

    largest = 0.0
    for pair in args.pairs:
        a, b = (_load(p) for p in pair.split(","))
        gaps = [g for *_, g in crit.compare(a, b, tie_gap=math.inf)["divergences"]]  # figures; gaps below
        largest = max([largest] + gaps)
        print(f"[sglang_run] baseline {a['name']} vs {b['name']}: divergence gaps "
              f"{sorted(round(g, 3) for g in gaps)}", flush=True)
    tie_gap = max(crit.TIE_GAP, largest)
    Path(args.out).write_text(json.dumps({"tie_gap": tie_gap, "largest_baseline_gap": largest,
                                          "pairs": args.pairs}))
    print(f"[sglang_run] tie gap for SGLang: {tie_gap:.3f} nats (largest baseline divergence {largest:.3f}, "
          f"vLLM test's TIE_GAP {crit.TIE_GAP})", flush=True)
    return 0


def compare(args) -> int:
    sys.path.insert(0, str(HERE))
    import test_vllm_engine_gpu as crit  # the vLLM engine test's criteria

    tie_gap = crit.TIE_GAP
    if args.tie_gap_from:
        tie_gap = json.loads(Path(args.tie_gap_from).read_text())["tie_gap"]
        print(f"[sglang_run] tie gap {tie_gap:.3f} nats from {args.tie_gap_from}", flush=True)
    runs = [_load(p) for p in (args.ours, args.ref)]
    r = crit.compare(runs[0], runs[1], tie_gap=tie_gap)
    ok = r["ok"]
    print(f"[sglang_run] divergence gaps {sorted(round(g, 3) for *_, g in r['divergences'])}", flush=True)
    fp8 = [x.get("options", {}).get("kv_cache_dtype") == "fp8_e4m3" for x in runs]
    if args.fp32_model and all(fp8):
        # Two correct FP8 runs part early (every cached value is rounded: vLLM's FLASHMLA-FP8 and TRITON_MLA-FP8 kept
        # 31 % of tokens before the first difference on an H100), so FP8 runs are judged by the fp32 distance alone,
        # as the vLLM FP8 engine tests do; the pairwise figures above are for information.
        from fp32_oracle import Fp32Oracle, fp8_no_worse, mean_error

        oracle = Fp32Oracle(args.fp32_model, json.loads(Path(args.prompts).read_text()))
        m = [mean_error(oracle.run_error(x)) for x in runs]
        ok = fp8_no_worse(runs[0]["name"], m[0], runs[1]["name"], m[1])
    elif args.fp32_model:
        if any(fp8):
            print("[sglang_run] one run has an FP8 KV cache and the other not: judged as 16-bit runs", flush=True)
        from fp32_oracle import Fp32Oracle, fp32_verdict

        ok = fp32_verdict(Fp32Oracle(args.fp32_model, json.loads(Path(args.prompts).read_text())), runs[0], runs[1],
                          r)
    for x in runs:
        if "spec_accept_length_mean" in x:
            print(f"[sglang_run] {x['name']}: mean accept length {x['spec_accept_length_mean']:.3f}", flush=True)
    if args.min_accept_ratio is not None:
        acc = [x.get("spec_accept_length_mean") for x in runs]
        if None in acc:
            print("[sglang_run] --min-accept-ratio needs two speculative runs", flush=True)
            return 1
        ratio = acc[0] / acc[1]
        print(f"[sglang_run] accept length ratio {ratio:.3f} (minimum {args.min_accept_ratio})", flush=True)
        if acc[1] < MIN_INFORMATIVE_ACCEPT:
            # Drafts that are (almost) never accepted by the reference carry no signal about draft attention.
            print(f"[sglang_run] the reference accepts almost no drafts (mean accept length {acc[1]:.3f} < "
                  f"{MIN_INFORMATIVE_ACCEPT}): the acceptance check cannot tell, so it does not decide", flush=True)
            return 2
        ok = ok and ratio >= args.min_accept_ratio
    want = args.expect == "agree"
    print(f"[sglang_run] expected {args.expect}: {'as expected' if ok == want else 'NOT as expected'}", flush=True)
    return 0 if ok == want else 1


# The plugin's start-up lines that an FP8 server log must show (flashmla_backend.sglang.backend).
FP8_LOG_LINE = "FP8 (e4m3) KV cache read in place"


def launch_server_cmd(args, port: int) -> list[str]:
    """The launch_server command of `serve`. With --dcp N > 1: TP N + DCP N, the backend as the decode backend only
    and flashinfer for prefill (under DCP the plugin serves decode), SGLang's custom all-reduce and its FlashInfer
    all-reduce fusion off (sglang_dcp_run.py does the same for `run` and says why)."""
    if args.dcp > 1:
        backends = ["--prefill-attention-backend", "flashinfer", "--decode-attention-backend", args.backend,
                    "--tp-size", str(args.dcp), "--dcp-size", str(args.dcp), "--disable-custom-all-reduce",
                    "--enforce-disable-flashinfer-allreduce-fusion"]
    else:
        backends = ["--attention-backend", args.backend]
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model, *backends,
           "--host", "127.0.0.1", "--port", str(port), "--mem-fraction-static", "0.5",
           "--context-length", "4096", "--sampling-backend", "pytorch", "--grammar-backend", "none"]
    if args.kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.dsa_decode_backend:
        cmd += ["--dsa-decode-backend", args.dsa_decode_backend]
    return cmd


# The plugin's log line when DeepSeek's decode goes through SGLang's DCP path (flashmla_backend/sglang/hooks.py).
DCP_LOG_LINE = "runs the DCP path"


def serve(args) -> int:
    """`python -m sglang.launch_server --model-path M --attention-backend flashmla_backend` on 127.0.0.1 (plus
    this environment's sampling/grammar settings, see the module docstring), then `--requests` concurrent
    /generate requests of text prompts (greedy, ignore_eos, 1..2500 words, 1..128 new tokens); every one must
    return its token count, and the server log must show our decode. The server is stopped at the end."""
    import random
    import signal
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    log_path = Path(args.log).resolve()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    _declare_entry_point(log_path.parent)
    sys.path.insert(0, str(HERE))
    from harness import free_port, post_json, wait_healthy

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = launch_server_cmd(args, port)
    print(f"[sglang_run] serve: {' '.join(cmd)} (log {log_path})", flush=True)

    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ok = False
    try:
        took = wait_healthy(proc, base, args.start_timeout, "launch_server")
        print(f"[sglang_run] serve: healthy after {took:.0f} s", flush=True)
        rng = random.Random(7)
        jobs = []
        for i in range(args.requests):
            n = [1, 5, 60, 200, 700, 1500, 2500][i % 7] + rng.randrange(0, 30)
            jobs.append((" ".join(f"w{rng.randrange(2, 1024)}" for _ in range(n)), [1, 8, 32, 64, 128][i % 5]))

        def one(job):
            text, max_new = job
            t = time.time()
            params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
            r = post_json(f"{base}/generate", {"text": text, "sampling_params": params}, 300)
            return r, max_new, time.time() - t

        t1 = time.time()
        with ThreadPoolExecutor(max_workers=args.requests) as pool:
            results = list(pool.map(one, jobs, timeout=600))
        wall = time.time() - t1
        bad = [(r["meta_info"].get("completion_tokens"), m) for r, m, _ in results
               if r["meta_info"].get("completion_tokens") != m or not isinstance(r.get("text"), str)]
        print(f"[sglang_run] serve: {len(results)} concurrent requests in {wall:.1f} s (slowest "
              f"{max(dt for *_, dt in results):.1f} s), wrong token counts: {bad}", flush=True)
        log_text = log_path.read_text()
        ours_logged = "MLA decode attention runs on flashmla_backend" in log_text
        if args.backend == "flashmla_backend":
            print(f"[sglang_run] serve: log shows flashmla_backend decode: {ours_logged}", flush=True)
            if args.dcp > 1:
                dcp_logged = DCP_LOG_LINE in log_text
                print(f"[sglang_run] serve: log shows the DCP path: {dcp_logged}", flush=True)
                ours_logged = ours_logged and dcp_logged
            if args.kv_cache_dtype == "fp8_e4m3":
                from flashmla_backend.engine_support import default_scale_message

                fp8_logged = FP8_LOG_LINE in log_text
                default_scale_lines = log_text.count(default_scale_message("sglang"))
                print(f"[sglang_run] serve: log shows the FP8 KV cache: {fp8_logged}; default-scale lines: "
                      f"{default_scale_lines} (one per scheduler process expected)", flush=True)
                ours_logged = ours_logged and fp8_logged and default_scale_lines >= 1
        dsa_problem = _dsa_log_problem(args.backend, log_text)
        if args.backend == "dsa":
            print(f"[sglang_run] serve: DSA decode in the log: {dsa_problem or 'as asked'}", flush=True)
        ok = not bad and (ours_logged or args.backend != "flashmla_backend") and dsa_problem is None
    except Exception as e:  # noqa: BLE001 - reported with the server log's tail
        print(f"[sglang_run] serve failed: {e}\n" + "".join(log_path.read_text().splitlines(True)[-30:]), flush=True)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        print(f"[sglang_run] serve: server stopped (exit code {proc.returncode})", flush=True)
    return 0 if ok else 1


def logcheck(args) -> int:
    problem = _dsa_log_problem(args.backend, Path(args.log).read_text(errors="replace"))
    print(f"[sglang_run] {args.log}: {problem or 'the decode the environment asked for'}", flush=True)
    return 1 if problem else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", required=True)
    r.add_argument("--backend", required=True, help="flashmla_backend, triton, ...")
    r.add_argument("--prompts", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--max-tokens", type=int, default=32)
    r.add_argument("--logprobs", type=int, default=5)
    r.add_argument("--disable-cuda-graph", action="store_true")
    r.add_argument("--mtp", type=int, default=0, metavar="STEPS",
                   help="speculative decoding with the checkpoint's MTP layer: STEPS draft steps, topk 1")
    r.add_argument("--kv-splits", type=int, default=0, help="triton_attention_num_kv_splits (triton backend)")
    r.add_argument("--kv-cache-dtype", default="auto", help="SGLang's --kv-cache-dtype (default auto; fp8_e4m3: FP8)")
    r.add_argument("--dsa-decode-backend", help="with --backend dsa: SGLang's DSA decode kernel (e.g. flashmla_kv)")
    c = sub.add_parser("compare")
    c.add_argument("ours")
    c.add_argument("ref")
    c.add_argument("--expect", choices=("agree", "disagree"), default="agree")
    c.add_argument("--tie-gap-from", help="JSON written by `calibrate` (default: the vLLM test's TIE_GAP)")
    c.add_argument("--fp32-model", metavar="DIR",
                   help="judge both runs against this checkpoint in fp32 (transformers), see fp32_oracle.fp32_verdict()")
    c.add_argument("--prompts", help="prompts.json of the runs (needed with --fp32-model)")
    c.add_argument("--min-accept-ratio", type=float,
                   help="speculative runs: ours' mean accept length / the reference's must be at least this")
    k = sub.add_parser("calibrate")
    k.add_argument("pairs", nargs="+", metavar="A.json,B.json", help="two runs of correct configurations")
    k.add_argument("--out", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--model", required=True)
    s.add_argument("--backend", default="flashmla_backend")
    s.add_argument("--requests", type=int, default=64)
    s.add_argument("--log", required=True)
    s.add_argument("--start-timeout", type=float, default=300)
    s.add_argument("--kv-cache-dtype", default="auto", help="SGLang's --kv-cache-dtype (default auto; fp8_e4m3: FP8)")
    s.add_argument("--dsa-decode-backend", help="with --backend dsa: SGLang's DSA decode kernel (e.g. flashmla_kv)")
    s.add_argument("--dcp", type=int, default=1, metavar="N",
                   help="TP N + DCP N (SGLang's --dcp-size, N GPUs): the backend decodes, flashinfer prefills")
    g = sub.add_parser("logcheck", help="a run's log shows the DSA decode its environment asked for")
    g.add_argument("log")
    g.add_argument("--backend", required=True)
    args = ap.parse_args(argv)
    commands = {"run": run, "compare": compare, "calibrate": calibrate, "serve": serve, "logcheck": logcheck}
    return commands[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
