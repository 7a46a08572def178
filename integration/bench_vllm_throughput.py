#!/usr/bin/env python3
"""End-to-end decode throughput of vLLM's MLA backends, ours (CUSTOM) included, with 16-bit and FP8 KV caches.

Commands (each prints its plan first, one progress line per engine process, and a Markdown table at the end):

    python integration/bench_vllm_throughput.py
        CUSTOM, FLASHMLA, FLASH_ATTN_MLA, TRITON_MLA with the model's 16-bit cache: 1 round x 3 repeats
    python integration/bench_vllm_throughput.py --backends CUSTOM,FLASHMLA [--kv-cache-dtype fp8]
        the same for a shorter list; --kv-cache-dtype applies to every backend (CUSTOM with fp8: the plugin's
        default mode, fast)
    python integration/bench_vllm_throughput.py \\
        --configs CUSTOM:fp8:accurate,CUSTOM:fp8:fast,FLASHMLA:fp8,CUSTOM:auto,FLASHMLA:auto --rounds 2 --repeats 3
        the FP8 comparison: configs are BACKEND[:KVDTYPE[:MODE]], KVDTYPE auto or fp8 (default: --kv-cache-dtype),
        MODE accurate or fast (CUSTOM with fp8 only; FLASHMLA_BACKEND_FP8_MODE in that engine's environment)
    python integration/bench_vllm_throughput.py --capacity [--configs CUSTOM:fp8,CUSTOM:auto,FLASHMLA:fp8,FLASHMLA:auto]
        a batch that fits only with FP8 (default configs CUSTOM:fp8,CUSTOM:auto; see "Capacity" below)
    python integration/bench_vllm_throughput.py --dcp 2 --configs CUSTOM:auto,FLASHMLA:auto --rounds 4
        decode context parallelism: every engine at tensor_parallel_size 2 + decode_context_parallel_size 2, so
        each needs 2 GPUs (see "Decode context parallelism" below)
    python integration/bench_vllm_throughput.py --model integration/models/tiny-deepseek-v32-h128-8layer --rounds 2
        a DeepSeek-V3.2 model (sparse attention): default configs CUSTOM:fp8,FLASHMLA_SPARSE:fp8 (see "Sparse models")
    python integration/bench_vllm_throughput.py --dry-run [other options]
        prints the plan (processes in order, rough time) and starts nothing
    python integration/bench_vllm_throughput.py --table-from RUN.json [RUN2.json ...]
        the tables of earlier runs' results files, measurements of the same config merged (e.g. rounds run in
        separate calls: round 1 with --rounds 1, round 2 with --rounds 1 --first-round 2, then both files here)

Shape where attention dominates a decode step: the 8-layer, 128-head DeepSeek-V3 config in
integration/models/tiny-deepseek-v3-h128-8layer, 64 prompts of 7000 random tokens, prefix caching off, greedy with
ignore_eos, CUDA graphs. Weights are vLLM's dummy weights and no tokenizer is loaded (token-id prompts): outputs do
not matter here, only time (FP8 runs therefore use the default KV scale 1.0). Every config runs in its own engine
process; each process warms up once, then takes --repeats measurements:
    decode time = time(generate N tokens) - time(generate 1 token)     (N = --output-len, default 2049)
both runs prefill the same prompts, so the difference is N - 1 decode steps (2048 by default); short outputs would
hide decode inside chunked prefill. decode tokens/s = prompts x (N - 1) / decode time.

Single runs are not evidence: one backend's result moved by 38% between two runs on one H100. So:
  --rounds R     R engine processes per config; the order of the configs alternates, forward in round 1, reversed in
                 round 2, forward in round 3, ... (a slow drift of the machine then does not favour one config);
  --repeats K    K measurements inside each process (K x (t(1) + t(N)) after the start-up).
The table gives per config min / median / max of decode tokens/s over its R x K measurements, ms per step at the
median, the median t(1) (the prompts' prefill and their first token: a difference in prefill shows there), and each
config's median relative to the references FLASHMLA:fp8 and CUSTOM:auto (when they ran), marked "apart" when the
two configs' [min, max] ranges do not overlap (a difference beyond the spread, which a README may claim) or
"overlap" (not established by these runs; "no spread" with fewer than 2 measurements).

Time: every process pays vLLM's start-up (torch.compile and CUDA-graph capture, about 30-60 s on an H100; vLLM caches
compiled graphs on disk, so later processes of the same config start faster) plus K x (t(1) + t(N)), about 3 + 9 s at
the default shape on an H100. The plan line estimates the whole run. When device time is short, use --rounds 1
--repeats 3: one start-up per config, and the repeats still give a spread (of one process: the process-to-process
spread is then not measured, and the table says "1 round"). A call limited to 10 minutes fits about 5 configs x 1
round; more rounds can run in separate calls (--first-round) and be merged with --table-from.

Decode context parallelism (--dcp N, default 1 = off): every engine of the run is made with
tensor_parallel_size=N and decode_context_parallel_size=N (vLLM 0.26 engine arguments, as integration/vllm_run.py
--tp and integration/vllm_dcp_run.py --dcp pass them): vLLM's DCP group reuses the tensor-parallel ranks, so it needs
TP >= DCP (DCP dividing TP), and each engine needs N GPUs; the script refuses to start when
torch.cuda.device_count() is below N (--dry-run does not check). Each rank keeps 1/N of every request's tokens and
attends with all heads; vLLM merges the partial results. The comparison of ours against vLLM's FLASHMLA at TP 2 +
DCP 2 on two GPUs:
    python integration/bench_vllm_throughput.py --dcp 2 --configs CUSTOM:auto,FLASHMLA:auto --rounds 4
(alternating order and repeats as above; the table's "vs CUSTOM:auto" column is FLASHMLA against ours). CUSTOM runs
must also log "decode context parallelism (rank" on our decode line (checked). The DCP size is in the plan, in every
record of the results JSON ("dcp"; records of older files without it count as DCP 1) and in the tables (a header
line; rows of DCP N > 1 read "CONFIG (DCP N)", and ratios are taken against the reference at the same DCP size, so
results of different DCP sizes merged with --table-from stay apart). Not with --capacity (its cap is sized for one
GPU holding the whole batch).

Sparse models: a --model whose config.json says model_type deepseek_v32 (DeepSeek-V3.2: vLLM's indexer picks the
tokens each query attends) runs the sparse backends: ours (CUSTOM, with FLASHMLA_BACKEND_SPARSE_GPU=1 in its
environment, its log checked for our sparse attention on the configured cache) and vLLM's FLASHMLA_SPARSE, by default
both on the fp8 cache, which vLLM stores as fp8_ds_mla for these models; CUSTOM:auto,FLASHMLA_SPARSE:auto runs the
bf16 cache (ours gathers the tokens for the dense kernel; the sparse backends have no FP8 query modes). Not with --capacity or --dcp. vLLM's indexer needs its vendored DeepGEMM
(integration/README.md). integration/models/tiny-deepseek-v32-h128-8layer is the default shape's model as
DeepSeek-V3.2 (8 layers, 128 heads, index_topk 2048 as in the real model): at the default 7000-token prompts every
decode step attends 2048 tokens a request.

Capacity (--capacity): vLLM's KV cache is capped with kv_cache_memory_bytes (LLM(...) argument, ignores
gpu_memory_utilization) at --capacity-headroom (1.05) x the bytes an FP8 cache needs for the whole batch,
prompts x (prompt_len + output_len) tokens, each request rounded up to 256-token blocks (override:
--kv-cache-memory-bytes). An FP8 cache (576 bytes per token per layer) then holds every request at once; a bf16 cache
(1152 bytes) holds about half of them. The table reports the KV capacity vLLM logs ("GPU KV cache size: N tokens",
"Maximum concurrency for L tokens per request: Xx"), whether the batch fits, vLLM's preemption count per timed run,
decode tokens/s by the same t(N) - t(1) method, and end-to-end tokens/s = prompts x N / t(N). Read them this way:
with a cache that holds the batch, t(N) - t(1) is pure decode as in the main table. With a cache that does not,
vLLM admits what fits, queues the rest and preempts (recomputes) requests when decoding runs out of blocks, so
t(1) already contains prefill in waves and t(N) - t(1) contains the later waves' prefill, the recomputation of
preempted requests and decode at smaller batches: it is the cost of generating N - 1 more tokens per request with
that cache, not the speed of a decode step. That is the quantity capacity buys; the end-to-end column says the same
without the subtraction.

Results: $FLASHMLA_BACKEND_RUN_DIR/bench.json (bench-capacity.json with --capacity, bench-dcp<N>.json with --dcp N > 1;
--results PATH), rewritten after every process, so a run cut short still leaves its measurements; engine logs next to
it (bench-r<round>-<config>.log, bench-r<round>-<config>-dcp<N>.log with --dcp N > 1).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

DEFAULT_BACKENDS = "CUSTOM,FLASHMLA,FLASH_ATTN_MLA,TRITON_MLA"
DEFAULT_CAPACITY_CONFIGS = "CUSTOM:fp8,CUSTOM:auto"
DEFAULT_SPARSE_CONFIGS = "CUSTOM:fp8,FLASHMLA_SPARSE:fp8"   # a DeepSeek-V3.2 --model (see "Sparse models" above)
MODEL_DIR = harness.MODELS / "tiny-deepseek-v3-h128-8layer"
KV_DTYPES = ("auto", "fp8")
FP8_MODES = ("accurate", "fast")
FP8_MODE_ENV = "FLASHMLA_BACKEND_FP8_MODE"
DEFAULT_FP8_MODE = "fast"   # the plugin's vLLM mode with FP8_MODE_ENV unset (engine_support.DEFAULT_FP8_MODES)
SPARSE_GPU_ENV = "FLASHMLA_BACKEND_SPARSE_GPU"   # flashmla_backend._env's names (the driver does not import the package)
REFERENCES = ("FLASHMLA:fp8", "FLASHMLA_SPARSE:fp8", "CUSTOM:auto")   # the throughput table's ratio columns
CAPACITY_REFERENCE = "CUSTOM:auto"
OUR_LOG_LINE = "MLA decode attention runs on flashmla_backend"
OUR_SPARSE_LOG_LINE = "sparse MLA attention (DeepSeek-V3.2 indexer) runs on flashmla_backend"
LATENT_BYTES_PER_TOKEN = 576                       # kv_lora_rank 512 + rope 64, one byte each in e4m3
CAPACITY_BLOCK_ROUNDING = 256                      # largest KV block size: each request rounded up to it
# Rough H100 figures at the default shape, for the plan line only.
EST_STARTUP_S, EST_T1_S, EST_STEP_S = 50.0, 3.0, 0.0045


# ---- configs ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """One engine configuration: attention backend, KV-cache dtype, and for CUSTOM with fp8 the query mode."""

    backend: str
    kv: str = "auto"
    mode: str | None = None
    sparse: bool = False   # the model is DeepSeek-V3.2 (sparse attention); not part of the label

    @property
    def label(self) -> str:
        return ":".join(p for p in (self.backend, self.kv, self.mode) if p)

    @property
    def slug(self) -> str:
        return self.label.lower().replace(":", "-").replace("_", "-")

    @property
    def fp8(self) -> bool:
        return self.kv == "fp8"


def parse_config(item: str, default_kv: str = "auto", sparse: bool = False) -> Config:
    """BACKEND[:KVDTYPE[:MODE]] -> Config; KVDTYPE defaults to default_kv, CUSTOM with fp8 to the plugin's default
    mode. sparse: for a DeepSeek-V3.2 model, whose sparse backend has no query modes."""
    parts = [p.strip() for p in item.strip().split(":")]
    if not parts[0] or len(parts) > 3 or any(not p for p in parts):
        raise ValueError(f"config {item!r}: expected BACKEND[:KVDTYPE[:MODE]], e.g. CUSTOM:fp8:fast or FLASHMLA:auto")
    backend = parts[0].upper()
    if not backend.replace("_", "").isalnum():
        raise ValueError(f"config {item!r}: backend {parts[0]!r} is not a vLLM backend name (letters, digits, _)")
    kv = parts[1].lower() if len(parts) > 1 else default_kv
    if kv not in KV_DTYPES:
        raise ValueError(f"config {item!r}: KV-cache dtype {kv!r}; expected one of {', '.join(KV_DTYPES)}")
    mode = parts[2].lower() if len(parts) > 2 else None
    if sparse:
        if mode is not None:
            raise ValueError(f"config {item!r}: a DeepSeek-V3.2 model's sparse attention has no FP8 query modes "
                             f"(give BACKEND:fp8)")
        return Config(backend, kv, None, sparse=True)
    if mode is not None:
        if mode not in FP8_MODES:
            raise ValueError(f"config {item!r}: mode {mode!r}; expected one of {', '.join(FP8_MODES)}")
        if backend != "CUSTOM" or kv != "fp8":
            raise ValueError(f"config {item!r}: a mode applies only to CUSTOM with an fp8 KV cache "
                             f"({FP8_MODE_ENV} is read by flashmla_backend's plugin)")
    if backend == "CUSTOM" and kv == "fp8" and mode is None:
        mode = DEFAULT_FP8_MODE   # the plugin's default, made explicit in the label
    return Config(backend, kv, mode)


def parse_configs(text: str, default_kv: str = "auto", sparse: bool = False) -> list[Config]:
    return checked_configs([parse_config(item, default_kv, sparse) for item in text.split(",") if item.strip()])


def checked_configs(configs: list[Config]) -> list[Config]:
    """configs as given, refused when empty or when a label is given twice (bench_sglang_throughput.py too)."""
    if not configs:
        raise ValueError("no configs given")
    labels = [c.label for c in configs]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ValueError(f"config(s) given twice: {', '.join(dupes)}")
    return configs


def round_orders(configs: list[Config], rounds: int, first_round: int = 1) -> list[tuple[int, Config]]:
    """(round, config) in run order: forward in odd rounds, reversed in even ones (round numbers from first_round)."""
    plan = []
    for r in range(first_round, first_round + rounds):
        plan += [(r, c) for c in (configs if r % 2 == 1 else configs[::-1])]
    return plan


def config_env(cfg: Config, base: dict | None = None) -> dict:
    """The engine process's environment: the harness's, with FLASHMLA_BACKEND_FP8_MODE only for CUSTOM with fp8, and
    FLASHMLA_BACKEND_SPARSE_GPU=1 for CUSTOM on a sparse model (without it the plugin's sparse backend refuses GPUs)."""
    env = dict(harness.engine_env() if base is None else base)
    env.pop(FP8_MODE_ENV, None)
    env.pop(SPARSE_GPU_ENV, None)
    if cfg.mode:
        env[FP8_MODE_ENV] = cfg.mode
    if cfg.sparse and cfg.backend == "CUSTOM":
        env[SPARSE_GPU_ENV] = "1"
    return env


def custom_log_problem(log: str, cfg: Config, dcp: int = 1) -> str | None:
    """None when a CUSTOM run's log shows our decode (and, with fp8, the FP8 cache in the requested mode; with
    dcp > 1, decode context parallelism)."""
    if cfg.backend != "CUSTOM":
        return None
    if cfg.sparse:
        sparse = [line for line in log.splitlines() if OUR_SPARSE_LOG_LINE in line]
        cache = "fp8_ds_mla" if cfg.fp8 else "(16-bit)"   # the plugin's line: "KV cache fp8_ds_mla ..." / "auto (16-bit)"
        if not any(cache in line for line in sparse):
            return (f"{cfg.label}: the log does not show flashmla_backend's sparse attention on the {cache} cache "
                    f"({OUR_SPARSE_LOG_LINE!r})")
        return None
    ours = [line for line in log.splitlines() if OUR_LOG_LINE in line]
    if not ours:
        return f"{cfg.label}: the log does not show flashmla_backend running decode ({OUR_LOG_LINE!r})"
    if cfg.fp8 and not any("FP8 KV cache" in line and f"mode {cfg.mode}" in line for line in ours):
        return (f"{cfg.label}: the log's flashmla_backend line does not say 'FP8 KV cache' and 'mode {cfg.mode}': "
                f"{ours[0].strip()!r}")
    if not cfg.fp8 and any("FP8 KV cache" in line for line in ours):
        return f"{cfg.label}: a 16-bit run whose log says 'FP8 KV cache': {ours[0].strip()!r}"
    if dcp > 1 and not any(harness.OUR_DCP_LOG_WORDS in line for line in ours):
        return (f"{cfg.label} at DCP {dcp}: the log's flashmla_backend line does not mention decode context "
                f"parallelism ({harness.OUR_DCP_LOG_WORDS!r}): {ours[0].strip()!r}")
    return None


def record_dcp(record: dict) -> int:
    """The DCP size of a results record (measurement, process, failure); records of files written before --dcp
    existed have none: 1."""
    return int(record.get("dcp") or 1)


def row_label(label: str, dcp: int) -> str:
    """A table row's name: the config's label, with ' (DCP N)' when N > 1."""
    return label if dcp == 1 else f"{label} (DCP {dcp})"


def _by_row(records: list[dict]) -> list[dict]:
    """Copies of the records with "config" replaced by row_label(config, DCP size)."""
    return [dict(r, config=row_label(r["config"], record_dcp(r))) for r in records]


def dcp_sizes(results: dict) -> list[int]:
    """The DCP sizes of a results dict's records (meta's "dcp", else 1, when it has none)."""
    records = results.get("measurements", []) + results.get("processes", []) + results.get("failures", [])
    return sorted({record_dcp(r) for r in records}) or [int(results["meta"].get("dcp") or 1)]


# ---- capacity -----------------------------------------------------------------------------------

def batch_tokens(num_prompts: int, prompt_len: int, output_len: int) -> int:
    return num_prompts * (prompt_len + output_len)


def capacity_kv_bytes(num_prompts: int, prompt_len: int, output_len: int, num_layers: int,
                      headroom: float = 1.05) -> int:
    """KV memory that holds the whole batch in an FP8 cache (each request rounded up to 256-token blocks, times
    headroom), and so about half of it in a bf16 cache."""
    per_request = -(-(prompt_len + output_len) // CAPACITY_BLOCK_ROUNDING) * CAPACITY_BLOCK_ROUNDING
    tokens = math.ceil(num_prompts * per_request * headroom)
    return tokens * num_layers * LATENT_BYTES_PER_TOKEN


def model_layers(model_dir: str) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"])


def parse_kv_capacity(log: str) -> dict:
    """vLLM 0.26's start-up lines (v1/core/kv_cache_utils.py): "GPU KV cache size: 309,632 tokens" and "Maximum
    concurrency for 9,113 tokens per request: 33.98x"; the last of each in the log (None when absent)."""
    import re

    out = {"kv_tokens": None, "concurrency_tokens_per_request": None, "max_concurrency": None}
    for m in re.finditer(r"GPU KV cache size: ([\d,]+) tokens", log):
        out["kv_tokens"] = int(m.group(1).replace(",", ""))
    for m in re.finditer(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", log):
        out["concurrency_tokens_per_request"] = int(m.group(1).replace(",", ""))
        out["max_concurrency"] = float(m.group(2))
    return out


def capacity_of(log: str, cache_config: dict) -> dict:
    """parse_kv_capacity(log), the token count taken from the front end's cache_config when the log lacks it."""
    cap = parse_kv_capacity(log)
    cap["source"] = "log"
    if cap["kv_tokens"] is None and cache_config.get("kv_cache_size_tokens") is not None:
        cap["kv_tokens"], cap["source"] = int(cache_config["kv_cache_size_tokens"]), "cache_config"
    if cap["max_concurrency"] is None and cache_config.get("kv_cache_max_concurrency") is not None:
        cap["max_concurrency"] = float(cache_config["kv_cache_max_concurrency"])
    return cap


# ---- statistics and tables ----------------------------------------------------------------------

def summarize(measurements: list[dict], labels: list[str], key: str = "decode_tok_s") -> dict[str, dict]:
    """Per config label: n, min, median, max of `key` over its measurements (labels without any are left out)."""
    out = {}
    for label in labels:
        vals = [m[key] for m in measurements if m["config"] == label and m.get(key) is not None]
        if vals:
            out[label] = {"n": len(vals), "min": min(vals), "median": statistics.median(vals), "max": max(vals)}
    return out


def versus(stats: dict[str, dict], label: str, ref: str) -> str:
    """'1.052x, apart' / '0.981x, overlap' / '1.000x (ref)' / '-' (reference absent); 'no spread' when either side
    has fewer than 2 measurements."""
    if ref not in stats or label not in stats:
        return "-"
    a, b = stats[label], stats[ref]
    ratio = a["median"] / b["median"]
    if label == ref:
        return f"{ratio:.3f}x (ref)"
    if a["n"] < 2 or b["n"] < 2:
        return f"{ratio:.3f}x, no spread"
    overlap = a["min"] <= b["max"] and b["min"] <= a["max"]
    return f"{ratio:.3f}x, {'overlap' if overlap else 'apart'}"


def _unique(values) -> str:
    seen = []
    for v in values:
        if v and v not in seen:
            seen.append(v)
    return " / ".join(seen) if seen else "unknown"


def header_lines(results: dict) -> list[str]:
    meta = results["meta"]
    procs = results.get("processes", [])
    rounds = sorted({p["round"] for p in procs}) or list(range(1, meta.get("rounds", 1) + 1))
    lines = [
        f"- date {meta.get('date', '?')}; GPU {_unique(p.get('gpu') for p in procs)}; vLLM "
        f"{_unique(p.get('vllm_version') for p in procs)}; torch {_unique(p.get('torch_version') for p in procs)}; "
        f"flashmla_backend {meta.get('git', 'unknown')}",
        f"- command: `{meta.get('command', '?')}`",
        f"- model {meta['model']}, {meta['num_prompts']} prompts x {meta['prompt_len']} tokens, "
        f"{meta['output_len'] - 1} decode steps (t({meta['output_len']} tokens) - t(1 token)), prefix caching off, "
        f"CUDA graphs; {len(rounds)} round{'s' if len(rounds) != 1 else ''} (order alternating) x "
        f"{meta['repeats']} repeats per config",
    ]
    sizes = dcp_sizes(results)
    if sizes == [1]:
        lines.append("- decode context parallel: none (DCP 1: tensor_parallel_size 1, one GPU per engine)")
    elif len(sizes) == 1:
        n = sizes[0]
        lines.append(f"- decode context parallel: DCP {n} for every config (tensor_parallel_size {n} + "
                     f"decode_context_parallel_size {n}, {n} GPUs per engine)")
    else:
        lines.append(f"- decode context parallel: DCP sizes {', '.join(map(str, sizes))} in these results (DCP N: "
                     "tensor_parallel_size N + decode_context_parallel_size N, N GPUs per engine); rows of DCP N > 1 "
                     "read \"CONFIG (DCP N)\", ratios are against the reference at the same DCP size")
    return lines


def throughput_table(results: dict) -> str:
    meta, ms = results["meta"], _by_row(results["measurements"])
    meta_dcp = int(meta.get("dcp") or 1)
    dcp_of = {m["config"]: record_dcp(m) for m in ms}
    labels = list(dict.fromkeys([row_label(c, meta_dcp) for c in meta["configs"]] + [m["config"] for m in ms]))
    stats = summarize(ms, labels)
    prefill = summarize(ms, labels, key="t_1")
    sizes = sorted(set(dcp_of.values())) or [meta_dcp]
    refs = [r for r in REFERENCES if any(row_label(r, d) in stats for d in sizes)]
    lines = ["### vLLM decode throughput (integration/bench_vllm_throughput.py)", ""] + header_lines(results) + [""]
    head = (["config", "n", "decode tok/s min", "median", "max", "ms/step (median)", "t(1) s (median)"]
            + [f"vs {r}" for r in refs])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in labels:
        if label not in stats:
            continue
        s = stats[label]
        ms_step = meta["num_prompts"] * 1e3 / s["median"]
        row = [label, str(s["n"]), f"{s['min']:,.0f}", f"{s['median']:,.0f}", f"{s['max']:,.0f}", f"{ms_step:.3f}",
               f"{prefill[label]['median']:.2f}" if label in prefill else "-"]
        d = dcp_of.get(label, meta_dcp)
        row += [versus(stats, label, row_label(r, d)) for r in refs]
        lines.append("| " + " | ".join(row) + " |")
    if refs:
        lines += ["", "Ratios are of medians. \"apart\": the two configs' [min, max] ranges do not overlap, so the "
                      "difference exceeds the spread of these runs; \"overlap\": it does not, and these runs do not "
                      "establish it."]
        if sizes != [1]:
            lines[-1] += " Each ratio is against the reference at the row's own DCP size."
    lines += _failure_lines(results)
    return "\n".join(lines)


def capacity_table(results: dict) -> str:
    meta, ms = results["meta"], _by_row(results["measurements"])
    meta_dcp = int(meta.get("dcp") or 1)
    dcp_of = {m["config"]: record_dcp(m) for m in ms}
    procs_by_row = _by_row(results.get("processes", []))
    labels = list(dict.fromkeys([row_label(c, meta_dcp) for c in meta["configs"]] + [m["config"] for m in ms]))
    stats = summarize(ms, labels)
    e2e = summarize(ms, labels, "e2e_tok_s")
    pre = summarize(ms, labels, "preemptions")
    need = meta["need_tokens"]
    lines = ["### KV-cache capacity: a batch that fits only with FP8 (integration/bench_vllm_throughput.py "
             "--capacity)", ""] + header_lines(results)
    kv_bytes = meta["kv_cache_memory_bytes"]
    lines.append(f"- kv_cache_memory_bytes {kv_bytes:,} ({kv_bytes / 2**30:.2f} GiB) for every config; the batch needs "
                 f"{need:,} tokens")
    lines += ["", "| config | KV cache tokens (vLLM) | holds the batch | max concurrency (vLLM) | preemptions per run "
                  "(median) | decode tok/s median [min, max] | end-to-end tok/s (median) | decode vs "
                  f"{CAPACITY_REFERENCE} |", "|" + "---|" * 8]
    for label in labels:
        procs = [p for p in procs_by_row if p["config"] == label]
        kv = [p.get("capacity", {}) for p in procs]
        tokens = _unique(f"{k['kv_tokens']:,}" for k in kv if k.get("kv_tokens") is not None)
        conc = _unique(f"{k['max_concurrency']:.2f}x for {k['concurrency_tokens_per_request']:,}"
                       for k in kv if k.get("max_concurrency") is not None)
        fits = _unique(("yes" if k["kv_tokens"] >= need else f"no ({k['kv_tokens'] / need:.0%})")
                       for k in kv if k.get("kv_tokens") is not None)
        s = stats.get(label)
        dec = f"{s['median']:,.0f} [{s['min']:,.0f}, {s['max']:,.0f}]" if s else "-"
        e = f"{e2e[label]['median']:,.0f}" if label in e2e else "-"
        p = f"{pre[label]['median']:g}" if label in pre else "-"
        rel = versus(stats, label, row_label(CAPACITY_REFERENCE, dcp_of.get(label, meta_dcp))) if s else "-"
        lines.append(f"| {label} | {tokens} | {fits} | {conc} | {p} | {dec} | {e} | {rel} |")
    lines += ["", "With a cache that does not hold the batch, vLLM queues and preempts requests: t(N) - t(1) then "
                  "includes prefill waves and recomputation, so the decode column is the cost of generating the "
                  "remaining tokens with that cache, not the speed of a decode step (see the script's docstring)."]
    lines += _failure_lines(results)
    return "\n".join(lines)


def _failure_lines(results: dict) -> list[str]:
    fails = results.get("failures", [])
    if not fails:
        return []
    return [""] + [f"- FAILED: {row_label(f['config'], record_dcp(f))} (round {f['round']}): {f['why']}" for f in fails]


def render(results: dict) -> str:
    return capacity_table(results) if results.get("kind") == "capacity" else throughput_table(results)


def merge_results(all_results: list[dict]) -> dict:
    """One results dict from several files of the same kind and shape (measurements, processes, failures joined)."""
    first = all_results[0]
    shape = ("kind", "model", "num_prompts", "prompt_len", "output_len", "kv_cache_memory_bytes")

    def key(r):
        return tuple(r.get(k) if k == "kind" else r["meta"].get(k) for k in shape)

    for r in all_results[1:]:
        if key(r) != key(first):
            raise ValueError(f"results of different runs: {dict(zip(shape, key(first)))} vs {dict(zip(shape, key(r)))}")
    merged = {"kind": first.get("kind", "throughput"), "meta": dict(first["meta"]),
              "processes": [], "measurements": [], "failures": []}
    configs = []
    for r in all_results:
        configs += [c for c in r["meta"]["configs"] if c not in configs]
        for k in ("processes", "measurements", "failures"):
            merged[k] += r.get(k, [])
    merged["meta"]["configs"] = configs
    if len(all_results) > 1:
        merged["meta"]["command"] = " + ".join(r["meta"].get("command", "?") for r in all_results)
        merged["meta"]["date"] = " / ".join(dict.fromkeys(r["meta"].get("date", "?") for r in all_results))
    return merged


# ---- the engine process -------------------------------------------------------------------------

def token_prompts(model: str, num_prompts: int, prompt_len: int, seed: int) -> list[list[int]]:
    """The benchmark's prompts: num_prompts lists of prompt_len random token ids of the model's vocabulary."""
    rng = random.Random(seed)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    return [[rng.randrange(2, vocab) for _ in range(prompt_len)] for _ in range(num_prompts)]


def engine_kwargs(cfg: Config, args) -> dict:
    """LLM(...) arguments of a config's engine: dummy weights, no tokenizer, no prefix caching, CUDA graphs."""
    kwargs = dict(model=args.model, attention_backend=cfg.backend, kv_cache_dtype=cfg.kv, load_format="dummy",
                  skip_tokenizer_init=True, enable_prefix_caching=False,
                  max_model_len=args.prompt_len + args.output_len + 64, max_num_seqs=args.num_prompts,
                  gpu_memory_utilization=args.gpu_memory_utilization, seed=0)
    if getattr(args, "kv_cache_memory_bytes", None):
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
        kwargs["disable_log_stats"] = False   # the preemption counter (llm.get_metrics)
    if getattr(args, "dcp", 1) > 1:   # vLLM 0.26 engine arguments, as vllm_run.py (--tp) and vllm_dcp_run.py pass them
        kwargs["tensor_parallel_size"] = args.dcp
        kwargs["decode_context_parallel_size"] = args.dcp
    return kwargs


def worker(args) -> int:
    """Runs inside the per-config subprocess; writes its measurements to --worker-out."""
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = parse_config(args.worker, sparse=is_sparse_model(args.model))
    prompts = [TokensPrompt(prompt_token_ids=ids)
               for ids in token_prompts(args.model, args.num_prompts, args.prompt_len, args.seed)]
    kwargs = engine_kwargs(cfg, args)
    print(f"[bench] {cfg.label}: LLM({json.dumps({k: v for k, v in kwargs.items() if k != 'model'})})", flush=True)
    t0 = time.time()
    llm = LLM(**kwargs)
    init_s = time.time() - t0

    def preemptions() -> float | None:
        if not args.kv_cache_memory_bytes:
            return None
        try:
            return float(sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name.endswith("num_preemptions")))
        except Exception as e:  # noqa: BLE001 - the count is reported as unknown, with the reason
            print(f"[bench] {cfg.label}: preemption count unavailable: {e!r}", flush=True)
            return None

    def timed(max_tokens: int) -> tuple[float, float | None]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        p0 = preemptions()
        t = time.time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.time() - t
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        p1 = preemptions()
        return dt, (p1 - p0 if p0 is not None and p1 is not None else None)

    steps = args.output_len - 1
    timed(8)  # warm-up: first-use allocations and kernel selection outside the measurement
    measurements = []
    for k in range(args.repeats):
        t_1, _ = timed(1)
        t_n, pre = timed(args.output_len)
        decode_s = t_n - t_1
        m = {"repeat": k + 1, "t_1": t_1, "t_n": t_n, "decode_s": decode_s,
             "decode_tok_s": args.num_prompts * steps / decode_s if decode_s > 0 else None,
             "ms_per_step": decode_s / steps * 1e3, "e2e_tok_s": args.num_prompts * args.output_len / t_n,
             "preemptions": pre}
        measurements.append(m)
        rate = f"{m['decode_tok_s']:,.0f}" if m["decode_tok_s"] else "n/a"
        print(f"[bench] {cfg.label}: repeat {k + 1}/{args.repeats}: t(1) {t_1:.2f} s, t({args.output_len}) "
              f"{t_n:.2f} s, decode {rate} tok/s ({m['ms_per_step']:.3f} ms/step)"
              f"{f', {pre:g} preemptions' if pre is not None else ''}", flush=True)
    cache = llm.llm_engine.vllm_config.cache_config
    result = {"config": cfg.label, "dcp": args.dcp, "vllm_version": vllm.__version__,
              "torch_version": torch.__version__, "gpu": torch.cuda.get_device_name(), "init_s": init_s,
              "measurements": measurements,
              "cache_config": {k: getattr(cache, k, None) for k in ("num_gpu_blocks", "block_size",
                                                                       "kv_cache_size_tokens",
                                                                       "kv_cache_max_concurrency")}}
    Path(args.worker_out).write_text(json.dumps(result))
    return 0


# ---- the driver ---------------------------------------------------------------------------------

def run_engine_process(name: str, cmd: list[str], cfg: Config, base_env: dict, out: Path, timeout_s: int,
                       dcp: int = 1) -> tuple[str, dict]:
    """One config's engine process (harness.run_logged, the config's environment): its log, checked for our decode
    line (custom_log_problem), and the JSON its worker wrote to `out`. harness.RunFailed when either fails."""
    log = harness.run_logged(name, cmd, config_env(cfg, base_env), timeout_s=timeout_s)
    problem = custom_log_problem(log, cfg, dcp)
    if problem:
        raise harness.RunFailed(problem)
    return log, json.loads(out.read_text())


def git_describe() -> str:
    try:
        head = subprocess.run(["git", "-C", str(harness.REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return "unknown (no git metadata)"
        dirty = subprocess.run(["git", "-C", str(harness.REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"


def estimate_s(n_processes: int, repeats: int, output_len: int) -> float:
    per_process = EST_STARTUP_S + (repeats + 1) * EST_T1_S + repeats * (EST_T1_S + (output_len - 1) * EST_STEP_S)
    return n_processes * per_process


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", help="BACKEND[:KVDTYPE[:MODE]],... (default: --backends)")
    ap.add_argument("--backends", help=f"BACKEND,... with --kv-cache-dtype for all (default {DEFAULT_BACKENDS}; "
                                       f"with --capacity {DEFAULT_CAPACITY_CONFIGS})")
    ap.add_argument("--kv-cache-dtype", choices=KV_DTYPES, default="auto",
                    help="KV-cache dtype of configs that do not name one (default auto: the model's bf16)")
    ap.add_argument("--rounds", type=int, default=1, help="engine processes per config, order alternating (default 1)")
    ap.add_argument("--first-round", type=int, default=1,
                    help="number of the first round (its parity sets the order; for rounds split over several calls)")
    ap.add_argument("--repeats", type=int, default=3, help="measurements inside each process (default 3)")
    ap.add_argument("--dcp", type=int, default=1, metavar="N",
                    help="decode context parallelism for every config: each engine at tensor_parallel_size N + "
                         "decode_context_parallel_size N on N GPUs (vLLM's DCP needs TP >= DCP, the DCP group reusing "
                         "the TP ranks); default 1 = off")
    ap.add_argument("--capacity", action="store_true", help="the capped-KV-cache run (see the docstring)")
    ap.add_argument("--capacity-headroom", type=float, default=1.05)
    ap.add_argument("--kv-cache-memory-bytes", type=int, help="with --capacity: the cap itself (default: computed)")
    ap.add_argument("--model", default=str(MODEL_DIR), help="a directory with a DeepSeek-V3 config.json")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=7000)
    ap.add_argument("--output-len", type=int, default=2049, help="N: decode steps = N - 1 (default 2049)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=harness.RUN_TIMEOUT_S, help="seconds per engine process")
    ap.add_argument("--results", help="results JSON (default RUN_DIR/bench.json, bench-capacity.json)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--table-from", nargs="+", metavar="JSON", help="print the tables of these results files")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    return ap


def resolve(args) -> list[Config]:
    """The configs to run, or ValueError (conflicting or invalid options)."""
    if args.configs and args.backends:
        raise ValueError("give --configs or --backends, not both (--backends X,Y is --configs X,Y)")
    for name in ("rounds", "repeats", "first_round", "num_prompts", "prompt_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.output_len < 2:
        raise ValueError("--output-len must be at least 2 (decode steps = output_len - 1)")
    if args.kv_cache_memory_bytes is not None and not args.capacity:
        raise ValueError("--kv-cache-memory-bytes belongs to --capacity")
    if args.dcp < 1:
        raise ValueError(f"--dcp must be at least 1 (1 = no decode context parallelism; N > 1 runs every engine at "
                         f"tensor_parallel_size N + decode_context_parallel_size N on N GPUs), got {args.dcp}")
    if args.dcp > 1 and args.capacity:
        raise ValueError("--dcp does not combine with --capacity (the capped cache is sized for one GPU holding the "
                         "whole batch)")
    sparse = is_sparse_model(args.model)
    if sparse and (args.capacity or args.dcp > 1):
        raise ValueError(f"--model {args.model} is a DeepSeek-V3.2 (sparse attention) model: no --capacity or --dcp "
                         f"runs for it (the plugin's sparse backend refuses decode context parallelism)")
    default = DEFAULT_SPARSE_CONFIGS if sparse else DEFAULT_CAPACITY_CONFIGS if args.capacity else DEFAULT_BACKENDS
    return parse_configs(args.configs or args.backends or default, args.kv_cache_dtype, sparse)


def is_sparse_model(model_dir: str) -> bool:
    """Whether --model is a DeepSeek-V3.2-architecture model (sparse attention: model_type deepseek_v32)."""
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text()).get("model_type") == "deepseek_v32"
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {model_dir}: cannot read {path} ({e})") from e


def visible_cuda_devices() -> int:
    """torch.cuda.device_count() in this (the driver's) process: the GPUs the engine processes will see."""
    import torch

    return torch.cuda.device_count()


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.table_from:
        print(render(merge_results([json.loads(Path(p).read_text()) for p in args.table_from])))
        return 0
    try:
        configs = resolve(args)
    except ValueError as e:
        ap.error(str(e))
    if args.dcp > 1 and not args.dry_run:
        gpus = visible_cuda_devices()
        if gpus < args.dcp:
            ap.error(f"--dcp {args.dcp} needs {args.dcp} CUDA devices per engine (tensor_parallel_size "
                     f"{args.dcp} + decode_context_parallel_size {args.dcp}); torch.cuda.device_count() is {gpus}")
    dcp_tag = f" (DCP {args.dcp})" if args.dcp > 1 else ""

    kv_bytes = None
    need = batch_tokens(args.num_prompts, args.prompt_len, args.output_len)
    if args.capacity:
        layers = model_layers(args.model)
        kv_bytes = args.kv_cache_memory_bytes or capacity_kv_bytes(args.num_prompts, args.prompt_len, args.output_len,
                                                                   layers, args.capacity_headroom)
        print(f"[bench] capacity: the batch needs {need:,} tokens; kv_cache_memory_bytes {kv_bytes:,} "
              f"({kv_bytes / 2**30:.2f} GiB) holds about {kv_bytes // (layers * LATENT_BYTES_PER_TOKEN):,} FP8 tokens "
              f"and {kv_bytes // (layers * 2 * LATENT_BYTES_PER_TOKEN):,} bf16 tokens ({layers} layers)", flush=True)
    plan = round_orders(configs, args.rounds, args.first_round)
    est = estimate_s(len(plan), args.repeats, args.output_len)
    longer = "; a cache too small for the batch takes longer" if args.capacity else ""
    print(f"[bench] plan: {len(plan)} engine processes ({len(configs)} configs x {args.rounds} "
          f"round{'s' if args.rounds != 1 else ''}, {args.repeats} repeats each), about {est / 60:.0f} min (rough: "
          f"H100 figures at the default shape{longer}):", flush=True)
    if args.dcp > 1:
        print(f"[bench]   DCP {args.dcp}: every engine at tensor_parallel_size {args.dcp} + "
              f"decode_context_parallel_size {args.dcp}, on {args.dcp} GPUs", flush=True)
    for i, (r, c) in enumerate(plan, 1):
        print(f"[bench]   {i:>2}. round {r}: {c.label}{dcp_tag}", flush=True)
    if args.dry_run:
        return 0

    kind = "capacity" if args.capacity else "throughput"
    results_path = Path(args.results) if args.results else harness.RUN_DIR / (
        "bench-capacity.json" if args.capacity else f"bench-dcp{args.dcp}.json" if args.dcp > 1 else "bench.json")
    results = {"kind": kind, "meta": {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["python", "integration/bench_vllm_throughput.py"] + list(sys.argv[1:] if argv is None
                                                                                       else argv)),
        "git": git_describe(), "model": Path(args.model).name, "num_prompts": args.num_prompts,
        "prompt_len": args.prompt_len, "output_len": args.output_len, "rounds": args.rounds,
        "first_round": args.first_round, "repeats": args.repeats, "configs": [c.label for c in configs],
        "dcp": args.dcp, "tensor_parallel_size": args.dcp,
        "kv_cache_memory_bytes": kv_bytes, "need_tokens": need if args.capacity else None},
        "processes": [], "measurements": [], "failures": []}
    base_env = harness.engine_env()
    t_start = time.time()
    for i, (r, cfg) in enumerate(plan, 1):
        elapsed = time.time() - t_start
        left = (elapsed / (i - 1) * (len(plan) - i + 1)) if i > 1 else est
        print(f"\n[bench] process {i}/{len(plan)}: round {r} ({'forward' if r % 2 else 'reversed'} order), "
              f"{cfg.label}{dcp_tag}; {elapsed:.0f} s elapsed, about {left:.0f} s left", flush=True)
        name = f"bench{'-capacity' if args.capacity else ''}-r{r}-{cfg.slug}{f'-dcp{args.dcp}' if args.dcp > 1 else ''}"
        out = harness.RUN_DIR / f"{name}.json"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--worker", cfg.label, "--worker-out", str(out), "--model", args.model,
               "--num-prompts", str(args.num_prompts), "--prompt-len", str(args.prompt_len),
               "--output-len", str(args.output_len), "--repeats", str(args.repeats),
               "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--seed", str(args.seed),
               "--dcp", str(args.dcp)]
        if kv_bytes:
            cmd += ["--kv-cache-memory-bytes", str(kv_bytes)]
        try:
            log, data = run_engine_process(name, cmd, cfg, base_env, out, args.timeout, args.dcp)
            proc = {"config": cfg.label, "round": r, "dcp": args.dcp, "init_s": data["init_s"], "gpu": data["gpu"],
                    "vllm_version": data["vllm_version"], "torch_version": data["torch_version"],
                    "cache_config": data["cache_config"], "log": str(harness.RUN_DIR / f"{name}.log")}
            if args.capacity:
                proc["capacity"] = capacity_of(log, data["cache_config"])
                print(f"[bench] {cfg.label}: KV cache {proc['capacity']}", flush=True)
            results["processes"].append(proc)
            results["measurements"] += [dict(m, config=cfg.label, round=r, dcp=args.dcp) for m in data["measurements"]]
        except harness.RunFailed as e:
            results["failures"].append({"config": cfg.label, "round": r, "dcp": args.dcp,
                                        "why": str(e).splitlines()[0]})
            print(e, flush=True)
        harness.write_json(results_path, results)
    print(f"\n[bench] {len(plan)} processes in {time.time() - t_start:.0f} s; results: {results_path}\n", flush=True)
    print(render(results), flush=True)
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
