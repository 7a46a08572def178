#!/usr/bin/env bash
# The test command (tests/README.md), also what .ci/run calls.
#
#   bash tests/run.sh [--engines] [pytest args...]
#
# Installs nothing into the active environment: it never calls pip on the active interpreter.
#
# Core run: pytest on tests/ with the active Python ($PYTHON, else `python`, else `python3`) as it is.
#   The package under test is an in-place build of this checkout if flashmla_backend/_C*.so exists
#   (CMake by itself, docs/build.md), else the installed package, else this checkout's sources
#   without the compiled module (CPU tensors only). pytest must be installed there; if it is not, this
#   says how to add it and exits with 2 (it does not install it for you, nor run a pytest from elsewhere:
#   see tests/README.md).
#   The engine conformance tests (the ENGINES table below) are skipped here, with a reason that says
#   how to run them.
# --engines: also runs each engine conformance test file in its own virtualenv under .test-envs/
#   (git-ignored), made on first use by the same Python and reused while its recipe is unchanged:
#   torch 2.13.0 (CPU), the engine with --no-deps, its requirement file, pytest. pip's output goes to
#   .test-envs/<env>.log; one progress line per step is printed.
#
# Fails (exit 1) when a pytest run fails, collects nothing (exit code 5), or passes no test (a skipped
# test is not a passed test), or when an engine environment cannot be made. Ends with one line per run
# and one combined line: "N passed, N failed, N skipped".
#
# Environment: PYTHON (the interpreter), FLASHMLA_BACKEND_TORCH_INDEX (an extra package index for the
# engine environments' torch, e.g. https://download.pytorch.org/whl/cpu so that pip takes the CPU build
# instead of the CUDA one with its NVIDIA wheels), FLASHMLA_BACKEND_EXTRA_ENGINES=1 (with --engines: also
# the ENGINES_EXTRA environments).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON=${PYTHON:-$(command -v python || command -v python3 || echo python)}
ENVS="$ROOT/.test-envs"
TORCH_REQ="torch==2.13.0"
TORCH_INDEX=${FLASHMLA_BACKEND_TORCH_INDEX:-}
RECIPE_VERSION=1   # raise when the way the environments are made changes: every one is made again

# Engine conformance environments, one line each (fields separated by spaces):
#   name            test files (tests/, comma-separated)     installed with --no-deps (comma-separated)   then: pip install -r tests/...
ENGINES=(
  "vllm-0.26.0      test_vllm_cpu.py,test_vllm_dcp_cpu.py    vllm==0.26.0,xgrammar==0.2.7                  requirements-vllm-cpu.txt"
  "vllm-0.33.0      test_vllm_cpu.py,test_vllm_dcp_cpu.py    vllm==0.33.0,xgrammar==0.2.8                  requirements-vllm-0.33-cpu.txt"
  "sglang-0.5.21    test_sglang_cpu.py,test_sglang_dcp_cpu.py  sglang==0.5.21                              requirements-sglang-cpu.txt"
  "sglang-0.5.23    test_sglang_cpu.py,test_sglang_dcp_cpu.py  sglang==0.5.23                              requirements-sglang-0.5.23-cpu.txt"
)
# More environments, made and run only when FLASHMLA_BACKEND_EXTRA_ENGINES=1 (same fields as above):
# older releases a plugin still supports, kept out of the default run for their time (tests/README.md).
ENGINES_EXTRA=(
  "sglang-0.5.17    test_sglang_cpu.py,test_sglang_dcp_cpu.py  sglang==0.5.17                              requirements-sglang-0.5.17-cpu.txt"
)
[ "${FLASHMLA_BACKEND_EXTRA_ENGINES:-0}" = 1 ] && ENGINES+=("${ENGINES_EXTRA[@]}")
# Why --no-deps: the engines' wheels pin a CUDA torch and CUDA-only packages the CPU tests do not need;
# the requirement files hold the rest (see their headers). xgrammar: all of its requirements are in
# vLLM's file except triton (1 GB, GPU-only); 0.2.7 with vLLM 0.26.0 because 0.2.8 needs apache-tvm-ffi
# 0.1.11 and vLLM 0.26.0 pins 0.1.10; vLLM 0.33.0 pins xgrammar 0.2.8 and apache-tvm-ffi 0.1.11.

say() { echo "tests/run.sh: $*"; }

# ---- arguments ---------------------------------------------------------------------------------
engines=0
args=()
for a in "$@"; do
  if [ "$a" = "--engines" ]; then engines=1; else args+=("$a"); fi
done

engine_files=()
for line in "${ENGINES[@]}"; do
  read -r _ files _ _ <<<"$line"
  for file in ${files//,/ }; do
    case " ${engine_files[*]-} " in *" $file "*) ;; *) engine_files+=("$file") ;; esac
  done
done

# ---- the active environment: pytest and the package under test ---------------------------------
cd "$ROOT/tests" || exit 1   # not the repo root: an installed package must not be shadowed by the sources
# The tests' own requirements (the package's `test` extra): pytest, and numpy for the numpy-scalar cases.
if ! "$PYTHON" -c "import pytest, numpy" 2>/dev/null; then
  cat >&2 <<EOF
