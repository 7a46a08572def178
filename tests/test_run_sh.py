"""tests/run.sh, the test command: it installs nothing into the active environment, makes each engine
environment once (again when its recipe changes), and fails when a run fails, collects nothing or
passes nothing.

run.sh runs here on a copy of its checkout (tests/run.sh, the requirement files, the engine test files
and a stand-in flashmla_backend) with a stand-in `python` first on PATH. The stand-in records every
call with its PYTHONPATH; it fakes `-m pip` (prints a resolver-style ERROR line, succeeds unless
FAKE_PIP_FAIL is set), `-m venv` (a folder whose bin/python is the stand-in again) and `-m pytest`
(writes a JUnit report with the counts in FAKE_core / FAKE_vllm / FAKE_sglang: "passed failed skipped
exit-code"); everything else goes to the real interpreter. Nothing is downloaded; a few seconds in all.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENGINE_FILES = ("test_vllm_cpu.py", "test_vllm_dcp_cpu.py", "test_sglang_cpu.py", "test_sglang_dcp_cpu.py")
PYVER = "%d.%d" % sys.version_info[:2]


def _table(name: str) -> list[str]:
    """The environment names of a table of tests/run.sh (ENGINES or ENGINES_EXTRA)."""
    text = (REPO / "tests" / "run.sh").read_text()
    body = re.search(rf"^{name}=\(\n(.*?)^\)", text, flags=re.S | re.M).group(1)
    return [line.split()[0].strip('"') for line in body.splitlines() if line.strip().startswith('"')]


ENVS = _table("ENGINES")
VLLM_ENVS = [e for e in ENVS if e.startswith("vllm-")]
SGLANG_ENVS = [e for e in ENVS if e.startswith("sglang-")]
EXTRA_ENVS = _table("ENGINES_EXTRA")

FAKE_PYTHON = r"""#!/usr/bin/env bash
me="$0"
{ printf '%s' "$me"; printf '\t%s' "$@"; printf '\tPYTHONPATH=%s\tSKIP=%s\n' "${PYTHONPATH-}" \
    "${FLASHMLA_BACKEND_SKIP_ENGINE_TESTS-}"; } >>"$FAKE_LOG"
if [ "${1-}" = -m ]; then
  case "${2-}" in
    pip)
      echo "ERROR: pip's dependency resolver does not currently take into account (stand-in)"
      [ -n "${FAKE_PIP_FAIL-}" ] && exit 1
      exit 0 ;;
    venv)
      dir="${@: -1}"; mkdir -p "$dir/bin"; cp "$me" "$dir/bin/python"; exit 0 ;;
    pytest)
      key=core
      for a in "$@"; do
        case "$a" in test_vllm_cpu.py) key=vllm ;; test_sglang_cpu.py) key=sglang ;; esac
      done
      var="FAKE_$key"; read -r p f s rc <<<"${!var:-3 0 1 0}"
      for a in "$@"; do case "$a" in --junitxml=*) xml="${a#--junitxml=}" ;; esac; done
      echo "<testsuites><testsuite errors=\"0\" failures=\"$f\" skipped=\"$s\" tests=\"$((p + f + s))\"/></testsuites>" >"$xml"
      echo "stand-in pytest ($key): $p passed"
      exit "$rc" ;;
  esac
