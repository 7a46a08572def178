#!/usr/bin/env python3
"""End-to-end decode throughput of vLLM's MLA backends, ours (CUSTOM) included, in one run.

    python integration/bench_vllm_throughput.py [--backends CUSTOM,FLASHMLA,FLASH_ATTN_MLA,TRITON_MLA]

Shape where attention dominates a decode step: the 8-layer, 128-head DeepSeek-V3
config in integration/models/tiny-deepseek-v3-h128-8layer, 64 prompts of 7000 random tokens, prefix
caching off, greedy with ignore_eos. Weights are vLLM's dummy weights and no tokenizer is loaded
(token-id prompts): outputs do not matter here, only time. For each backend, in its own process:
    decode time = time(generate 1025 tokens) - time(generate 1 token)
(both runs prefill the same prompts, so the difference is 1024 decode steps; short outputs would hide
decode inside chunked prefill). Prints a table: decode tokens/s = 64 * 1024 / decode time, ms per
step, and each backend relative to FLASHMLA.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

DEFAULT_BACKENDS = "CUSTOM,FLASHMLA,FLASH_ATTN_MLA,TRITON_MLA"
MODEL_DIR = harness.MODELS / "tiny-deepseek-v3-h128-8layer"


def worker(args) -> int:
    """Runs inside the per-backend subprocess; writes the timings to --out."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(args.seed)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(2, vocab) for _ in range(args.prompt_len)])
               for _ in range(args.num_prompts)]
    t0 = time.time()
    llm = LLM(model=args.model, attention_backend=args.worker, load_format="dummy", skip_tokenizer_init=True,
              enable_prefix_caching=False, max_model_len=args.prompt_len + args.output_len + 64,
              max_num_seqs=args.num_prompts, gpu_memory_utilization=args.gpu_memory_utilization, seed=0)
    init_s = time.time() - t0

    def timed(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        t = time.time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.time() - t
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return dt

    timed(8)  # warm-up: first-use allocations and kernel selection outside the measurement
    t_1 = min(timed(1) for _ in range(args.repeats))
    t_n = min(timed(args.output_len) for _ in range(args.repeats))
    steps = args.output_len - 1
    decode_s = t_n - t_1
    result = {"backend": args.worker, "vllm_version": vllm.__version__, "init_s": init_s, "t_1": t_1, "t_n": t_n,
              "decode_s": decode_s, "decode_tok_s": args.num_prompts * steps / decode_s,
              "ms_per_step": decode_s / steps * 1e3}
    Path(args.out).write_text(json.dumps(result))
    print(f"[bench] {args.worker}: {json.dumps(result)}", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default=DEFAULT_BACKENDS)
    ap.add_argument("--model", default=str(MODEL_DIR), help="a directory with a DeepSeek-V3 config.json")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=7000)
    ap.add_argument("--output-len", type=int, default=1025)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per length (the minimum is kept)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=harness.RUN_TIMEOUT_S, help="seconds per backend")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)

    results, failures = [], []
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        out = harness.RUN_DIR / f"bench-{backend.lower()}.json"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--worker", backend, "--out", str(out), "--model", args.model,
               "--num-prompts", str(args.num_prompts), "--prompt-len", str(args.prompt_len),
               "--output-len", str(args.output_len), "--repeats", str(args.repeats),
               "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--seed", str(args.seed)]
        try:
            log = harness.run_logged(f"bench-{backend.lower()}", cmd, harness.engine_env(), timeout_s=args.timeout)
            if backend == "CUSTOM" and "MLA decode attention runs on flashmla_backend" not in log:
                raise harness.RunFailed("CUSTOM run: the log does not show flashmla_backend running decode")
            results.append(json.loads(out.read_text()))
        except harness.RunFailed as e:
            failures.append((backend, str(e).splitlines()[0]))
            print(e, flush=True)

    base = next((r for r in results if r["backend"] == "FLASHMLA"), None)
    print(f"\nDecode throughput: {args.num_prompts} prompts x {args.prompt_len} tokens, "
          f"decode = t({args.output_len} tokens) - t(1 token), model {Path(args.model).name}")
    print(f"{'backend':<16}{'t(1) s':>9}{f't({args.output_len}) s':>12}{'decode tok/s':>14}{'ms/step':>10}"
          f"{'vs FLASHMLA':>13}")
    for r in results:
        rel = f"{r['decode_tok_s'] / base['decode_tok_s']:.3f}x" if base else "-"
        print(f"{r['backend']:<16}{r['t_1']:>9.2f}{r['t_n']:>12.2f}{r['decode_tok_s']:>14,.0f}"
              f"{r['ms_per_step']:>10.3f}{rel:>13}")
    for backend, why in failures:
        print(f"{backend:<16}FAILED: {why}")
    harness.write_json(harness.RUN_DIR / "bench.json", {"results": results, "failures": failures})
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
