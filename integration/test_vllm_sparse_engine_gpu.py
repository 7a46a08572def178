"""Engine-level GPU tests: vLLM 0.26 serving a random-weight DeepSeek-V3.2 model (sparse attention) on our decode.

    python -m pytest integration/test_vllm_sparse_engine_gpu.py -v -s      (a Hopper GPU, vLLM 0.26.0 with its DeepGEMM)

The checkpoint is models/tiny-deepseek-v32 (3 layers, 64 heads, an indexer of 64 heads x 128 picking 512 tokens) from
make_tiny_checkpoint.py. Every run is its own integration/vllm_run.py process (or `vllm serve`) with
FLASHMLA_BACKEND_SPARSE_GPU=1 (README, "Environment variables": without it the plugin's sparse backend refuses a GPU),
the fp8_ds_mla cache (`--kv-cache-dtype fp8`, which vLLM stores as fp8_ds_mla for this model; the sparse kernel reads
that cache on Hopper) and 64-token blocks; greedy, MAX_TOKENS tokens with ignore_eos, on prompts of 1-3000 tokens
(those past 512 tokens are where the indexer's choice matters). vLLM's own indexer picks the tokens in every run.

Both backends round every cached value to e4m3 with per-128-channel scales, so, as for the dense FP8 runs of
test_vllm_engine_gpu.py, two runs are judged by the fp32 model (transformers' DeepSeek-V3.2 on the checkpoint,
integration/fp32_oracle.py): each run's mean |logprob - fp32| along its own tokens, ours no worse than vLLM's
FLASHMLA_SPARSE (fp32_oracle.fp8_no_worse); the pairwise figures of test_vllm_engine_gpu.compare are printed beside.
  * CUDA graphs, ours against FLASHMLA_SPARSE; eager ours against the same;
  * the broken run (FLASHMLA_BACKEND_DEBUG_BREAK_SCALE=1: our sparse attention with a 1.5x softmax scale, eager) must
    fail the criterion that the unbroken run passes;
  * MTP (one speculative token, a checkpoint with the MTP layer), ours against FLASHMLA_SPARSE on that checkpoint
    without speculation;
  * `vllm serve --attention-backend CUSTOM --kv-cache-dtype fp8` with 64 concurrent completions of prompts of 1-2530
    tokens: every response complete, our sparse decode line in the server's log;
  * the 16-bit cache (`--kv-cache-dtype auto`, bf16; our sparse decode gathers each query token's tokens for the dense
    kernel), CUDA graphs, ours against FLASHMLA_SPARSE on the same cache, by the same criterion.
vLLM's sparse indexer refuses to start on CUDA without DeepGEMM, which vLLM vendors under vllm/third_party/deep_gemm
(integration/README.md: keep it when packing vLLM for these tests).
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

import harness
import test_vllm_engine_gpu as dense
from fp32_oracle import fp8_no_worse

from flashmla_backend._env import DEBUG_BREAK_SCALE_ENV, SPARSE_GPU_ENV

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the sparse decode kernel needs a Hopper GPU (sm_90)", allow_module_level=True)

CONFIG = harness.MODELS / "tiny-deepseek-v32" / "config.json"
INDEX_TOPK = json.loads(CONFIG.read_text())["index_topk"]
PROMPT_LENS = [1, 17, 64, 300, INDEX_TOPK - 1, INDEX_TOPK + 1, 700, 1000, 2047, 3000]
MAX_TOKENS = dense.MAX_TOKENS
LOGPROBS = dense.LOGPROBS
BLOCK_SIZE = 64
OUR_LOG_LINE = "sparse MLA attention (DeepSeek-V3.2 indexer) runs on flashmla_backend"
OUR_KERNEL_TEXT = {"fp8": "the Hopper sparse decode kernel", "auto": "the dense decode kernel on the gathered tokens"}
BROKEN_LOG_TEXT = "sparse MLA attention uses a WRONG softmax scale"


@pytest.fixture(scope="session")
def checkpoint() -> Path:
    return harness.tiny_checkpoint(CONFIG, mtp=False)


@pytest.fixture(scope="session")
def mtp_checkpoint() -> Path:
    return harness.tiny_checkpoint(CONFIG, mtp=True)


@pytest.fixture(scope="session")
def prompts_file() -> Path:
    rng = random.Random(4321)
    prompts = [[rng.randrange(2, 1024) for _ in range(n)] for n in PROMPT_LENS]
    return harness.write_json(harness.RUN_DIR / "prompts-v32.json", prompts)


def sparse_log_problems(log: str, backend: str, broken: bool, kv: str = "fp8") -> list[str]:
    """Ours: our sparse decode line naming the kernel of the cache `kv`, and the wrong-scale warning exactly when
    broken. vLLM's: neither line."""
    ours = [line for line in log.splitlines() if OUR_LOG_LINE in line]
    problems = []
    if backend == "CUSTOM":
        if not ours:
            problems.append(f"the log lacks {OUR_LOG_LINE!r}")
        elif not any(OUR_KERNEL_TEXT[kv] in line for line in ours):
            problems.append(f"our sparse decode line does not name {OUR_KERNEL_TEXT[kv]!r}: {ours[0].strip()!r}")
        if (BROKEN_LOG_TEXT in log) != broken:
            problems.append("the wrong-scale hook's warning is " + ("missing" if broken else "present unasked"))
    elif ours:
        problems.append(f"a {backend} run's log shows our sparse decode line")
    return problems


