"""Engine-level GPU tests: vLLM 0.26 serving a random-weight DeepSeek-V3-architecture model.

    python -m pytest integration/test_vllm_engine_gpu.py -v -s

Every engine run is its own subprocess (integration/vllm_run.py, or `vllm serve`) with a timeout,
VLLM_USE_FLASHINFER_SAMPLER=0 and HF_HUB_OFFLINE=1; logs go to $FLASHMLA_BACKEND_RUN_DIR
(/tmp/flashmla_backend_integration). The checkpoint comes from make_tiny_checkpoint.py (built once,
checked: entropy well below uniform, logits depend on attention). Runs are cached per session, so
each configuration starts once even when several tests compare it.

Comparison of two greedy runs (same prompts, 1 to 3000 tokens, MAX_TOKENS generated with ignore_eos):
  - tokens: the generated sequences agree up to their first difference; at least MATCH_FRACTION_MIN of
    all generated tokens lie before a difference, and a difference is accepted only at a near tie
    (the reference's logprobs of the two tokens within TIE_GAP);
  - logprobs of the chosen tokens where both agree: mean |difference| <= LOGPROB_MEAN_TOL and
    max <= LOGPROB_MAX_TOL (nats).
When the only failure is a divergence beyond TIE_GAP, the fp32 model decides (agrees(); the criteria are in
integration/fp32_oracle.py: ours must be about as close to the fp32 model as the reference, and the flip must be at
a token pair the fp32 model itself separates by less than twice the reference's own largest error). Two correct
bf16 kernels that round differently can flip a greedy choice at a gap just above TIE_GAP on this random model;
the pairwise comparison alone cannot say which run was wrong there, the fp32 model can.
FLASHMLA vs TRITON_MLA is printed as the baseline spread between two correct backends; with the bf16 cache ours must
also be no further from the fp32 model than FLASHMLA (the FP8 runs' criterion, below), and an ablation run (our
plugin with vLLM's FlashMLA kernel in its decode, FLASHMLA_BACKEND_DEBUG_VLLM_DECODE_KERNEL=1) says whether a
difference between the two distances is the kernel's or the engine path's. The broken run
(FLASHMLA_BACKEND_DEBUG_BREAK_SCALE=1: our decode uses scale x 1.5) must fail the same comparison.

FP8 KV caches (`python -m pytest integration/test_vllm_engine_gpu.py -v -s -k fp8` runs them all; they share engine
runs): --kv-cache-dtype fp8, our plugin in both query modes (FLASHMLA_BACKEND_FP8_MODE accurate / fast) against
vLLM's FLASHMLA (which quantizes q to e4m3) and TRITON_MLA (bf16 q against the dequantized cache). An FP8 cache
rounds every cached value, so two FP8 runs are judged by the fp32 model, not against each other: each run's mean
|logprob - fp32| along its own tokens (fp32_oracle.Fp32Oracle.run_error) is printed, and ours must be no worse than
FLASHMLA-FP8's (fp32_oracle.fp8_no_worse: at most FP8_ERR_RATIO x its mean + FP8_ERR_SLACK, the spread of two
correct runs). Cases: CUDA graphs in both modes; the broken run (eager, accurate) must fail that criterion; MTP
(s_q = 3) in both modes against FLASHMLA-FP8 without speculation; KV scales: the default 1.0 (the plugin's
default-scale line must be in the log), vLLM's --calculate-kv-scales, and scales measured on the prompts (vllm_run.py
--kv-scales-from-prompts), each against FLASHMLA-FP8 with the same scales, the default's errors printed beside them;
`vllm serve --kv-cache-dtype fp8` with 64 concurrent requests. Split over two calls when a call is limited to 10
minutes: -k "fp8 and not scales and not serve", then -k "fp8 and (scales or serve)".
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import harness
import vllm_run
from fp32_oracle import Fp32Oracle, fp8_no_worse, fp32_verdict, mean_error, shared_prefix_errors

PROMPT_LENS = [1, 2, 17, 64, 65, 127, 300, 1000, 2047, 3000]
MAX_TOKENS = 48
LOGPROBS = 5
# Agreement criteria (see the module docstring). Calibrated on the GPU machine (H200, vLLM 0.26.0, this
# checkpoint, 10 prompts x 48 tokens). Two correct backends, FLASHMLA vs TRITON_MLA (CUDA graphs): 77 %
# of tokens before the first difference, every first difference at a near tie, |logprob diff| mean
# 0.016, max 0.19. Ours vs TRITON_MLA: 83 % (graphs), 45 % (eager vs eager), 56 % (eager vs graphs),
# 83 % (MTP); always every divergence at a near tie, mean 0.016-0.024, max 0.12-0.33. Ours with a 1.5x
# softmax scale (the broken run): 4 %, 8 of 10 prompts diverging away from ties, mean 0.18, max 0.72.
# On this random tiny model near ties are common and a tie-break sends the rest of a sequence elsewhere,
# so how many tokens precede the first tie-break varies a lot between two correct runs (45-83 %): the
# sharp criteria are "every divergence at a near tie" and the logprob mean; the token fraction is a floor.
MATCH_FRACTION_MIN = 0.3
TIE_GAP = 0.3
LOGPROB_MEAN_TOL = 0.05
LOGPROB_MAX_TOL = 0.5
# `vllm serve` load test.
SERVE_START_TIMEOUT_S = 420
SERVE_REQUESTS = 64
SERVE_REQUESTS_TIMEOUT_S = 240

OUR_LOG_LINE = "MLA decode attention runs on flashmla_backend"
FP8_LOG_TEXT = "FP8 KV cache"                                          # in OUR_LOG_LINE's line with an FP8 cache
DEFAULT_SCALE_TEXT = "FP8 KV cache with the default scale 1.0"         # logged once when k_scale is the default
FP8_MODE_ENV = "FLASHMLA_BACKEND_FP8_MODE"
VLLM_KERNEL_ENV = "FLASHMLA_BACKEND_DEBUG_VLLM_DECODE_KERNEL"        # the ablation hook (flashmla_backend/_env.py)
VLLM_KERNEL_LOG_TEXT = "decode attention runs on vLLM's FlashMLA kernel"
FP8_MODES = ("accurate", "fast")
DEFAULT_FP8_MODE = "fast"   # the plugin's vLLM mode with FP8_MODE_ENV unset (engine_support.DEFAULT_FP8_MODES)
SCALES = {"default": None, "calculated": "--calculate-kv-scales", "prompts": "--kv-scales-from-prompts"}


@pytest.fixture(scope="session")
def checkpoint() -> Path:
    return harness.tiny_checkpoint(mtp=True)


@pytest.fixture(scope="session")
def prompts_file() -> Path:
    rng = random.Random(1234)
    prompts = [[rng.randrange(2, 1024) for _ in range(n)] for n in PROMPT_LENS]
    return harness.write_json(harness.RUN_DIR / "prompts.json", prompts)


_runs: dict = {}


def run_name(backend: str, *, eager=False, tp=1, mtp=0, broken=False, kv="auto", mode=None, scales="default",
             vllm_kernel=False) -> str:
    """The run's name (log and result files):
    backend[-fp8][-mode]-graphs|eager[-tpN][-mtpN][-scales][-vllm-kernel][-BROKEN]."""
    if vllm_kernel and not (backend == "CUSTOM" and kv == "auto"):
        raise ValueError(f"the ablation hook (vLLM's decode kernel) belongs to CUSTOM with a 16-bit cache, not "
                         f"{backend} with {kv}")
    if mode is not None and not (backend == "CUSTOM" and kv == "fp8"):
        raise ValueError(f"a query mode ({mode}) belongs to CUSTOM with an fp8 KV cache, not {backend} with {kv}")
    if backend == "CUSTOM" and kv == "fp8" and mode not in FP8_MODES:
        raise ValueError(f"CUSTOM with an fp8 KV cache needs a mode ({', '.join(FP8_MODES)}), got {mode!r}")
    if scales not in SCALES or (scales != "default" and kv == "auto"):
        raise ValueError(f"KV scales {scales!r} need an fp8 KV cache and one of {', '.join(SCALES)}")
    parts = [backend.lower()] + ([kv] if kv != "auto" else []) + ([mode] if mode else [])
    parts += ["eager" if eager else "graphs"] + ([f"tp{tp}"] if tp > 1 else []) + ([f"mtp{mtp}"] if mtp else [])
    parts += {"default": [], "calculated": ["calc-scales"], "prompts": ["prompt-scales"]}[scales]
    parts += ["vllm-kernel"] if vllm_kernel else []
    return "-".join(parts) + ("-BROKEN" if broken else "")


def run_log_problems(log: str, backend: str, *, kv="auto", mode=None, scales="default", broken=False,
                     vllm_kernel=False) -> list[str]:
    """What a run's log must show: for CUSTOM our decode line (with an fp8 cache saying FP8 and the mode), the
    default-scale line when an fp8 run keeps scale 1.0, and each test hook's warning exactly when it is set."""
    if backend != "CUSTOM":
        return []
    problems = []
    ours = [line for line in log.splitlines() if OUR_LOG_LINE in line]
    if not ours:
        problems.append("the log does not show flashmla_backend running decode attention")
    elif kv != "auto" and not any(FP8_LOG_TEXT in line and f"mode {mode}" in line for line in ours):
        problems.append(f"our decode line does not say {FP8_LOG_TEXT!r} and 'mode {mode}': {ours[0].strip()!r}")
    elif kv == "auto" and any(FP8_LOG_TEXT in line for line in ours):
        problems.append(f"a 16-bit run's decode line says {FP8_LOG_TEXT!r}: {ours[0].strip()!r}")
    if kv != "auto" and scales == "default" and DEFAULT_SCALE_TEXT not in log:
        problems.append(f"an FP8 run with the default k scale, but the log lacks {DEFAULT_SCALE_TEXT!r}")
    if ("WRONG softmax scale" in log) != broken:
        problems.append("the scale-breaking test hook's warning is " + ("missing" if broken else "present unasked"))
    if (VLLM_KERNEL_LOG_TEXT in log) != vllm_kernel:
        problems.append("the ablation hook's warning is " + ("missing" if vllm_kernel else "present unasked"))
    return problems


