"""sglang_run.py's `run` at TP N + DCP N (SGLang's --dcp-size), for the decode-context-parallel check on N GPUs.

    python integration/sglang_dcp_run.py --dcp 2 --decode-backend flashmla_backend -- \
        run --model DIR --backend flashmla_backend --prompts prompts.json --out ours-dcp2.json

Every sglang.Engine that sglang_run.py builds gets tp_size = dcp_size = N, prefill on --prefill-backend (default
flashinfer: the plugin serves only decode under DCP) and decode on --decode-backend (flashmla_backend for ours,
flashinfer for the reference). Exits 0 with a SKIP line when fewer than N GPUs are visible or the installed SGLang
has no dcp_size server argument.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dcp", type=int, default=2)
    ap.add_argument("--prefill-backend", default="flashinfer")
    ap.add_argument("--decode-backend", required=True)
    args = ap.parse_args(own)

    import torch

    if torch.cuda.device_count() < args.dcp:
        print(f"[sglang_dcp_run] SKIP: TP {args.dcp} + DCP {args.dcp} needs {args.dcp} GPUs, "
              f"{torch.cuda.device_count()} visible", flush=True)
        return 0
    import dataclasses

    import sglang
    from sglang.srt.server_args import ServerArgs

    if "dcp_size" not in {f.name for f in dataclasses.fields(ServerArgs)}:
        print(f"[sglang_dcp_run] SKIP: SGLang {sglang.__version__} has no --dcp-size", flush=True)
        return 0
    original = sglang.Engine

    def engine(*a, **kw):
        kw.pop("attention_backend", None)
        kw.update(tp_size=args.dcp, dcp_size=args.dcp, prefill_attention_backend=args.prefill_backend,
                  decode_attention_backend=args.decode_backend)
        print(f"[sglang_dcp_run] tp_size={args.dcp} dcp_size={args.dcp} prefill={args.prefill_backend} "
              f"decode={args.decode_backend}", flush=True)
        return original(*a, **kw)

    sglang.Engine = engine
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import sglang_run

    return sglang_run.main(rest)


if __name__ == "__main__":
    sys.exit(main())
