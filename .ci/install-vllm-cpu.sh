#!/usr/bin/env bash
# Install vLLM 0.26.0 for the CPU conformance tests (tests/test_vllm_cpu.py) into the current Python.
#
#   bash .ci/install-vllm-cpu.sh            # uses `python`; set PYTHON=... to pick another interpreter
#
# vLLM's wheel pins torch==2.11.0 (CUDA 13) and several CUDA-only packages. The tests need none of
# them: vLLM's config, backend and builder classes import and run with the CPU torch. So we install
# the CPU torch first, vLLM with --no-deps, then vLLM's other requirements from
# tests/requirements-vllm-cpu.txt. pip then reports "vllm 0.26.0 requires torch==2.11.0, but you have
# torch 2.13.0+cpu" (and the same for the dropped CUDA packages): that is expected and harmless here.
set -euo pipefail
PYTHON=${PYTHON:-python}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VLLM_VERSION=${VLLM_VERSION:-0.26.0}
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

start=$(date +%s)
"$PYTHON" -m pip install "torch==${TORCH_VERSION}"
"$PYTHON" -m pip install --no-deps "vllm==${VLLM_VERSION}"
"$PYTHON" -m pip install -r "$here/tests/requirements-vllm-cpu.txt"
# xgrammar's requirements are all above except triton (1 GB, GPU-only): skip that one.
"$PYTHON" -m pip install --no-deps "xgrammar==0.2.7"  # 0.2.8 needs apache-tvm-ffi 0.1.11; vLLM pins 0.1.10
# Smoke check: the classes the plugin builds on import on this machine.
"$PYTHON" - <<'PY'
import torch, vllm
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend  # noqa: F401
from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend  # noqa: F401
import vllm.v1.worker.utils  # noqa: F401  (imports xgrammar through vLLM's structured-output module)
print(f"vllm {vllm.__version__} with torch {torch.__version__}: imports OK")
PY
echo "install-vllm-cpu: done in $(( $(date +%s) - start )) s"