fi
case "$me" in */.test-envs/*) exit 0 ;; esac   # an engine environment's checks
if [ "${1-}" = -c ] && [ "${2-}" = "import pytest, numpy" ] && [ -n "${FAKE_NO_PYTEST-}" ]; then exit 1; fi
exec "$FAKE_REAL_PYTHON" "$@"
"""


def _package(where: Path) -> Path:
    pkg = where / "flashmla_backend"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_ext.py").write_text("def available():\n    return False\n")
    return pkg


@pytest.fixture
def checkout(tmp_path):
    root = tmp_path / "checkout"
    (root / "tests").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "run.sh", root / "tests" / "run.sh")
    for f in (REPO / "tests").glob("requirements-*.txt"):
        shutil.copy(f, root / "tests" / f.name)
    for name in ENGINE_FILES:
        shutil.copy(REPO / "tests" / name, root / "tests" / name)
    _package(root)
    (root / "flashmla_backend" / "_C.stand-in.so").write_text("")  # looks like an in-place build
    return root


class Run:
    def __init__(self, tmp_path: Path, root: Path):
        self.root = root
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        for name in ("python", "python3"):
            (self.bin / name).write_text(FAKE_PYTHON)
            (self.bin / name).chmod(0o755)
        self.log = tmp_path / "calls.log"

    def __call__(self, *args: str, **env: str):
        self.log.write_text("")
        e = {k: v for k, v in os.environ.items()
             if not k.startswith(("FLASHMLA_BACKEND_", "PIP_", "FAKE_")) and k not in ("PYTHON", "PYTHONPATH")}
        e.update(PATH=f"{self.bin}{os.pathsep}{os.environ['PATH']}", FAKE_LOG=str(self.log),
                 FAKE_REAL_PYTHON=sys.executable, **env)
        p = subprocess.run(["bash", str(self.root / "tests" / "run.sh"), *args], env=e, cwd=self.root,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
        self.out = p.stdout
        self.calls = [line.split("\t") for line in self.log.read_text().splitlines()]
        return p.returncode

    def by_active(self, what: str):
        """Calls of the active interpreter (not of an engine environment's) whose arguments start so."""
        return [c for c in self.calls if ".test-envs" not in c[0] and " ".join(c[1:]).startswith(what)]

    def by_envs(self, what: str):
        return [c for c in self.calls if ".test-envs" in c[0] and " ".join(c[1:]).startswith(what)]

    def last_line(self) -> str:
        return self.out.rstrip("\n").splitlines()[-1]


@pytest.fixture
def run(tmp_path, checkout):
    return Run(tmp_path, checkout)


def test_core_run_installs_nothing_and_skips_the_engine_tests(run):
    assert run("-k", "something") == 0, run.out
    assert not run.by_active("-m pip") and not run.by_active("-m venv"), run.calls
    (pytest_call,) = run.by_active("-m pytest")
    assert "-k" in pytest_call and "something" in pytest_call
    assert pytest_call[-1] == "SKIP=" + " ".join(ENGINE_FILES)  # tests/conftest.py skips these
    assert pytest_call[-2] == f"PYTHONPATH={run.root}"          # the in-place build
    assert "engine conformance tests not run" in run.out and "bash tests/run.sh --engines" in run.out
    assert run.last_line() == "3 passed, 0 failed, 1 skipped"
    assert not (run.root / ".test-envs").exists()


def test_engine_envs_are_made_once_reused_and_remade_when_the_recipe_changes(run):
    envs = run.root / ".test-envs"
    assert run("--engines", "-x") == 0, run.out
    assert not run.by_active("-m pip"), "pip ran on the active interpreter"
    assert len(run.by_active("-m venv")) == len(ENVS)
    pip_calls = run.by_envs("-m pip install")
    assert len(pip_calls) == 3 * len(ENVS) and all(c[0].startswith(str(envs)) for c in pip_calls)
    assert any("--no-deps" in c and "vllm==0.26.0" in c for c in pip_calls)
    assert any("--no-deps" in c and "vllm==0.33.0" in c for c in pip_calls)
    assert any("-r" in c and c[c.index("-r") + 1].endswith("requirements-vllm-0.33-cpu.txt") for c in pip_calls)
    assert any("-r" in c and c[c.index("-r") + 1].endswith("requirements-sglang-cpu.txt") for c in pip_calls)
    for name in ENVS:
        assert (envs / f"{name}-py{PYVER}" / ".recipe").read_text().startswith("recipe ")
        assert "dependency resolver" in (envs / f"{name}-py{PYVER}.log").read_text()
    assert "ERROR" not in run.out  # pip's resolver noise stays in the logs
    (core,) = run.by_active("-m pytest")
    engine_runs = run.by_envs("-m pytest")
    assert all(f"--ignore={f}" in core for f in ENGINE_FILES) and core[-1] == "SKIP="
    assert [c[0].split("/.test-envs/")[1].split("/")[0] for c in engine_runs] == [f"{e}-py{PYVER}" for e in ENVS]
    for name, call in zip(ENVS, engine_runs):
        file = "test_vllm_cpu.py" if name in VLLM_ENVS else "test_sglang_cpu.py"
        assert file in call and "-x" in call and call[-2] == f"PYTHONPATH={run.root}"
    assert run.last_line() == f"{3 * (1 + len(ENVS))} passed, 0 failed, {1 + len(ENVS)} skipped"

    assert run("--engines") == 0, run.out
    assert not run.by_active("-m venv") and not run.by_envs("-m pip"), "complete environments were made again"
    assert len(run.by_envs("-m pytest")) == len(ENVS)

    req = run.root / "tests" / "requirements-vllm-cpu.txt"
    req.write_text(req.read_text() + "# a comment is not part of the recipe\n")
    assert run("--engines") == 0 and not run.by_active("-m venv"), run.out
    req.write_text(req.read_text() + "six\n")
    assert run("--engines") == 0, run.out
    (venv,) = run.by_active("-m venv")
    assert venv[-3].endswith(f"vllm-0.26.0-py{PYVER}")
    assert "recipe changed" in run.out


def test_an_incomplete_env_is_made_again(run):
    assert run("--engines", FAKE_PIP_FAIL="1") == 1
    assert "could not make" in run.out and f"vllm-0.26.0-py{PYVER}.log" in run.out
    assert not (run.root / ".test-envs" / f"vllm-0.26.0-py{PYVER}" / ".recipe").exists()
    assert len(run.by_active("-m pytest")) == 1 and not run.by_envs("-m pytest")  # the core run still ran
    assert run.last_line() == "3 passed, 0 failed, 1 skipped"
    assert run("--engines") == 0, run.out
    assert len(run.by_active("-m venv")) == len(ENVS)


def test_extra_engine_envs_only_when_asked(run):
    assert EXTRA_ENVS and not set(EXTRA_ENVS) & set(ENVS)
    assert run("--engines") == 0, run.out
    assert not any(e in run.out for e in EXTRA_ENVS)
    assert run("--engines", FLASHMLA_BACKEND_EXTRA_ENGINES="1") == 0, run.out
    made = [c[-3] for c in run.by_active("-m venv")]
    assert [Path(m).name for m in made] == [f"{e}-py{PYVER}" for e in EXTRA_ENVS]  # the others are reused
    assert len(run.by_envs("-m pytest")) == len(ENVS) + len(EXTRA_ENVS)
    assert all(f"  {e}: 3 passed" in run.out for e in ENVS + EXTRA_ENVS)


def test_missing_pytest_is_reported_not_installed(run):
    assert run(FAKE_NO_PYTEST="1") == 2
    assert "pip install pytest numpy" in run.out
    assert not run.by_active("-m pip") and not run.by_active("-m pytest")


@pytest.mark.parametrize("args, env, message, closing", [
    ((), {"FAKE_core": "0 0 0 5"}, "collected no tests (exit code 5)", "0 passed, 0 failed, 0 skipped"),
    ((), {"FAKE_core": "0 0 4 0"}, "core: no test passed", "0 passed, 0 failed, 4 skipped"),
    ((), {"FAKE_core": "2 1 0 1"}, "core: pytest exited with 1", "2 passed, 1 failed, 0 skipped"),
    (("--engines",), {"FAKE_sglang": "0 0 1 0"}, "sglang-0.5.21: no test passed",
     f"{3 * (1 + len(VLLM_ENVS))} passed, 0 failed, {1 + len(VLLM_ENVS) + len(SGLANG_ENVS)} skipped"),
    (("--engines",), {"FAKE_vllm": "5 2 0 1"}, "vllm-0.26.0: pytest exited with 1",
     f"{5 * len(VLLM_ENVS) + 3 * (1 + len(SGLANG_ENVS))} passed, {2 * len(VLLM_ENVS)} failed, "
     f"{1 + len(SGLANG_ENVS)} skipped"),
])
def test_failures(run, args, env, message, closing):
    assert run(*args, **env) == 1
    assert message in run.out
    assert run.last_line() == closing


def test_an_installed_package_is_linked_alone_into_the_engine_envs(run, tmp_path):
    (run.root / "flashmla_backend" / "_C.stand-in.so").unlink()       # no in-place build
    site = tmp_path / "site"
    installed = _package(site)
    (site / "other_package").mkdir()
    assert run("--engines", PYTHONPATH=str(site)) == 0, run.out
    core, *engines = run.by_active("-m pytest") + run.by_envs("-m pytest")
    assert core[-2] == f"PYTHONPATH={site}"                           # the user's environment as it is
    linked = run.root / ".test-envs" / f"package-py{PYVER}"
    assert engines and all(c[-2] == f"PYTHONPATH={linked}" for c in engines)
    assert sorted(p.name for p in linked.iterdir()) == ["flashmla_backend"]
    assert (linked / "flashmla_backend").resolve() == installed.resolve()


def test_conftest_skips_engine_tests_with_how_to_run_them():
    env = dict(os.environ, FLASHMLA_BACKEND_SKIP_ENGINE_TESTS=" ".join(ENGINE_FILES))
    p = subprocess.run([sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider",
                        *(str(REPO / "tests" / f) for f in ENGINE_FILES)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 5, p.stdout + p.stderr  # pytest: nothing but skipped modules is "no tests collected"
    assert f"{len(ENGINE_FILES)} skipped" in p.stdout and "bash tests/run.sh --engines" in p.stdout
