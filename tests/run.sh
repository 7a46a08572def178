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
#   The engine conformance tests (the table in noxfile.py) are skipped here, with a reason that says
#   how to run them.
# --engines: also runs each engine conformance session of noxfile.py (one per engine release, the table
#   there; tests/README.md): each a virtualenv under .test-envs/ (git-ignored) that nox makes with uv on
#   first use and reuses while its recipe is unchanged. nox and uv themselves come from .test-envs/tools,
#   a virtualenv this makes once with the same Python (pinned NOX_REQ and UV_REQ below). Their output goes
#   to the terminal and to .test-envs/<engine>.nox.log; the installers' output to .test-envs/<session>.log.
#
# Fails (exit 1) when a pytest run fails, collects nothing (exit code 5), or passes no test (a skipped
# test is not a passed test), or when an engine environment (or the tools one) cannot be made. Ends with
# one line per run and one combined line: "N passed, N failed, N skipped".
#
# Environment: PYTHON (the interpreter), FLASHMLA_BACKEND_TORCH_INDEX (an extra package index for the
# engine environments' torch, e.g. https://download.pytorch.org/whl/cpu: the CPU build instead of the
# CUDA one with its NVIDIA wheels), FLASHMLA_BACKEND_EXTRA_ENGINES=1 (with --engines: also the sessions
# marked extra in noxfile.py's table).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON=${PYTHON:-$(command -v python || command -v python3 || echo python)}
ENVS="$ROOT/.test-envs"
# The tools that make the engine environments, in .test-envs/tools (pinned; raise them here).
NOX_REQ="nox==2026.10.20"
UV_REQ="uv==0.13.9"

say() { echo "tests/run.sh: $*"; }

# ---- arguments ---------------------------------------------------------------------------------
engines=0
args=()
for a in "$@"; do
  if [ "$a" = "--engines" ]; then engines=1; else args+=("$a"); fi
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

# The engine table lives in noxfile.py (plain Python, no nox needed to read it): "name session files extra".
table=$("$PYTHON" "$ROOT/noxfile.py" table) || { say "cannot read the engine table: $PYTHON noxfile.py table" >&2; exit 2; }
engine_files=()
selected=()   # "name session files" of the sessions --engines runs
while read -r name session files extra; do
  for file in ${files//,/ }; do
    case " ${engine_files[*]-} " in *" $file "*) ;; *) engine_files+=("$file") ;; esac
  done
  [ "$extra" = 1 ] && [ "${FLASHMLA_BACKEND_EXTRA_ENGINES:-0}" != 1 ] && continue
  selected+=("$name $session $files")
done <<<"$table"

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

# account LABEL RC JUNIT_XML: one run's line, its counts added to the sums, and why it fails if it does
account() {
  local label=$1 rc=$2 p f s
  read -r p f s < <(counts "$3")
  run_lines+=("$label: $p passed, $f failed, $s skipped")
  tp=$((tp + p)); tf=$((tf + f)); ts=$((ts + s))
  if [ "$rc" -eq 5 ]; then
    problems+=("$label: pytest collected no tests (exit code 5): discovery is broken, the module was skipped, or the arguments select nothing")
  elif [ "$rc" -ne 0 ]; then
    problems+=("$label: pytest exited with $rc")
  elif [ "$p" -eq 0 ]; then
    problems+=("$label: no test passed (all skipped?)")
  fi
}