def generate(checkpoint: Path, prompts_file: Path, backend: str, *, eager=False, tp=1, mtp=0, broken=False,
             kv="auto", mode=None, scales="default", vllm_kernel=False) -> dict:
    """One vllm_run.py process per configuration (cached for the session). kv: "auto" or "fp8"; mode: our FP8
    query mode (CUSTOM with fp8 only); scales: "default", "calculated" (vLLM's --calculate-kv-scales) or "prompts"
    (vllm_run.py --kv-scales-from-prompts). FP8 runs report their KV scales back. vllm_kernel: the plugin with
    vLLM's FlashMLA kernel in its decode (the ablation hook; CUSTOM with a 16-bit cache)."""
    key = (backend, eager, tp, mtp, broken, kv, mode, scales, vllm_kernel)
    if key in _runs:
        return _runs[key]
    name = run_name(backend, eager=eager, tp=tp, mtp=mtp, broken=broken, kv=kv, mode=mode, scales=scales,
                    vllm_kernel=vllm_kernel)
    out = harness.RUN_DIR / f"{name}.json"
    # vLLM's own backends do not depend on this repository's code (vllm_run.py aside, hashed in): their results are
    # kept on disk (next to the checkpoint's stamp) and reused by later pytest runs on the same machine, e.g. the
    # next device call. Our backend always runs.
    if backend != "CUSTOM":
        stamp = hashlib.sha256(f"{checkpoint.name}|{prompts_file.read_text()}|{MAX_TOKENS}|{LOGPROBS}|".encode()
                               + (harness.INTEGRATION / "vllm_run.py").read_bytes())
        out = harness.RUN_DIR / f"{name}-{stamp.hexdigest()[:12]}.json"
        if out.exists():
            result = json.loads(out.read_text())
            result["name"] = name
            print(f"\n[{name}] reusing {out}", flush=True)
            _runs[key] = result
            return result
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(harness.INTEGRATION / "vllm_run.py"), "--model", str(checkpoint), "--backend", backend,
           "--prompts", str(prompts_file), "--out", str(out), "--max-tokens", str(MAX_TOKENS),
           "--logprobs", str(LOGPROBS), "--tp", str(tp), "--mtp", str(mtp)]
    if eager:
        cmd.append("--enforce-eager")
    if kv != "auto":
        cmd += ["--kv-cache-dtype", kv, "--report-kv-scales"] + ([SCALES[scales]] if SCALES[scales] else [])
    env = harness.engine_env({"FLASHMLA_BACKEND_DEBUG_BREAK_SCALE": "1"} if broken else
                             {"FLASHMLA_BACKEND_DEBUG_BREAK_SCALE": "0"})
    env.pop(FP8_MODE_ENV, None)
    if mode:
        env[FP8_MODE_ENV] = mode
    env[VLLM_KERNEL_ENV] = "1" if vllm_kernel else "0"
    log = harness.run_logged(name, cmd, env)
    problems = run_log_problems(log, backend, kv=kv, mode=mode, scales=scales, broken=broken,
                                vllm_kernel=vllm_kernel)
    assert not problems, f"{name}: " + "; ".join(problems)
    result = json.loads(out.read_text())
    result["name"] = name
    if kv != "auto":
        print(f"[{name}] KV scales: {vllm_run.describe_scales(result.get('kv_scales'))}", flush=True)
        if scales == "default":
            assert _all_default(result.get("kv_scales")), f"{name}: scales other than 1.0 in a default-scale run"
    _runs[key] = result
    return result


