#!/usr/bin/env bash
# One call on a GPU machine: build in place, run the GPU tests, compute-sanitizer, the demo and
# (optionally) the benchmark. Logs go to $OUT (or ./gpu-check-out). Stages are chosen by arguments:
#
#   bash tests/gpu_check.sh build smoke test sanitize demo bench-quick bench
#
# Wheels the machine lacks (e.g. nvidia-cutlass for the headers) are taken from .whl/ if present.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=${OUT:-$ROOT/gpu-check-out}
mkdir -p "$OUT"
cd "$ROOT"
export PYTHONUNBUFFERED=1
status=0
stage() { echo; echo "=== $1 ($(date +%T))"; }

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

for s in "$@"; do
  case "$s" in
    build)
      stage build
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
      # in place with CMake (docs/build.md); cmake and ninja may come from .whl/ (their wheels' bin/ is on PATH)
      { MAX_JOBS=${MAX_JOBS:-16} cmake -S . -B build -G Ninja -DPython_EXECUTABLE="$(command -v python3)" &&
        cmake --build build; } 2>&1 | tee "$OUT/build.log" | grep -E "^\[|error|Error" || { status=1; break; }
      [ -f "$(ls flashmla_backend/_C*.so 2>/dev/null | head -1)" ] || { echo "build failed"; tail -50 "$OUT/build.log"; status=1; break; }
      ;;
    test)
      stage "gpu tests"
      # In parallel where pytest-xdist is installed (GPU_TEST_WORKERS processes on the one GPU, default 12): the fp64
      # oracles and the compiles of the device checks keep the GPU idle much of a test's time (H200, 16 cores: 8
      # processes ran about 62% of the suite in 330 s, 14 about 94% in 480 s). GPU_TEST_WORKERS=0: one process.
      workers=()
      if [ "${GPU_TEST_WORKERS:-12}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
        workers=(-n "${GPU_TEST_WORKERS:-12}")
      fi
      FLASHMLA_BACKEND_ERROR_REPORT="$OUT/errors.json" timeout ${TEST_TIMEOUT:-600} \
        python3 -m pytest tests --maxfail=${MAXFAIL:-15} -q -rs -m "${PYTEST_MARK:-gpu or not gpu}" ${workers[@]+"${workers[@]}"} ${PYTEST_ARGS:-} -p no:cacheprovider \
        --ignore=tests/test_vllm_cpu.py 2>&1 | tee "$OUT/pytest.log" | tail -40
      [ ${PIPESTATUS[0]} -eq 0 ] || status=1
      ;;
    smoke)
      stage "smoke (small shapes, every kernel)"
      timeout 120 python3 tests/sanitize_smoke.py 2>&1 | tee "$OUT/smoke.log" | tail -12
      [ ${PIPESTATUS[0]} -eq 0 ] || status=1
      ;;
    sanitize)
      for tool in memcheck racecheck synccheck; do
        stage "compute-sanitizer $tool"
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 \
          python3 tests/sanitize_smoke.py > "$OUT/sanitize-$tool.log" 2>&1
        rc=$?; tail -4 "$OUT/sanitize-$tool.log"; echo "$tool exit code $rc"; [ $rc -eq 0 ] || status=1
      done
      ;;
    demo)
      stage demo
      python3 -m flashmla_backend 2>&1 | tee "$OUT/demo.log" || status=1
      ;;
    bench-quick)
      stage "bench (quick)"
      timeout 300 python3 benchmarks/bench.py --quick --out-dir "$OUT/bench-quick" 2>&1 | tail -30 || status=1
      ;;
    bench)
      stage bench
      timeout 540 python3 benchmarks/bench.py --out-dir "$OUT/bench" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -40 || status=1
      ;;
    *) echo "unknown stage $s"; status=2 ;;
  esac
done
exit $status
