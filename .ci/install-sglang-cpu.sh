#!/usr/bin/env bash
# Install SGLang for the CPU conformance tests of the SGLang plugin (tests/test_sglang_cpu.py) into the
# current Python.
#
#   bash .ci/install-sglang-cpu.sh          # uses `python`; set PYTHON=... to pick another interpreter
#
# SGLang's wheel pins a CUDA torch and CUDA-only packages (sglang-kernel, flashinfer, ...). The tests need
# none of them: SGLang's attention registry, memory pools, ForwardBatch, plugin/hook registry, server-args
# passes, speculative draft factory and attention test kit import with the CPU torch. So: the CPU torch
# first, SGLang with --no-deps, then tests/requirements-sglang-cpu.txt (the packages those imports need,
# with specifiers that agree with vLLM 0.26.0's, so that vLLM's CPU tests keep their packages).
# SGLANG_VERSION defaults to 0.5.21, the newest release that pins torch 2.13 (CI's torch); the plugin
# supports 0.5.17-0.5.21 (flashmla_backend/sglang/_compat.py). pip reports "sglang 0.5.21 requires
# torch==2.13.0 ... sglang-kernel ..., which is not installed" and the like: expected and harmless here.
# torchvision is not installed (PyPI has only CUDA builds, which cannot load with the CPU torch); the
# tests import SGLang with a stand-in for it (see tests/test_sglang_cpu.py).
set -euo pipefail
PYTHON=${PYTHON:-python}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.21}
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

start=$(date +%s)
"$PYTHON" -m pip install "torch==${TORCH_VERSION}"
"$PYTHON" -m pip install --no-deps "sglang==${SGLANG_VERSION}"
"$PYTHON" -m pip install -r "$here/tests/requirements-sglang-cpu.txt"
# Smoke check: SGLang, its plugin/hook registry and triton import here (the modules that also need
# torchvision are imported by the tests, under their stand-in).
"$PYTHON" -c "import torch, triton, sglang; from sglang.srt.plugins.hook_registry import HookRegistry; print(f'sglang {sglang.__version__} with torch {torch.__version__}, triton {triton.__version__}: imports OK')"
echo "install-sglang-cpu: done in $(( $(date +%s) - start )) s"
