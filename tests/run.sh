#!/usr/bin/env bash
# The test command (README), also what .ci/run calls.
#
#   bash tests/run.sh [pytest args...]
#
# 1. Installs what the tests need and is missing: pytest; vLLM 0.26.0 and SGLang 0.5.21 for the plugins'
#    CPU conformance tests (.ci/install-vllm-cpu.sh, .ci/install-sglang-cpu.sh: CPU-only, a few minutes).
#    FLASHMLA_BACKEND_NO_INSTALL=1 skips this (machines without a package registry, e.g. the GPU machine
#    with a staged vLLM on PYTHONPATH).
# 2. Runs pytest on tests/ against the package under test: an in-place build of this checkout if there is
#    one (python setup.py build_ext --inplace), else the installed package (pip install .).
# 3. Fails when pytest fails, when it collected nothing (exit code 5) and when every test was skipped:
#    a skipped test is not a passed test.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON=${PYTHON:-python}

if [ "${FLASHMLA_BACKEND_NO_INSTALL:-0}" != "1" ]; then
  "$PYTHON" -c "import pytest" 2>/dev/null || "$PYTHON" -m pip install -q pytest || exit 1
  if ! "$PYTHON" -c "import vllm" 2>/dev/null; then
    echo "tests/run.sh: installing vLLM (CPU) for the plugin conformance tests ..."
    PYTHON="$PYTHON" bash "$ROOT/.ci/install-vllm-cpu.sh" || exit 1
  fi
  # find_spec, not import: SGLang 0.5.17-0.5.20 fail to import without torchvision, which the tests stub
  if ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"; then
    echo "tests/run.sh: installing SGLang (CPU) for the SGLang plugin tests ..."
    PYTHON="$PYTHON" bash "$ROOT/.ci/install-sglang-cpu.sh" || exit 1
  fi
fi

if compgen -G "$ROOT/flashmla_backend/_C*.so" >/dev/null; then
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # in-place build of this checkout
fi
cd "$ROOT/tests" || exit 1   # not the repo root: an installed package must not be shadowed by the sources
"$PYTHON" -c "import flashmla_backend, flashmla_backend._ext as e; print('tests/run.sh: testing', flashmla_backend.__file__, '(extension built)' if e.available() else '(no extension: CPU only)')" || exit 1

report="$(mktemp -t flashmla-junit-XXXX.xml)"
"$PYTHON" -m pytest . -rs --junitxml="$report" "$@"
rc=$?
if [ $rc -eq 5 ]; then
  echo "tests/run.sh: pytest collected no tests (exit code 5): test discovery is broken" >&2
  exit 1
fi
[ $rc -ne 0 ] && exit $rc
"$PYTHON" - "$report" <<'PY' || exit 1
import sys, xml.etree.ElementTree as ET
suites = ET.parse(sys.argv[1]).getroot()
suites = [suites] if suites.tag == "testsuite" else list(suites)
total = sum(int(s.get("tests", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
print(f"tests/run.sh: {total - skipped - failed} passed, {skipped} skipped, {failed} failed")
if total - skipped - failed <= 0:
    sys.exit("tests/run.sh: no test passed (all skipped?)")
PY
