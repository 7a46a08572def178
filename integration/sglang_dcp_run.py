"""sglang_run.py's `run` at TP N + DCP N (SGLang's --dcp-size), for the decode-context-parallel check on N GPUs.

    python integration/sglang_dcp_run.py --dcp 2 --decode-backend flashmla_backend -- \
        run --model DIR --backend flashmla_backend --prompts prompts.json --out ours-dcp2.json

Every sglang.Engine that sglang_run.py builds gets tp_size = dcp_size = N, prefill on --prefill-backend (default
flashinfer: the plugin serves only decode under DCP) and decode on --decode-backend (flashmla_backend for ours,
flashinfer for the reference), and SGLang's own all-reduce paths off: its custom all-reduce and the FlashInfer
all-reduce + RMSNorm fusion that SGLang turns on by itself for DeepSeek models on SM90 when TP > 1. On a 2-GPU H200
host SGLang 0.5.17 hung in every TP 2 + DCP 2 start-up right after that fusion had allocated its workspace (the
log's last lines are three FlashInfer "SymmDeviceMemory" ones a rank: a buffer, its flags and a Lamport buffer; with
flashinfer as the decode backend as with ours), before CUDA-graph capture, also with the custom all-reduce off. The
check is about attention: NCCL's all-reduce serves it. Exits 0 with a SKIP line when fewer than N GPUs are visible
or the installed SGLang has no dcp_size server argument.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def server_arg_names(server_args_cls) -> set[str]:
    """The fields of SGLang's ServerArgs: a dataclass up to 0.5.17, a msgspec Struct in later releases."""
    import dataclasses

    if dataclasses.is_dataclass(server_args_cls):
        return {f.name for f in dataclasses.fields(server_args_cls)}
    return set(getattr(server_args_cls, "__struct_fields__", ()))


def engine_overrides(dcp: int, prefill_backend: str, decode_backend: str) -> dict:
    """The sglang.Engine arguments this wrapper sets (the docstring above says why SGLang's all-reduce paths are
    off)."""
    return dict(tp_size=dcp, dcp_size=dcp, prefill_attention_backend=prefill_backend,
                decode_attention_backend=decode_backend, disable_custom_all_reduce=True,
                enforce_disable_flashinfer_allreduce_fusion=True)


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
    import sglang
    from sglang.srt.server_args import ServerArgs

    if "dcp_size" not in server_arg_names(ServerArgs):
        print(f"[sglang_dcp_run] SKIP: SGLang {sglang.__version__} has no --dcp-size", flush=True)
        return 0
    original = sglang.Engine

    def engine(*a, **kw):
        kw.pop("attention_backend", None)
        kw.update(engine_overrides(args.dcp, args.prefill_backend, args.decode_backend))
        print(f"[sglang_dcp_run] tp_size={args.dcp} dcp_size={args.dcp} prefill={args.prefill_backend} "
              f"decode={args.decode_backend}", flush=True)
        return original(*a, **kw)

    sglang.Engine = engine
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import sglang_run

    return sglang_run.main(rest)


if __name__ == "__main__":
    sys.exit(main())