tests/run.sh: pytest and numpy (the package's test extra) are not both installed for $(command -v "$PYTHON" || echo "$PYTHON").
  This command installs nothing into your environment. Add them to it yourself:
      $PYTHON -m pip install pytest numpy
  or pick another interpreter: PYTHON=/path/to/python bash tests/run.sh
EOF
  exit 2
fi

pyver=$("$PYTHON" -c "import sys; print('%d.%d' % sys.version_info[:2])") || exit 1
if compgen -G "$ROOT/flashmla_backend/_C*.so" >/dev/null; then
  mode=checkout; what="the in-place build of this checkout"
else
  pkgdir=$("$PYTHON" -c "
import importlib.util as u
s = u.find_spec('flashmla_backend')
print(s.submodule_search_locations[0] if s and s.submodule_search_locations else '')") || exit 1
  if [ -n "$pkgdir" ]; then
    mode=installed; what="the installed package"
  else
    mode=checkout; what="this checkout's sources (not built, not installed: CPU tensors only)"
  fi
fi
core_pythonpath=${PYTHONPATH:-}   # the user's, as it is
[ "$mode" = checkout ] && core_pythonpath="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# ---- helpers -----------------------------------------------------------------------------------
# counts JUNIT_XML -> "passed failed skipped" ("0 0 0" when pytest wrote no report)
counts() {
  "$PYTHON" - "$1" <<'PY'
import os, sys, xml.etree.ElementTree as ET
path = sys.argv[1]
if not os.path.exists(path) or os.path.getsize(path) == 0:
    print("0 0 0"); sys.exit()
root = ET.parse(path).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
total = sum(int(s.get("tests", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
print(total - skipped - failed, failed, skipped)
PY
}

run_lines=()     # "label: N passed, N failed, N skipped"
problems=()      # why the command fails
tp=0; tf=0; ts=0

# run_pytest LABEL PYTHON PYTHONPATH ENV-ASSIGNMENTS... -- PYTEST-ARGS...
run_pytest() {
  local label=$1 py=$2 pypath=$3; shift 3
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local report rc p f s
  report="$(mktemp -t flashmla-junit-XXXXXX.xml)"
  if [ -n "$pypath" ]; then envs=(PYTHONPATH="$pypath" ${envs[@]+"${envs[@]}"}); else envs=(-u PYTHONPATH ${envs[@]+"${envs[@]}"}); fi
  env "${envs[@]}" "$py" -m pytest -rs --junitxml="$report" "$@"
  rc=$?
  read -r p f s < <(counts "$report")
  rm -f "$report"
  run_lines+=("$label: $p passed, $f failed, $s skipped")
  tp=$((tp + p)); tf=$((tf + f)); ts=$((ts + s))
  if [ $rc -eq 5 ]; then
    problems+=("$label: pytest collected no tests (exit code 5): discovery is broken, the module was skipped, or the arguments select nothing")
  elif [ $rc -ne 0 ]; then
    problems+=("$label: pytest exited with $rc")
  elif [ "$p" -eq 0 ]; then
    problems+=("$label: no test passed (all skipped?)")
  fi
}

# ---- core run ----------------------------------------------------------------------------------
env PYTHONPATH="$core_pythonpath" "$PYTHON" -c "
import sys, flashmla_backend, flashmla_backend._ext as e
print(f'tests/run.sh: core run, Python {sys.argv[1]} ({sys.executable}): testing', flashmla_backend.__file__,
      '(extension built)' if e.available() else '(no extension: CPU only)')" "$pyver" || {
  say "cannot import flashmla_backend ($what) with $PYTHON; is torch installed?" >&2
  exit 2
}
core_args=()
if [ $engines -eq 1 ]; then
  for f in "${engine_files[@]}"; do core_args+=("--ignore=$f"); done   # run below, in their own environments
  skip_env=()
else
  skip_env=("FLASHMLA_BACKEND_SKIP_ENGINE_TESTS=${engine_files[*]}")     # tests/conftest.py skips them
fi
run_pytest "core" "$PYTHON" "$core_pythonpath" ${skip_env[@]+"${skip_env[@]}"} -- . ${core_args[@]+"${core_args[@]}"} ${args[@]+"${args[@]}"}

# ---- engine environments -----------------------------------------------------------------------
# make_env NAME NODEPS REQFILE: (re)makes $ENVS/NAME-pyX.Y unless its stamp records the same recipe.
make_env() {
  local name=$1 nodeps=$2 reqfile=$3
  local dir="$ENVS/$name-py$pyver" log="$ENVS/$name-py$pyver.log"
  local recipe   # what the environment is made of (requirement files without their comments)
  recipe="recipe $RECIPE_VERSION
python $("$PYTHON" -c "import sys; print(sys.version.split()[0], getattr(sys, '_base_executable', sys.executable))")
torch $TORCH_REQ${TORCH_INDEX:+ extra-index $TORCH_INDEX}
no-deps ${nodeps//,/ }
requirements $reqfile $(sed -E -e 's/(^|[[:space:]]+)#.*//' -e '/^[[:space:]]*$/d' "$ROOT/tests/$reqfile" | sha256sum | cut -d' ' -f1)
pytest pytest"
  if [ -f "$dir/.recipe" ] && [ "$(cat "$dir/.recipe")" = "$recipe" ]; then
    say "[$name] using $dir"
    return 0
  fi
  local py="$dir/bin/python" pipq=(-m pip install --disable-pip-version-check --no-input)
  local idx=()
  [ -n "$TORCH_INDEX" ] && idx=(--extra-index-url "$TORCH_INDEX")
  [ -e "$dir" ] && say "[$name] recipe changed or environment incomplete: making it again"
  rm -rf "$dir"
  : >"$log"
  local start=$SECONDS n=0
  step() {   # step LABEL CMD...: one progress line; the command's output goes to the log
    local label=$1 t0=$SECONDS; shift
    n=$((n + 1))
    printf 'tests/run.sh: [%s] %d/5 %s ... ' "$name" "$n" "$label"
    echo "==== $label: $*" >>"$log"
    if env -u PYTHONPATH -u PIP_USER -u PIP_TARGET -u PIP_PREFIX "$@" >>"$log" 2>&1; then
      echo "$((SECONDS - t0)) s"
    else
      echo "FAILED"
      say "[$name] could not make $dir; pip's output and the error: $log (last lines below)" >&2
      tail -n 15 "$log" | sed 's/^/    | /' >&2
      return 1
    fi
  }
  step "virtualenv ($PYTHON, Python $pyver)" "$PYTHON" -m venv "$dir" &&
  step "$TORCH_REQ and pytest" "$py" "${pipq[@]}" ${idx[@]+"${idx[@]}"} "$TORCH_REQ" pytest &&
  step "${nodeps//,/ } (--no-deps)" "$py" "${pipq[@]}" --no-deps ${nodeps//,/ } &&
  step "tests/$reqfile" "$py" "${pipq[@]}" -r "$ROOT/tests/$reqfile" &&
  step "check: torch and the engine import" "$py" -c "
import importlib, torch, pytest
for spec in '${nodeps}'.split(','):
    name = spec.split('==')[0]
    if name in ('vllm', 'sglang'):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:  # no environment holds torchvision (PyPI: CUDA builds only);
            if e.name != 'torchvision':   # the test files stand in for it (SGLang 0.5.17-0.5.20 import it)
                raise
            print(name, 'imports torchvision at import; the tests stand in for it')
print('imports OK with torch', torch.__version__)" || return 1
  printf '%s\n' "$recipe" >"$dir/.recipe"   # written last: marks the environment complete
  say "[$name] ready in $((SECONDS - start)) s: $dir ($(du -sh "$dir" | cut -f1))"
}

if [ $engines -eq 1 ]; then
  mkdir -p "$ENVS"
  printf '*\n' >"$ENVS/.gitignore"
  if [ "$mode" = installed ]; then
    # Only the package under test, not the rest of the active site-packages: a folder holding a link
    # to it (remade each run: the installed copy may move). Its compiled module fits the environments'
    # Python, made by the same interpreter, and links no libtorch, so it loads with their torch.
    mkdir -p "$ENVS/package-py$pyver"
    ln -sfn "$pkgdir" "$ENVS/package-py$pyver/flashmla_backend"
    engine_pythonpath="$ENVS/package-py$pyver"
  else
    engine_pythonpath="$ROOT"
  fi
  for line in "${ENGINES[@]}"; do
    read -r name file nodeps reqfile <<<"$line"
    if command -v flock >/dev/null; then exec 9>"$ENVS/.lock" && flock 9; fi   # two runs at once
    make_env "$name" "$nodeps" "$reqfile"
    made=$?
    if command -v flock >/dev/null; then flock -u 9; fi
    if [ $made -ne 0 ]; then
      run_lines+=("$name: not run (its environment could not be made: $ENVS/$name-py$pyver.log)")
      problems+=("$name: environment could not be made")
      continue
    fi
    echo
    from=$(env PYTHONPATH="$engine_pythonpath" PYTHONNOUSERSITE=1 "$ENVS/$name-py$pyver/bin/python" -c \
      "import flashmla_backend; print(flashmla_backend.__file__)" 2>/dev/null) || from="(does not import)"
    say "[$name] ${file//,/ } with $ENVS/$name-py$pyver/bin/python, flashmla_backend from $from"
    run_pytest "$name" "$ENVS/$name-py$pyver/bin/python" "$engine_pythonpath" PYTHONNOUSERSITE=1 -- ${file//,/ } ${args[@]+"${args[@]}"}
  done
fi

# ---- summary -----------------------------------------------------------------------------------
echo
say "summary"
for l in ${run_lines[@]+"${run_lines[@]}"}; do echo "  $l"; done
if [ $engines -eq 0 ]; then
  echo "  engine conformance tests not run (${engine_files[*]}): bash tests/run.sh --engines runs them"
fi
for p in ${problems[@]+"${problems[@]}"}; do echo "tests/run.sh: FAILED: $p"; done
echo "$tp passed, $tf failed, $ts skipped"
[ ${#problems[@]} -eq 0 ]