# run_pytest LABEL PYTHON PYTHONPATH ENV-ASSIGNMENTS... -- PYTEST-ARGS...
run_pytest() {
  local label=$1 py=$2 pypath=$3; shift 3
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local report rc
  report="$(mktemp -t flashmla-junit-XXXXXX.xml)"
  if [ -n "$pypath" ]; then envs=(PYTHONPATH="$pypath" ${envs[@]+"${envs[@]}"}); else envs=(-u PYTHONPATH ${envs[@]+"${envs[@]}"}); fi
  env "${envs[@]}" "$py" -m pytest -rs --junitxml="$report" "$@"
  rc=$?
  account "$label" $rc "$report"
  rm -f "$report"
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

# ---- engine environments: nox sessions (noxfile.py) ---------------------------------------------
TOOLS="$ENVS/tools"
# make_tools: (re)makes $TOOLS, a virtualenv holding nox and uv, unless its stamp records the same recipe.
make_tools() {
  local log="$ENVS/tools.log" recipe
  recipe="tools 1
python $("$PYTHON" -c "import sys; print(sys.version.split()[0], getattr(sys, '_base_executable', sys.executable))")
$NOX_REQ $UV_REQ"
  if [ -f "$TOOLS/.recipe" ] && [ "$(cat "$TOOLS/.recipe")" = "$recipe" ]; then
    say "[tools] using $TOOLS ($NOX_REQ, $UV_REQ)"
    return 0
  fi
  [ -e "$TOOLS" ] && say "[tools] recipe changed or environment incomplete: making it again"
  rm -rf "$TOOLS"
  : >"$log"
  local n=0
  step() {   # step LABEL CMD...: one progress line; the command's output goes to the log
    local label=$1 t0=$SECONDS; shift
    n=$((n + 1))
    printf 'tests/run.sh: [tools] %d/2 %s ... ' "$n" "$label"
    echo "==== $label: $*" >>"$log"
    if env -u PYTHONPATH -u PIP_USER -u PIP_TARGET -u PIP_PREFIX "$@" >>"$log" 2>&1; then
      echo "$((SECONDS - t0)) s"
    else
      echo "FAILED"
      say "[tools] could not make $TOOLS; pip's output and the error: $log (last lines below)" >&2
      tail -n 15 "$log" | sed 's/^/    | /' >&2
      return 1
    fi
  }
  step "virtualenv ($PYTHON, Python $pyver)" "$PYTHON" -m venv "$TOOLS" &&
  step "$NOX_REQ $UV_REQ" "$TOOLS/bin/python" -m pip install --disable-pip-version-check --no-input "$NOX_REQ" "$UV_REQ" ||
  return 1
  printf '%s\n' "$recipe" >"$TOOLS/.recipe"   # written last: marks the environment complete
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
  old=("$ENVS"/*-py[0-9]*/.recipe)   # environments the former tests/run.sh made itself
  if [ -e "${old[0]}" ]; then
    say "not used any more (the nox sessions' are .test-envs/engines-*), rm -rf them to free their disk: ${old[*]%/.recipe}"
  fi
  if command -v flock >/dev/null; then exec 9>"$ENVS/.lock"; fi   # two runs at once take turns
  lock() { if command -v flock >/dev/null; then flock "$@" 9; fi; }
  lock
  make_tools
  tools_ok=$?
  lock -u
  for line in "${selected[@]}"; do
    read -r name session files <<<"$line"
    if [ $tools_ok -ne 0 ]; then
      run_lines+=("$name: not run (nox and uv could not be installed: $ENVS/tools.log)")
      problems+=("$name: not run, no nox")
      continue
    fi
    echo
    say "[$name] $TOOLS/bin/nox -s $session: ${files//,/ } (nox's output also in $ENVS/$name.nox.log)"
    report="$(mktemp -t flashmla-junit-XXXXXX.xml)"
    rcfile="$(mktemp -t flashmla-rc-XXXXXX)"
    : >"$rcfile"
    lock
    env -u PYTHONPATH FLASHMLA_BACKEND_ENGINE_PYTHONPATH="$engine_pythonpath" FLASHMLA_BACKEND_PYTEST_RC="$rcfile" \
      "$TOOLS/bin/nox" -f "$ROOT/noxfile.py" -s "$session" -- -rs --junitxml="$report" ${args[@]+"${args[@]}"} \
      2>&1 | tee "$ENVS/$name.nox.log"
    nox_rc=${PIPESTATUS[0]}
    lock -u
    rc=$(cat "$rcfile")
    if [ -z "$rc" ]; then   # the session ended before pytest: its environment could not be made
      run_lines+=("$name: not run (nox exited with $nox_rc before pytest: $ENVS/$name.nox.log)")
      problems+=("$name: environment could not be made")
    else
      account "$name" "$rc" "$report"
    fi
    rm -f "$report" "$rcfile"
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