def _all_default(scales: dict | None) -> bool:
    return bool(scales) and all(v["k"] == 1.0 and v["q"] == 1.0 for v in scales.values())


def compare(ours: dict, ref: dict, tie_gap: float | None = None) -> dict:
    """Agreement figures of two runs over the same prompts (see the module docstring). tie_gap defaults to
    TIE_GAP. "divergences" lists (prompt, first differing position, reference's logprob gap) for every prompt
    whose tokens differ, "bad_divergences" those beyond the tie gap; "figures_ok" holds the criteria other
    than the divergences."""
    tie_gap = TIE_GAP if tie_gap is None else tie_gap
    total = matched = identical = 0
    diffs: list[float] = []
    divergences = []
    for i, (a, b) in enumerate(zip(ours["outputs"], ref["outputs"])):
        ta, tb = a["token_ids"], b["token_ids"]
        total += len(tb)
        first = next((p for p, (x, y) in enumerate(zip(ta, tb)) if x != y), len(tb))
        matched += first
        identical += first == len(tb)
        for p in range(first):
            tok = str(tb[p])
            diffs.append(abs(a["logprobs"][p][tok] - b["logprobs"][p][tok]))
        if first < len(tb):
            ref_lp = b["logprobs"][first]
            divergences.append((i, first, ref_lp[str(tb[first])] - ref_lp.get(str(ta[first]), -math.inf)))
    bad_divergences = [(i, first, round(gap, 3)) for i, first, gap in divergences if not gap <= tie_gap]
    r = {
        "match_fraction": matched / max(total, 1),
        "identical_prompts": f"{identical}/{len(ref['outputs'])}",
        "logprob_mean_abs": sum(diffs) / max(len(diffs), 1),
        "logprob_max_abs": max(diffs, default=0.0),
        "divergences": divergences,
        "bad_divergences": bad_divergences,
    }
    r["figures_ok"] = (r["match_fraction"] >= MATCH_FRACTION_MIN and r["logprob_mean_abs"] <= LOGPROB_MEAN_TOL
                       and r["logprob_max_abs"] <= LOGPROB_MAX_TOL)
    r["ok"] = r["figures_ok"] and not bad_divergences
    print(f"\n[compare] {ours['name']} vs {ref['name']}: tokens before first difference {r['match_fraction']:.1%} "
          f"(identical prompts {r['identical_prompts']}), |logprob diff| mean {r['logprob_mean_abs']:.4f} "
          f"max {r['logprob_max_abs']:.4f}, divergences away from ties {bad_divergences} -> "
          f"{'AGREE' if r['ok'] else 'DISAGREE'}", flush=True)
    return r


