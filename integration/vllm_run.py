#!/usr/bin/env python3
"""One vLLM engine run in its own process (so every run starts from a clean GPU and its own env).

    python integration/vllm_run.py --model DIR --backend CUSTOM --prompts prompts.json --out result.json \
        [--max-tokens 32] [--logprobs 5] [--enforce-eager] [--tp 2] [--mtp 2] [--block-size 64]

prompts.json: a list of prompts, each a list of token ids. Greedy decoding (temperature 0, ignore_eos so
every run generates exactly --max-tokens tokens). result.json:
  {"backend", "vllm_version", "init_s", "generate_s",
   "outputs": [{"token_ids": [...], "logprobs": [{"<token id>": logprob, ...} per generated token]}]}
Each position's dict has the top --logprobs tokens plus the chosen one.

The test harness (integration/conftest.py) runs this with VLLM_USE_FLASHINFER_SAMPLER=0 and
HF_HUB_OFFLINE=1, and with the plugin discoverable through the vllm.general_plugins entry point.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", required=True, help="attention backend: CUSTOM, TRITON_MLA, FLASHMLA, ...")
    ap.add_argument("--prompts", required=True, help="JSON file: list of token-id lists")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--mtp", type=int, default=0, help="MTP speculative tokens (0: off)")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--load-format", default="auto")
    args = ap.parse_args(argv)

    for var in ("VLLM_USE_FLASHINFER_SAMPLER", "HF_HUB_OFFLINE"):
        if var not in os.environ:
            print(f"[vllm_run] warning: {var} is not set", file=sys.stderr, flush=True)

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.load(open(args.prompts))
    kwargs = dict(
        model=args.model, attention_backend=args.backend, enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tp, max_model_len=args.max_model_len, seed=0,
        gpu_memory_utilization=args.gpu_memory_utilization, load_format=args.load_format,
        max_logprobs=max(20, args.logprobs),
    )
    if args.block_size:
        kwargs["block_size"] = args.block_size
    if args.mtp:
        kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": args.mtp}
    print(f"[vllm_run] vLLM {vllm.__version__}: {json.dumps({k: v for k, v in kwargs.items() if k != 'model'})}",
          flush=True)
    t0 = time.time()
    llm = LLM(**kwargs)
    init_s = time.time() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=args.logprobs, ignore_eos=True)
    t1 = time.time()
    results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    generate_s = time.time() - t1

    outputs = []
    for r in results:
        c = r.outputs[0]
        positions = []
        for pos in range(len(c.token_ids)):
            lp = c.logprobs[pos]
            positions.append({str(tok): float(v.logprob) for tok, v in lp.items()})
        outputs.append({"token_ids": list(c.token_ids), "logprobs": positions})
    with open(args.out, "w") as f:
        json.dump({"backend": args.backend, "vllm_version": vllm.__version__, "init_s": init_s,
                   "generate_s": generate_s, "outputs": outputs}, f)
    print(f"[vllm_run] {args.backend}: {len(prompts)} prompts, init {init_s:.1f} s, generate {generate_s:.1f} s",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
