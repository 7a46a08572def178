"""vllm_run.py with decode context parallelism: the same run and result file, the engine made with
--decode-context-parallel-size N (and optionally --cp-kv-cache-interleave-size I).

    python integration/vllm_dcp_run.py --dcp 2 [--interleave 1] -- <vllm_run.py arguments, e.g. --tp 2>

vLLM requires the DCP size to divide the tensor-parallel size (the DCP group reuses the TP ranks: with TP 2
and DCP 2 each rank keeps half of every request's tokens and all ranks attend with all heads).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import vllm_run  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dcp", type=int, required=True, help="decode context parallel size")
    ap.add_argument("--interleave", type=int, default=1, help="cp_kv_cache_interleave_size (default 1)")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then vllm_run.py's arguments")
    args = ap.parse_args(argv)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest

    import vllm

    engine = vllm.LLM

    def llm_with_dcp(**kwargs):
        kwargs["decode_context_parallel_size"] = args.dcp
        kwargs["cp_kv_cache_interleave_size"] = args.interleave
        print(f"[vllm_dcp_run] decode_context_parallel_size={args.dcp}, cp_kv_cache_interleave_size="
              f"{args.interleave}", flush=True)
        return engine(**kwargs)

    vllm.LLM = llm_with_dcp  # vllm_run.main imports LLM from vllm when it runs
    return vllm_run.main(rest)


if __name__ == "__main__":
    sys.exit(main())
