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
FLASHMLA vs TRITON_MLA is printed as the baseline spread between two correct backends. The broken run
(FLASHMLA_BACKEND_DEBUG_BREAK_SCALE=1: our decode uses scale x 1.5) must fail the same comparison.
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
from fp32_oracle import Fp32Oracle, fp32_verdict

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


@pytest.fixture(scope="session")
def checkpoint() -> Path:
    return harness.tiny_checkpoint(mtp=True)


@pytest.fixture(scope="session")
def prompts_file() -> Path:
    rng = random.Random(1234)
    prompts = [[rng.randrange(2, 1024) for _ in range(n)] for n in PROMPT_LENS]
    return harness.write_json(harness.RUN_DIR / "prompts.json", prompts)


_runs: dict = {}


def generate(checkpoint: Path, prompts_file: Path, backend: str, *, eager=False, tp=1, mtp=0, broken=False) -> dict:
    """One vllm_run.py process per configuration (cached for the session)."""
    key = (backend, eager, tp, mtp, broken)
    if key in _runs:
        return _runs[key]
    name = f"{backend.lower()}{'-eager' if eager else '-graphs'}{f'-tp{tp}' if tp > 1 else ''}" \
           f"{f'-mtp{mtp}' if mtp else ''}{'-BROKEN' if broken else ''}"
    out = harness.RUN_DIR / f"{name}.json"
    # vLLM's own backends do not depend on this repository's code: their results are kept on disk (next
    # to the checkpoint's stamp) and reused by later pytest runs on the same machine, e.g. the next
    # device call. Our backend always runs.
    if backend != "CUSTOM":
        stamp = hashlib.sha256(f"{checkpoint.name}|{prompts_file.read_text()}|{MAX_TOKENS}|{LOGPROBS}".encode())
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
    env = harness.engine_env({"FLASHMLA_BACKEND_DEBUG_BREAK_SCALE": "1"} if broken else
                             {"FLASHMLA_BACKEND_DEBUG_BREAK_SCALE": "0"})
    log = harness.run_logged(name, cmd, env)
    if backend == "CUSTOM":
        assert OUR_LOG_LINE in log, f"{name}: the log does not show flashmla_backend running decode attention"
        assert ("WRONG softmax scale" in log) == broken
    result = json.loads(out.read_text())
    result["name"] = name
    _runs[key] = result
    return result


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


def test_cuda_graphs_agree_with_triton_mla_and_flashmla(checkpoint, prompts_file):
    triton = generate(checkpoint, prompts_file, "TRITON_MLA")
    flashmla = generate(checkpoint, prompts_file, "FLASHMLA")
    ours = generate(checkpoint, prompts_file, "CUSTOM")
    compare(flashmla, triton)  # baseline: two correct backends
    assert agrees(ours, triton, checkpoint, prompts_file)
    assert agrees(ours, flashmla, checkpoint, prompts_file)


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


# ---- vllm serve ---------------------------------------------------------------------------------

def test_serve_64_concurrent_completions(checkpoint):
    port = harness.free_port()
    base = f"http://127.0.0.1:{port}"
    harness.RUN_DIR.mkdir(parents=True, exist_ok=True)
    log_path = harness.RUN_DIR / "serve-custom.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(checkpoint), "--attention-backend",
           "CUSTOM", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096",
           "--gpu-memory-utilization", "0.5", "--max-num-seqs", "64", "--served-model-name", "tiny"]
    print(f"\n[serve] start: {' '.join(cmd)} (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=harness.engine_env(), stdout=log, stderr=subprocess.STDOUT,
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
        assert OUR_LOG_LINE in log_path.read_text(), "the server log does not show flashmla_backend decode"
    finally:
        _shutdown(proc)
        print(f"[serve] server stopped (exit code {proc.returncode})", flush=True)
    assert proc.returncode is not None


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