@functools.cache
def _fp32_oracle(checkpoint: Path, prompts_file: Path) -> Fp32Oracle:
    """Loaded on first use (on the GPU), then kept for the session."""
    return Fp32Oracle(str(checkpoint), json.loads(prompts_file.read_text()))


def agrees(ours: dict, ref: dict, checkpoint: Path, prompts_file: Path) -> bool:
    """compare()'s verdict, except that two runs failing only by a divergence beyond the tie gap are judged by the
    fp32 model (loaded once per session, on the GPU; see the module docstring)."""
    r = compare(ours, ref)
    if r["ok"] or not r["figures_ok"]:
        return r["ok"]
    ok = fp32_verdict(_fp32_oracle(checkpoint, prompts_file), ours, ref, r)
    torch.cuda.empty_cache()  # the engine subprocesses that follow size their KV cache from free memory
    return ok


_fp32_errors: dict[str, tuple[float, float, int]] = {}
_fp32_prompt_errors: dict[str, list[list[float]]] = {}


def fp32_error(run: dict, checkpoint: Path, prompts_file: Path) -> float:
    """The run's mean |logprob - fp32| along its own tokens (computed once per run; the table of all so far printed)."""
    if run["name"] not in _fp32_errors:
        per_prompt = _fp32_oracle(checkpoint, prompts_file).prompt_errors(run)
        errs = [e for x in per_prompt for e in x]
        _fp32_prompt_errors[run["name"]] = per_prompt
        _fp32_errors[run["name"]] = (mean_error(errs), max(errs), len(errs))
        torch.cuda.empty_cache()  # the engine subprocesses that follow size their KV cache from free memory
    return _fp32_errors[run["name"]][0]


def shared_prefix_fp32_errors(a: dict, b: dict, checkpoint: Path, prompts_file: Path) -> tuple[float, float, int]:
    """Both runs' mean |logprob - fp32| over the tokens they share (each prompt up to its first difference:
    fp32_oracle.shared_prefix_errors), and that token count; printed."""
    for run in (a, b):
        fp32_error(run, checkpoint, prompts_file)
    xa, xb = shared_prefix_errors(a, b, _fp32_prompt_errors[a["name"]], _fp32_prompt_errors[b["name"]])
    ma, mb = mean_error(xa), mean_error(xb)
    print(f"[fp32 oracle] the {len(xa)} tokens {a['name']} and {b['name']} share (each prompt up to its first "
          f"difference): mean |logprob - fp32| {ma:.4f} against {mb:.4f}", flush=True)
    return ma, mb, len(xa)


def print_fp32_errors() -> None:
    print("\n[fp32 oracle] |logprob - fp32| of each run's chosen tokens (the runs judged so far):", flush=True)
    for name, (mean, worst, n) in sorted(_fp32_errors.items(), key=lambda kv: kv[1][0]):
        print(f"[fp32 oracle]   {name:<42} mean {mean:.4f}  max {worst:.4f}  ({n} tokens)", flush=True)


def test_cuda_graphs_agree_with_triton_mla_and_flashmla(checkpoint, prompts_file):
    triton = generate(checkpoint, prompts_file, "TRITON_MLA")
    flashmla = generate(checkpoint, prompts_file, "FLASHMLA")
    ours = generate(checkpoint, prompts_file, "CUSTOM")
    compare(flashmla, triton)  # baseline: two correct backends
    assert agrees(ours, triton, checkpoint, prompts_file)
    assert agrees(ours, flashmla, checkpoint, prompts_file)


