#!/usr/bin/env python3
"""One SGLang engine run (offline `sglang.Engine`), greedy, with logprobs; and the comparison of two runs.

    python integration/sglang_run.py run --model DIR --backend flashmla_backend --prompts prompts.json \
        --out ours.json [--max-tokens 32] [--logprobs 5] [--disable-cuda-graph]
    python integration/sglang_run.py compare ours.json triton.json [--expect disagree]

prompts.json: a list of prompts, each a list of token ids. The result has the same format as
integration/vllm_run.py's ({"outputs": [{"token_ids": [...], "logprobs": [{"<id>": logprob, ...}, ...]}]}),
so `compare` applies the vLLM engine test's criteria (integration/test_vllm_engine_gpu.py: compare()).

The plugin is found through SGLang's `sglang.srt.plugins` entry point. In a source checkout that is not
pip-installed (the GPU machine: sources + an in-place build on PYTHONPATH), `run` declares the entry point
from a minimal dist-info folder put on PYTHONPATH before SGLang starts, so every SGLang process loads the
plugin through its normal mechanism. Start-up options: page size is forced to 64 by the plugin; sampling
runs in PyTorch and grammar is off (neither needs FlashInfer nor xgrammar's native library).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENTRY_POINT = "flashmla_backend = flashmla_backend.sglang:register"


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
    engine = sglang.Engine(model_path=args.model, attention_backend=args.backend, skip_tokenizer_init=True,
                           sampling_backend="pytorch", grammar_backend="none", mem_fraction_static=0.5,
                           disable_cuda_graph=args.disable_cuda_graph,
                           context_length=4096, log_level="info", random_seed=0)
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
        outputs.append({"token_ids": token_ids, "logprobs": lps})
    Path(args.out).write_text(json.dumps({"backend": args.backend, "sglang_version": sglang.__version__,
                                          "init_s": init_s, "generate_s": gen_s, "outputs": outputs}))
    print(f"[sglang_run] {args.backend}: {len(prompts)} prompts, init {init_s:.1f} s, generate {gen_s:.1f} s",
          flush=True)
    return 0


def compare(args) -> int:
    sys.path.insert(0, str(HERE))
    from test_vllm_engine_gpu import compare as compare_runs  # the vLLM engine test's criteria

    runs = []
    for p in (args.ours, args.ref):
        r = json.loads(Path(p).read_text())
        r["name"] = f"{r['backend']}({Path(p).stem})"
        runs.append(r)
    ok = compare_runs(runs[0], runs[1])["ok"]
    want = args.expect == "agree"
    print(f"[sglang_run] expected {args.expect}: {'as expected' if ok == want else 'NOT as expected'}", flush=True)
    return 0 if ok == want else 1


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
    c = sub.add_parser("compare")
    c.add_argument("ours")
    c.add_argument("ref")
    c.add_argument("--expect", choices=("agree", "disagree"), default="agree")
    args = ap.parse_args(argv)
    return run(args) if args.cmd == "run" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