_runs: dict = {}


def generate(checkpoint: Path, prompts_file: Path, backend: str, *, eager=False, broken=False, mtp=0,
             kv="fp8") -> dict:
    """One vllm_run.py process per configuration (cached for the session), 64-token blocks; kv: --kv-cache-dtype
    (fp8: stored as fp8_ds_mla; auto: bf16)."""
    key = (str(checkpoint), backend, eager, broken, mtp, kv)
    if key in _runs:
        return _runs[key]
    name = "-".join(["v32", backend.lower(), kv, "eager" if eager else "graphs"] + ([f"mtp{mtp}"] if mtp else [])
                    + (["BROKEN"] if broken else []))
    if mtp == 0 and "-mtp" in checkpoint.name:
        name += "-on-mtp-ckpt"
    out = harness.RUN_DIR / f"{name}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(harness.INTEGRATION / "vllm_run.py"), "--model", str(checkpoint), "--backend", backend,
           "--prompts", str(prompts_file), "--out", str(out), "--max-tokens", str(MAX_TOKENS),
           "--logprobs", str(LOGPROBS), "--mtp", str(mtp), "--kv-cache-dtype", kv,
           "--block-size", str(BLOCK_SIZE)]
    if eager:
        cmd.append("--enforce-eager")
    env = harness.engine_env({SPARSE_GPU_ENV: "1", DEBUG_BREAK_SCALE_ENV: "1" if broken else "0"})
    log = harness.run_logged(name, cmd, env)
    problems = sparse_log_problems(log, backend, broken, kv)
    assert not problems, f"{name}: " + "; ".join(problems)
    result = json.loads(out.read_text())
    result["name"] = name
    _runs[key] = result
    return result


def judged(ours: dict, ref: dict, checkpoint: Path, prompts_file: Path) -> bool:
    """The pairwise figures (printed), then the verdict: ours' mean |logprob - fp32| no worse than ref's."""
    dense.compare(ours, ref)
    m_ref = dense.fp32_error(ref, checkpoint, prompts_file)
    ok = fp8_no_worse(ours["name"], dense.fp32_error(ours, checkpoint, prompts_file), ref["name"], m_ref)
    dense.print_fp32_errors()
    return ok


def test_cuda_graphs_no_further_from_fp32_than_flashmla_sparse(checkpoint, prompts_file):
    theirs = generate(checkpoint, prompts_file, "FLASHMLA_SPARSE")
    ours = generate(checkpoint, prompts_file, "CUSTOM")
    assert judged(ours, theirs, checkpoint, prompts_file)


def test_enforce_eager_no_further_from_fp32_than_flashmla_sparse(checkpoint, prompts_file):
    theirs = generate(checkpoint, prompts_file, "FLASHMLA_SPARSE")
    ours = generate(checkpoint, prompts_file, "CUSTOM", eager=True)
    assert judged(ours, theirs, checkpoint, prompts_file)


def test_broken_sparse_attention_fails_the_criterion(checkpoint, prompts_file):
    """Proves the criterion can fail: the wrong-scale run must be further from fp32 than FLASHMLA_SPARSE allows,
    while the unbroken eager run is not."""
    theirs = generate(checkpoint, prompts_file, "FLASHMLA_SPARSE")
    good = generate(checkpoint, prompts_file, "CUSTOM", eager=True)
    broken = generate(checkpoint, prompts_file, "CUSTOM", eager=True, broken=True)
    assert judged(good, theirs, checkpoint, prompts_file), "the unbroken run must pass the same criterion"
    assert not judged(broken, theirs, checkpoint, prompts_file), \
        "a deliberately broken sparse attention passed the criterion: it is too loose"


def test_mtp_no_further_from_fp32_than_flashmla_sparse(mtp_checkpoint, prompts_file):
    """One MTP token (s_q = 2 in the decode kernel) against FLASHMLA_SPARSE on the same checkpoint without speculation
    (greedy speculation keeps the target model's tokens, so both are the target model's generation)."""
    theirs = generate(mtp_checkpoint, prompts_file, "FLASHMLA_SPARSE")
    ours = generate(mtp_checkpoint, prompts_file, "CUSTOM", mtp=1)
    assert judged(ours, theirs, mtp_checkpoint, prompts_file)


def test_serve_64_concurrent_completions(checkpoint):
    log = dense.serve_64_concurrent(checkpoint, "fp8", "serve-v32-custom-fp8", ("--block-size", str(BLOCK_SIZE)),
                                    env_extra={SPARSE_GPU_ENV: "1"})
    problems = sparse_log_problems(log, "CUSTOM", broken=False)
    assert not problems, f"server log: {'; '.join(problems)}"


def test_bf16_cache_no_further_from_fp32_than_flashmla_sparse(checkpoint, prompts_file):
    """The 16-bit cache: our sparse decode gathers each query token's tokens for the dense kernel; FLASHMLA_SPARSE
    reads the same bf16 cache with its own kernel."""
    theirs = generate(checkpoint, prompts_file, "FLASHMLA_SPARSE", kv="auto")
    ours = generate(checkpoint, prompts_file, "CUSTOM", kv="auto")
    assert judged(ours, theirs, checkpoint, prompts_file)