def test_bf16_distance_from_fp32_no_worse_than_flashmla(checkpoint, prompts_file):
    """The bf16 cache, CUDA graphs: ours against FLASHMLA by each run's mean |logprob - fp32| along its own tokens, with
    the FP8 runs' criterion (fp32_oracle.fp8_no_worse: the spread of two correct runs); TRITON_MLA printed beside.
    Ours was once further from the fp32 model than FLASHMLA (0.0270 against 0.0248 on this model) although the two
    kernels agree to three digits on the same inputs; the first tokens of the short prompts differed because vLLM
    routed fresh prompts of up to 128 tokens through its prefill for ours and through the decode kernel for FLASHMLA.
    The plugin's builder now declares FLASHMLA's decode threshold (128); this test says whether that was the whole
    difference."""
    runs = {b: generate(checkpoint, prompts_file, b) for b in ("FLASHMLA", "TRITON_MLA", "CUSTOM")}
    m = {b: fp32_error(run, checkpoint, prompts_file) for b, run in runs.items()}
    print_fp32_errors()
    for b in ("CUSTOM", "TRITON_MLA"):
        shared_prefix_fp32_errors(runs[b], runs["FLASHMLA"], checkpoint, prompts_file)
    assert fp8_no_worse(runs["CUSTOM"]["name"], m["CUSTOM"], runs["FLASHMLA"]["name"], m["FLASHMLA"])


def test_bf16_distance_ablation_with_vllm_decode_kernel(checkpoint, prompts_file):
    """Why ours lands further from the fp32 model than FLASHMLA (test above): the same plugin with vLLM's FlashMLA
    kernel in its decode (FLASHMLA_BACKEND_DEBUG_VLLM_DECODE_KERNEL=1; builder, routing of tokens and the rest ours).
    Where its distance lands says what makes the difference: at FLASHMLA's, the kernel; at ours, the path the engine
    takes with the plugin. Both verdicts are printed; the ablation run, FLASHMLA's kernel on our plugin's path, must
    agree with FLASHMLA's run by the engine test's criteria.

    The ablation lands at FLASHMLA's, token for token: the kernel. But the two kernels are equally far from fp64 on
    the same inputs (benchmarks/bf16_precision.py), so their arithmetic differs, not their accuracy, and the mean over
    all tokens also carries which text each run followed after its first near-tie flip. Ours is therefore also
    judged on the tokens it shares with FLASHMLA, where both decode the same context, with the FP8 runs' "no worse"
    criterion. Figures: integration/README.md, "bf16 cache: distance from the fp32 model"."""
    runs = {"FLASHMLA": generate(checkpoint, prompts_file, "FLASHMLA"),
            "CUSTOM": generate(checkpoint, prompts_file, "CUSTOM"),
            "ablation": generate(checkpoint, prompts_file, "CUSTOM", vllm_kernel=True)}
    m = {k: fp32_error(run, checkpoint, prompts_file) for k, run in runs.items()}
    print_fp32_errors()
    cause = ("the kernel" if abs(m["ablation"] - m["FLASHMLA"]) < abs(m["ablation"] - m["CUSTOM"])
             else "the engine path with the plugin")
    print(f"[ablation] mean |logprob - fp32|: ours {m['CUSTOM']:.4f}, FLASHMLA {m['FLASHMLA']:.4f}, our plugin with "
          f"vLLM's FlashMLA kernel {m['ablation']:.4f} -> the difference is {cause}", flush=True)
    assert agrees(runs["ablation"], runs["FLASHMLA"], checkpoint, prompts_file)
    ours, ref, _ = shared_prefix_fp32_errors(runs["CUSTOM"], runs["FLASHMLA"], checkpoint, prompts_file)
    assert fp8_no_worse(runs["CUSTOM"]["name"] + " (shared tokens)", ours, runs["FLASHMLA"]["name"] + " (shared tokens)",
                        ref)


def test_enforce_eager_agrees_with_triton_mla(checkpoint, prompts_file):
    """Eager against eager: without torch.compile the other layers round differently, so an eager run
    is compared with TRITON_MLA's eager run (like with like)."""
    triton = generate(checkpoint, prompts_file, "TRITON_MLA", eager=True)
    ours = generate(checkpoint, prompts_file, "CUSTOM", eager=True)
    assert agrees(ours, triton, checkpoint, prompts_file)


def test_broken_attention_fails_the_comparison(checkpoint, prompts_file):
    """Proves the comparison can fail: our decode with a wrong softmax scale (x1.5) must disagree."""
    triton = generate(checkpoint, prompts_file, "TRITON_MLA")
    broken = generate(checkpoint, prompts_file, "CUSTOM", eager=True, broken=True)
    assert agrees(generate(checkpoint, prompts_file, "CUSTOM", eager=True), triton, checkpoint, prompts_file), \
        "the unbroken run must pass the same comparison"
    assert not agrees(broken, triton, checkpoint, prompts_file), \
        "a deliberately broken attention passed the comparison: the criteria are too loose"


def test_mtp_speculative_decoding_agrees(checkpoint, prompts_file):
    """MTP drafts 2 tokens per step, so verification batches reach our decode kernel with s_q = 3 (causal);
    greedy speculative decoding must reproduce the non-speculative reference."""
    triton = generate(checkpoint, prompts_file, "TRITON_MLA")
    ours = generate(checkpoint, prompts_file, "CUSTOM", mtp=2)
    assert agrees(ours, triton, checkpoint, prompts_file)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallel 2 needs two GPUs")
def test_tensor_parallel_2_agrees(checkpoint, prompts_file):
    triton = generate(checkpoint, prompts_file, "TRITON_MLA", tp=2)
    ours = generate(checkpoint, prompts_file, "CUSTOM", tp=2)
    assert agrees(ours, triton, checkpoint, prompts_file)
    # Across TP sizes the other layers reduce in another order, so greedy paths part at near ties even
    # between two correct runs; printed for information, not asserted. Measured on 2x H200: TRITON_MLA tp2
    # vs tp1 63.7%, no divergence away from ties; ours tp2 vs TRITON_MLA tp1 77.7% with one divergence at
    # a gap of 0.375 nats (just above TIE_GAP), while ours tp2 vs TRITON_MLA tp2 agreed.
    triton_tp1 = generate(checkpoint, prompts_file, "TRITON_MLA")
    compare(triton, triton_tp1)
    compare(ours, triton_tp1)


# ---- FP8 KV cache (-k fp8) -----------------------------------------------------------------------


def fp8(checkpoint, prompts_file, backend, mode=None, **kw) -> dict:
    return generate(checkpoint, prompts_file, backend, kv="fp8", mode=mode, **kw)


def test_fp8_accuracy_ours_vs_flashmla_fp8(checkpoint, prompts_file):
    """CUDA graphs, default scales: our accurate (bf16 q) and fast (e4m3 q) modes against FLASHMLA-FP8 by their
    distance from the fp32 model; TRITON_MLA-FP8 (bf16 q against the dequantized cache) printed as a second
    reference, the pairwise figures for information."""
    flashmla = fp8(checkpoint, prompts_file, "FLASHMLA")
    triton = fp8(checkpoint, prompts_file, "TRITON_MLA")
    ours = {mode: fp8(checkpoint, prompts_file, "CUSTOM", mode) for mode in FP8_MODES}
    compare(flashmla, triton)
    for run in ours.values():
        compare(run, flashmla)
    m_ref = fp32_error(flashmla, checkpoint, prompts_file)
    m_tri = fp32_error(triton, checkpoint, prompts_file)
    verdicts = {mode: fp8_no_worse(run["name"], fp32_error(run, checkpoint, prompts_file), flashmla["name"], m_ref)
                for mode, run in ours.items()}
    fp8_no_worse(ours["accurate"]["name"], fp32_error(ours["accurate"], checkpoint, prompts_file), triton["name"],
                 m_tri)  # both multiply a bf16 q: for information
    print_fp32_errors()
    assert all(verdicts.values()), f"FP8 runs worse than FLASHMLA-FP8 against the fp32 model: {verdicts}"


def test_fp8_wrong_scale_is_caught(checkpoint, prompts_file):
    """Proves the FP8 criterion can fail: our FP8 decode with the test hook's wrong softmax scale (x1.5) must be
    worse than FLASHMLA-FP8, while the unbroken run is not."""
    flashmla = fp8(checkpoint, prompts_file, "FLASHMLA")
    ours = fp8(checkpoint, prompts_file, "CUSTOM", "accurate")
    broken = fp8(checkpoint, prompts_file, "CUSTOM", "accurate", eager=True, broken=True)
    m_ref = fp32_error(flashmla, checkpoint, prompts_file)
    good = fp8_no_worse(ours["name"], fp32_error(ours, checkpoint, prompts_file), flashmla["name"], m_ref)
    bad = fp8_no_worse(broken["name"], fp32_error(broken, checkpoint, prompts_file), flashmla["name"], m_ref)
    print_fp32_errors()
    assert good, "the unbroken FP8 run must pass the same criterion"
    assert not bad, "a deliberately broken FP8 attention passed the criterion: it is too loose"


@pytest.mark.parametrize("mode", FP8_MODES)
def test_fp8_multi_token_prediction(mode, checkpoint, prompts_file):
    """MTP drafts 2 tokens per step, so the verification batches reach our FP8 decode with s_q = 3 (causal); greedy
    speculative decoding approximates the same model, so it must be no worse than FLASHMLA-FP8 without it."""
    flashmla = fp8(checkpoint, prompts_file, "FLASHMLA")
    ours = fp8(checkpoint, prompts_file, "CUSTOM", mode, mtp=2)
    compare(ours, flashmla)
    ok = fp8_no_worse(ours["name"], fp32_error(ours, checkpoint, prompts_file), flashmla["name"],
                      fp32_error(flashmla, checkpoint, prompts_file))
    print_fp32_errors()
    assert ok


def _scales_line(run: dict) -> str:
    return f"{run['name']}: {vllm_run.describe_scales(run.get('kv_scales'))}"


def test_fp8_vllm_calculated_scales(checkpoint, prompts_file):
    """vLLM's --calculate-kv-scales (deprecated in 0.26, still present) on an MLA model. Reading vLLM 0.26's sources:
    MLAAttention.forward calls maybe_calc_kv_scales before anything else, so the first forward that reaches it sets
    k_scale = amax(kv_c_normed) / 200 and q_scale = amax(q before absorption) / 200, and that first forward is the
    start-up memory-profiling run on dummy tokens, not a request. The test prints the scales it got next to the
    amaxes measured on the prompts (vllm_run.py --kv-scales-from-prompts) so the log shows which data they came from,
    compares ours with FLASHMLA-FP8 under the same option, and prints the default-scale errors beside them."""
    default = fp8(checkpoint, prompts_file, "CUSTOM", "accurate")
    flashmla_default = fp8(checkpoint, prompts_file, "FLASHMLA")
    try:   # vLLM's own backend first: if the option fails there, it is vLLM's, and the test says so
        flashmla_calc = fp8(checkpoint, prompts_file, "FLASHMLA", scales="calculated")
    except harness.RunFailed as e:
        print(f"[scales] vLLM's --calculate-kv-scales fails on this MLA model with its own FLASHMLA backend: "
              f"{str(e).splitlines()[0]}", flush=True)
        pytest.skip("vLLM's --calculate-kv-scales fails for MLA with FLASHMLA (see the printed line); "
                    "test_fp8_scales_from_prompts covers calibrated scales")
    calc = fp8(checkpoint, prompts_file, "CUSTOM", "accurate", scales="calculated")
    measured = fp8(checkpoint, prompts_file, "CUSTOM", "accurate", scales="prompts")
    for run in (calc, flashmla_calc, measured):
        print(f"[scales] {_scales_line(run)}", flush=True)
    cal = measured["kv_scale_calibration"] or {}
    for layer, got in sorted((calc.get("kv_scales") or {}).items()):
        if layer in cal:
            c = cal[layer]
            print(f"[scales] {layer}: vLLM's amaxes kv_c {got['k'] * got['k_range']:.4g}, q "
                  f"{got['q'] * got['q_range']:.4g}; on the prompts kv_c {c['kv_c_amax']:.4g} (k_pe "
                  f"{c['k_pe_amax']:.4g}), q {c['q_unabsorbed_amax']:.4g} (absorbed {c['q_amax']:.4g})", flush=True)
    m = {run["name"]: fp32_error(run, checkpoint, prompts_file) for run in (default, flashmla_default, calc,
                                                                             flashmla_calc)}
    print(f"[scales] mean |logprob - fp32|: default scale 1.0 {m[default['name']]:.4f} (FLASHMLA-FP8 "
          f"{m[flashmla_default['name']]:.4f}), --calculate-kv-scales {m[calc['name']]:.4f} (FLASHMLA-FP8 "
          f"{m[flashmla_calc['name']]:.4f})", flush=True)
    print_fp32_errors()
    if _all_default(calc.get("kv_scales")):
        print("[scales] vLLM 0.26 left every MLA layer's KV scale at 1.0 with --calculate-kv-scales", flush=True)
        pytest.skip("vLLM 0.26 left every MLA layer's KV scale at 1.0 with --calculate-kv-scales: the option does not "
                    "work for MLA here; test_fp8_scales_from_prompts covers calibrated scales")
    assert fp8_no_worse(calc["name"], m[calc["name"]], flashmla_calc["name"], m[flashmla_calc["name"]])


@pytest.mark.parametrize("mode", FP8_MODES)
def test_fp8_scales_from_prompts(mode, checkpoint, prompts_file):
    """Scales measured on the prompts (amax / 448 of what each layer caches and of the decode query, set in every MLA
    layer after start-up: vllm_run.py --kv-scales-from-prompts), ours against FLASHMLA-FP8 calibrated the same way;
    the default-scale runs' errors printed beside them."""
    default = fp8(checkpoint, prompts_file, "CUSTOM", mode)
    flashmla_default = fp8(checkpoint, prompts_file, "FLASHMLA")
    ours = fp8(checkpoint, prompts_file, "CUSTOM", mode, scales="prompts")
    flashmla = fp8(checkpoint, prompts_file, "FLASHMLA", scales="prompts")
    for run in (ours, flashmla):
        cal, got = run["kv_scale_calibration"], run["kv_scales"]
        assert cal and got and sorted(cal) == sorted(got), f"{run['name']}: calibration {cal} / reported {got}"
        for layer, c in cal.items():
            assert c["k"] == pytest.approx(max(c["kv_c_amax"], c["k_pe_amax"]) / vllm_run.E4M3_MAX)
            assert c["q"] == pytest.approx(c["q_amax"] / vllm_run.E4M3_MAX)
            assert got[layer]["k"] == pytest.approx(c["k"], rel=1e-6) and got[layer]["q"] == pytest.approx(c["q"],
                                                                                                         rel=1e-6)
        assert not _all_default(got), f"{run['name']}: the calibration left the default scales"
        print(f"[scales] {_scales_line(run)}", flush=True)
    m = {run["name"]: fp32_error(run, checkpoint, prompts_file) for run in (default, flashmla_default, ours, flashmla)}
    print(f"[scales] mean |logprob - fp32| ({mode} mode): default scale 1.0 {m[default['name']]:.4f} (FLASHMLA-FP8 "
          f"{m[flashmla_default['name']]:.4f}), scales from the prompts {m[ours['name']]:.4f} (FLASHMLA-FP8 "
          f"{m[flashmla['name']]:.4f})", flush=True)
    print_fp32_errors()
    assert fp8_no_worse(ours["name"], m[ours["name"]], flashmla["name"], m[flashmla["name"]])


# ---- vllm serve ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_serve_64_concurrent_completions(kv, checkpoint):
    """`vllm serve --attention-backend CUSTOM` (with --kv-cache-dtype fp8: the plugin's default query mode) and 64
    concurrent completions of 1-128 tokens on prompts of 1-2530 tokens: every request returns all its tokens."""
    log = serve_64_concurrent(checkpoint, kv, f"serve-custom{'-fp8' if kv == 'fp8' else ''}")
    problems = run_log_problems(log, "CUSTOM", kv=kv, mode=DEFAULT_FP8_MODE if kv == "fp8" else None)
    assert not problems, f"server log: {'; '.join(problems)}"


def serve_64_concurrent(checkpoint: Path, kv: str, name: str, extra_args: tuple[str, ...] = (),
                        env_extra: dict | None = None) -> str:
    """Starts `vllm serve` on the checkpoint with our backend (extra_args appended to its command line, env_extra
    added to its environment), sends SERVE_REQUESTS concurrent greedy completions with ignore_eos, asserts that each
    returns all its tokens, stops the server and returns its log ($FLASHMLA_BACKEND_RUN_DIR/<name>.log).
    test_vllm_dcp_gpu.py serves TP 2 + DCP 2 through it, test_vllm_sparse_engine_gpu.py DeepSeek-V3.2."""
    port = harness.free_port()
    base = f"http://127.0.0.1:{port}"
    harness.RUN_DIR.mkdir(parents=True, exist_ok=True)
    log_path = harness.RUN_DIR / f"{name}.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(checkpoint), "--attention-backend",
           "CUSTOM", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096",
           "--gpu-memory-utilization", "0.5", "--max-num-seqs", "64", "--served-model-name", "tiny",
           "--kv-cache-dtype", kv, *extra_args]
    env = harness.engine_env(env_extra)
    env.pop(FP8_MODE_ENV, None)
    print(f"\n[serve] start: {' '.join(cmd)} (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                cwd=str(harness.REPO), start_new_session=True)
    try:
        try:
            took = harness.wait_healthy(proc, base, SERVE_START_TIMEOUT_S, "vllm serve")
        except RuntimeError as e:
            pytest.fail(f"{e}:\n{_tail(log_path)}")
        print(f"[serve] healthy after {took:.0f} s", flush=True)

        rng = random.Random(99)
        jobs = []
        for i in range(SERVE_REQUESTS):
            n = [1, 5, 60, 200, 700, 1500, 2500][i % 7] + rng.randrange(0, 30)
            m = [1, 8, 32, 64, 128][i % 5]
            jobs.append(([rng.randrange(2, 1024) for _ in range(n)], m))

        def one(job):
            prompt, max_tokens = job
            t = time.time()
            body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            r = harness.post_json(f"{base}/v1/completions", body, SERVE_REQUESTS_TIMEOUT_S)
            return r, max_tokens, time.time() - t

        t1 = time.time()
        with ThreadPoolExecutor(max_workers=SERVE_REQUESTS) as pool:
            results = list(pool.map(one, jobs, timeout=SERVE_REQUESTS_TIMEOUT_S))
        wall = time.time() - t1
        for r, max_tokens, _ in results:
            assert r["usage"]["completion_tokens"] == max_tokens, r["usage"]
            assert isinstance(r["choices"][0]["text"], str) and r["choices"][0]["finish_reason"] == "length"
        slowest = max(dt for *_, dt in results)
        print(f"[serve] {len(results)} concurrent completions ok in {wall:.1f} s (slowest {slowest:.1f} s)", flush=True)
        assert wall < SERVE_REQUESTS_TIMEOUT_S
    finally:
        _shutdown(proc)
        print(f"[serve] server stopped (exit code {proc.returncode})", flush=True)
    assert proc.returncode is not None
    return log_path.read_text(errors="replace")


def _shutdown(proc: subprocess.Popen) -> None:
    """SIGINT (vLLM's graceful shutdown), then the harness's SIGTERM/SIGKILL of the process group."""
    import signal

    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
    harness.kill_group(proc)


def _tail(path: Path, n: int = 80) -> str:
    return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-n:])
