"""tests/run.sh, the test command, and noxfile.py, the engine conformance sessions it runs with --engines.

run.sh installs nothing into the active environment; with --engines it makes .test-envs/tools (nox and
uv, pinned) once with the active Python and runs one nox session per engine release; it fails when a run
fails, collects nothing or passes nothing, or when an environment cannot be made.

run.sh runs here on a copy of its checkout (tests/run.sh, noxfile.py, the requirement files, the engine
test files and a stand-in flashmla_backend) with a stand-in `python` first on PATH. The stand-in records
every call with its PYTHONPATH; it fakes `-m pip` (prints a resolver-style ERROR line, succeeds unless
FAKE_PIP_FAIL is set; installing nox puts a stand-in `nox` next to it), `-m venv` (a folder whose
bin/python is the stand-in again) and `-m pytest` (writes a JUnit report with the counts in FAKE_core:
"passed failed skipped exit-code"); everything else goes to the real interpreter. The stand-in `nox`
records its arguments and writes the report and pytest's exit code a session would (FAKE_vllm /
FAKE_sglang), or fails before pytest (FAKE_NOX_ENV_FAIL: the environment could not be made).

noxfile.py's sessions run here with a stand-in `nox` module and Session that record what the session
installs and runs. Nothing is downloaded; a few seconds in all.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENGINE_FILES = ("test_vllm_cpu.py", "test_vllm_dcp_cpu.py", "test_vllm_sparse_cpu.py", "test_sglang_cpu.py",
                "test_sglang_dcp_cpu.py", "test_sglang_sparse_cpu.py")
PYVER = "%d.%d" % sys.version_info[:2]


def _load_noxfile(nox_module: types.ModuleType | None = None, name: str = "noxfile_under_test",
                  path: Path = REPO / "noxfile.py"):
    """A noxfile.py as a module: without nox (nox_module None: `import nox` fails) or with a stand-in."""
    saved = {k: sys.modules.get(k) for k in ("nox", "nox.command")}
    sys.modules["nox"] = nox_module            # None: `import nox` raises ImportError
    sys.modules["nox.command"] = getattr(nox_module, "command", None)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


NOXFILE = _load_noxfile()
ENVS = [e.name for e in NOXFILE.ENGINES if not e.extra]
VLLM_ENVS = [e for e in ENVS if e.startswith("vllm-")]
SGLANG_ENVS = [e for e in ENVS if e.startswith("sglang-")]
EXTRA_ENVS = [e.name for e in NOXFILE.ENGINES if e.extra]
NOX_REQ, UV_REQ = (next(line.split("=", 1)[1].strip('"') for line in (REPO / "tests" / "run.sh").read_text().splitlines()
                        if line.startswith(var + "=")) for var in ("NOX_REQ", "UV_REQ"))

FAKE_PYTHON = r"""#!/usr/bin/env bash
me="$0"
{ printf '%s' "$me"; printf '\t%s' "$@"; printf '\tPYTHONPATH=%s\tSKIP=%s\n' "${PYTHONPATH-}" \
    "${FLASHMLA_BACKEND_SKIP_ENGINE_TESTS-}"; } >>"$FAKE_LOG"
if [ "${1-}" = -m ]; then
  case "${2-}" in
    pip)
      echo "ERROR: pip's dependency resolver does not currently take into account (stand-in)"
      [ -n "${FAKE_PIP_FAIL-}" ] && exit 1
      case " $* " in *" nox=="*) cp "$FAKE_NOX" "$(dirname "$me")/nox" ;; esac
      exit 0 ;;
    venv)
      dir="${@: -1}"; mkdir -p "$dir/bin"; cp "$me" "$dir/bin/python"; exit 0 ;;
    pytest)
      key=core
      var="FAKE_$key"; read -r p f s rc <<<"${!var:-3 0 1 0}"
      for a in "$@"; do case "$a" in --junitxml=*) xml="${a#--junitxml=}" ;; esac; done
      echo "<testsuites><testsuite errors=\"0\" failures=\"$f\" skipped=\"$s\" tests=\"$((p + f + s))\"/></testsuites>" >"$xml"
      echo "stand-in pytest ($key): $p passed"
      exit "$rc" ;;
  esac
fi
if [ "${1-}" = -c ] && [ "${2-}" = "import pytest, numpy" ] && [ -n "${FAKE_NO_PYTEST-}" ]; then exit 1; fi
exec "$FAKE_REAL_PYTHON" "$@"
"""

FAKE_NOX = r"""#!/usr/bin/env bash
{ printf '%s' "$0"; printf '\t%s' "$@"; printf '\tPYTHONPATH=%s\tENGINE_PYTHONPATH=%s\n' "${PYTHONPATH-unset}" \
    "${FLASHMLA_BACKEND_ENGINE_PYTHONPATH-}"; } >>"$FAKE_LOG"
session=
while [ $# -gt 0 ] && [ "$1" != -- ]; do [ "$1" = -s ] && session=$2; shift; done
case "$session" in *vllm*) key=vllm ;; *) key=sglang ;; esac
if [ -n "${FAKE_NOX_ENV_FAIL-}" ] && [[ "$session" == *"$FAKE_NOX_ENV_FAIL"* ]]; then
  echo "nox > Session $session failed: could not make its environment (stand-in)"; exit 1
fi
var="FAKE_$key"; read -r p f s rc <<<"${!var:-3 0 1 0}"
for a in "$@"; do case "$a" in --junitxml=*) xml="${a#--junitxml=}" ;; esac; done
echo "<testsuites><testsuite errors=\"0\" failures=\"$f\" skipped=\"$s\" tests=\"$((p + f + s))\"/></testsuites>" >"$xml"
echo "$rc" >"$FLASHMLA_BACKEND_PYTEST_RC"
echo "stand-in nox $session: $p passed"
exit $(( rc != 0 ))
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
    shutil.copy(REPO / "noxfile.py", root / "noxfile.py")
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
        self.tools = root / ".test-envs" / "tools"
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        for name in ("python", "python3"):
            (self.bin / name).write_text(FAKE_PYTHON)
            (self.bin / name).chmod(0o755)
        self.fake_nox = tmp_path / "fake-nox"
        self.fake_nox.write_text(FAKE_NOX)
        self.fake_nox.chmod(0o755)
        self.log = tmp_path / "calls.log"

    def __call__(self, *args: str, **env: str):
        self.log.write_text("")
        e = {k: v for k, v in os.environ.items()
             if not k.startswith(("FLASHMLA_BACKEND_", "PIP_", "FAKE_")) and k not in ("PYTHON", "PYTHONPATH")}
        e.update(PATH=f"{self.bin}{os.pathsep}{os.environ['PATH']}", FAKE_LOG=str(self.log),
                 FAKE_REAL_PYTHON=sys.executable, FAKE_NOX=str(self.fake_nox), **env)
        p = subprocess.run(["bash", str(self.root / "tests" / "run.sh"), *args], env=e, cwd=self.root,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
        self.out = p.stdout
        self.calls = [line.split("\t") for line in self.log.read_text().splitlines()]
        return p.returncode

    def by_active(self, what: str):
        """Calls of the active interpreter (not of a .test-envs one) whose arguments start so."""
        return [c for c in self.calls if ".test-envs" not in c[0] and " ".join(c[1:]).startswith(what)]

    def by_tools(self, what: str):
        return [c for c in self.calls if c[0] == str(self.tools / "bin" / "python") and " ".join(c[1:]).startswith(what)]

    def noxes(self):
        """The stand-in nox's calls: (session, its arguments, the environment it saw)."""
        out = []
        for c in self.calls:
            if c[0] == str(self.tools / "bin" / "nox"):
                out.append((c[c.index("-s") + 1], c[1:-2], dict(kv.split("=", 1) for kv in c[-2:])))
        return out

    def last_line(self) -> str:
        return self.out.rstrip("\n").splitlines()[-1]


@pytest.fixture
def run(tmp_path, checkout):
    return Run(tmp_path, checkout)


# ---- noxfile.py: the table and the pure functions ------------------------------------------------

def test_the_table_names_existing_files_and_unique_sessions():
    names = [e.name for e in NOXFILE.ENGINES]
    assert len(set(names)) == len(names) and ENVS and EXTRA_ENVS
    for e in NOXFILE.ENGINES:
        assert NOXFILE.session_name(e) == f"engines-{e.name}"
        assert (REPO / "tests" / e.requirements).is_file(), e
        assert e.files and all((REPO / "tests" / f).is_file() for f in e.files), e
        engine, version = e.name.rsplit("-", 1)
        assert f"{engine}=={version}" in e.nodeps  # the session's name is the release it installs
    assert sorted({f for e in NOXFILE.ENGINES for f in e.files}) == sorted(ENGINE_FILES)


def test_run_sh_reads_the_table_from_the_noxfile_without_nox():
    assert NOXFILE.nox is None  # loaded above with `import nox` failing
    out = subprocess.run([sys.executable, str(REPO / "noxfile.py"), "table"], capture_output=True, text=True,
                         check=True).stdout
    assert out.splitlines() == [f"{e.name} engines-{e.name} {','.join(e.files)} {int(e.extra)}"
                                for e in NOXFILE.ENGINES]
    text = (REPO / "tests" / "run.sh").read_text()
    assert "ENGINES=(" not in text and "vllm==" not in text and "requirements-" not in text  # not repeated


PIP_CONFIG = [
    ":env:.find-links='/opt/wheels'",
    "global.find-links='/other/wheels'",            # the environment variable wins, as in pip
    "global.extra-index-url='file:///a/simple file:///b/simple'",
    "global.constraint='/etc/pip/constraints.txt'",
    "global.cert='/etc/ssl/certs/ca.crt'",          # not a package source: not passed on
]


def test_uv_takes_pips_package_sources():
    assert NOXFILE.uv_settings_from_pip(PIP_CONFIG, {}) == {
        "UV_FIND_LINKS": "/opt/wheels",
        "UV_EXTRA_INDEX_URL": "file:///a/simple file:///b/simple",
        "UV_CONSTRAINT": "/etc/pip/constraints.txt",
        "UV_INDEX_STRATEGY": "unsafe-best-match",     # pip's choice across indexes
    }


def test_uv_settings_of_the_user_win_over_pips():
    got = NOXFILE.uv_settings_from_pip(PIP_CONFIG, {"UV_FIND_LINKS": "/mine", "UV_INDEX_STRATEGY": "first-index"})
    assert "UV_FIND_LINKS" not in got and "UV_INDEX_STRATEGY" not in got
    assert got["UV_CONSTRAINT"] == "/etc/pip/constraints.txt"


def test_uv_settings_from_an_unconfigured_pip():
    assert NOXFILE.uv_settings_from_pip([], {}) == {}
    assert NOXFILE.uv_settings_from_pip(["global.index-url='https://mirror/simple'", "garbage"], {}) == {
        "UV_INDEX_URL": "https://mirror/simple"}
    # several find-links locations: uv's variable separates them with commas
    assert NOXFILE.uv_settings_from_pip(["user.find-links='/a /b'"], {}) == {"UV_FIND_LINKS": "/a,/b"}


@pytest.mark.parametrize("uv", [True, False])
@pytest.mark.parametrize("index", ["", "https://example.invalid/whl/cpu"])
def test_install_steps(uv, index):
    vllm = next(e for e in NOXFILE.ENGINES if e.name == "vllm-0.26.0")
    (torch_label, torch), (engine_label, engine), (req_label, req) = NOXFILE.install_steps(vllm, uv, index)
    compile_ = ["--compile-bytecode"] if uv else []   # pip compiles .pyc files by itself, uv when asked
    assert torch[-2:] == ["torch==2.13.0", "pytest"]
    extra = ["--extra-index-url", index] if index else []
    if index and uv:   # uv's first-index default would take torch's helpers from the torch index only
        extra += ["--index-strategy", "unsafe-best-match"]
    assert torch[:-2] == compile_ + extra
    assert engine == [*compile_, "--no-deps", "vllm==0.26.0", "xgrammar==0.2.7"] and "(--no-deps)" in engine_label
    assert req == [*compile_, "-r", str(REPO / "tests" / "requirements-vllm-cpu.txt")]


def test_env_location_is_nox_naming():
    e = NOXFILE.ENGINES[0]
    assert NOXFILE.env_location(".test-envs", e) == Path(".test-envs") / "engines-vllm-0-26-0"
    assert {NOXFILE.env_location("d", e).name for e in NOXFILE.ENGINES} == {
        "engines-" + e.name.replace(".", "-") for e in NOXFILE.ENGINES}


def test_recipe_changes_with_what_the_environment_is_made_of(tmp_path, monkeypatch):
    monkeypatch.setattr(NOXFILE, "TESTS", tmp_path)
    e = NOXFILE.ENGINES[0]
    req = tmp_path / e.requirements
    req.write_text("regex\nnumpy  # a comment\n")
    base = NOXFILE.recipe(e, "3.11.7 /usr/bin/python3")
    assert base == NOXFILE.recipe(e, "3.11.7 /usr/bin/python3")
    req.write_text("# a header\nregex\n\nnumpy\n")            # comments and blank lines are not the recipe
    assert NOXFILE.recipe(e, "3.11.7 /usr/bin/python3") == base
    req.write_text("regex\nnumpy\nsix\n")
    changed = [NOXFILE.recipe(e, "3.11.7 /usr/bin/python3")]
    req.write_text("regex\nnumpy\n")
    changed += [NOXFILE.recipe(e, "3.12.1 /usr/bin/python3"),
                NOXFILE.recipe(e, "3.11.7 /usr/bin/python3", "https://example.invalid/cpu"),
                NOXFILE.recipe(e._replace(nodeps=("vllm==0.26.1", "xgrammar==0.2.7")), "3.11.7 /usr/bin/python3")]
    monkeypatch.setattr(NOXFILE, "RECIPE_VERSION", NOXFILE.RECIPE_VERSION + 1)
    changed.append(NOXFILE.recipe(e, "3.11.7 /usr/bin/python3"))
    monkeypatch.undo()
    assert len({base, *changed}) == 1 + len(changed)
    assert NOXFILE.is_current(tmp_path, base) is False       # no stamp
    (tmp_path / ".recipe").write_text(base)
    assert NOXFILE.is_current(tmp_path, base) and not NOXFILE.is_current(tmp_path, changed[0])


# ---- noxfile.py: the sessions, with a stand-in nox ------------------------------------------------

class CommandFailed(Exception):
    def __init__(self, reason=None, *, return_code=None):
        super().__init__(reason)
        self.return_code = return_code


class FakeSession:
    """What a nox.Session gives the noxfile's sessions; records installs and runs."""

    class Error(Exception):
        pass

    def __init__(self, location: Path, backend: str = "uv", posargs=(), pytest_rc: int = 0):
        self.virtualenv = types.SimpleNamespace(location=str(location))
        self.venv_backend = backend
        self.posargs = list(posargs)
        self.pytest_rc = pytest_rc
        self.calls = []
        self.messages = []

    def log(self, msg):
        self.messages.append(msg)

    def error(self, msg):
        raise self.Error(msg)

    def chdir(self, d):
        self.calls.append(("chdir", str(d)))

    def install(self, *args, env=None, stdout=None, **kw):
        assert stdout is not None and not stdout.closed   # the installers' output goes to the log
        self.calls.append(("install", list(args), dict(env or {})))

    def run_install(self, *args, env=None, **kw):
        self.calls.append(("run_install", list(args), dict(env or {})))

    def run(self, *args, env=None, **kw):
        self.calls.append(("run", list(args), dict(env or {})))
        if self.pytest_rc:
            raise CommandFailed(f"Returned code {self.pytest_rc}", return_code=self.pytest_rc)


@pytest.fixture
def sessions(tmp_path, monkeypatch):
    """load(): a copy of noxfile.py (and the requirement files) in tmp_path/checkout, loaded by a stand-in
    nox; returns the module and its sessions, {name: (function, reuse_venv)}."""
    root = tmp_path / "checkout"
    (root / "tests").mkdir(parents=True)
    shutil.copy(REPO / "noxfile.py", root / "noxfile.py")
    for f in (REPO / "tests").glob("requirements-*.txt"):
        shutil.copy(f, root / "tests" / f.name)
    nox = types.ModuleType("nox")
    nox.command = types.SimpleNamespace(CommandFailed=CommandFailed)
    nox.Session = FakeSession
    monkeypatch.delenv("FLASHMLA_BACKEND_TORCH_INDEX", raising=False)
    monkeypatch.delenv("FLASHMLA_BACKEND_ENGINE_PYTHONPATH", raising=False)
    monkeypatch.setenv("FLASHMLA_BACKEND_PYTEST_RC", str(tmp_path / "rc"))
    loads = []

    def load():
        registered = {}
        nox.options = types.SimpleNamespace()
        nox.session = lambda name, reuse_venv: lambda func: registered.setdefault(name, (func, reuse_venv))[0]
        loads.append(1)
        module = _load_noxfile(nox, name=f"noxfile_with_nox_{len(loads)}", path=root / "noxfile.py")
        assert module.ROOT == root
        return module, registered
    return load


def _location(module, engine_name: str) -> Path:
    engine = next(e for e in module.ENGINES if e.name == engine_name)
    return module.ROOT / module.env_location(module.ENVDIR, engine)


def test_noxfile_sessions_and_options(sessions):
    module, registered = sessions()
    assert list(registered) == [f"engines-{e.name}" for e in module.ENGINES]
    assert module.nox.options.sessions == [f"engines-{e}" for e in ENVS]         # the extra ones on request
    assert module.nox.options.default_venv_backend == "uv|venv"
    assert module.nox.options.reuse_venv == "yes" and module.nox.options.envdir == ".test-envs"


@pytest.mark.parametrize("backend", ["uv", "venv"])
def test_a_session_installs_once_then_reuses_and_remakes_on_a_new_recipe(sessions, tmp_path, backend):
    module, registered = sessions()
    engine = module.ENGINES[0]
    location = _location(module, engine.name)
    func, reuse = registered[f"engines-{engine.name}"]
    assert reuse is False                                    # no environment yet: nox makes one
    location.mkdir(parents=True)                             # as nox does before calling the session

    s = FakeSession(location, backend=backend, posargs=["-x"])
    func(s)
    installs = [c[1] for c in s.calls if c[0] == "install"]
    assert installs == [args for _, args in module.install_steps(engine, uv=backend == "uv")]
    assert all(c[2]["PYTHONPATH"] is None for c in s.calls if c[0] in ("install", "run_install"))
    (check,) = [c for c in s.calls if c[0] == "run_install"]
    assert check[1][:2] == ["python", "-c"] and check[1][3:] == list(engine.nodeps)
    assert (location / ".recipe").read_text() == module.recipe(engine, module.this_python())
    assert "==== tests/requirements-vllm-cpu.txt" in (location.parent / (location.name + ".log")).read_text()
    chdir, pytest_run = s.calls[-2:]
    assert chdir == ("chdir", str(module.TESTS))
    assert pytest_run[1] == ["python", "-m", "pytest", *engine.files, "-x"]
    assert pytest_run[2] == {"PYTHONPATH": str(module.ROOT), "PYTHONNOUSERSITE": "1"}
    assert (tmp_path / "rc").read_text() == "0\n"

    module, registered = sessions()                          # the next run: stamp current, reused as is
    func, reuse = registered[f"engines-{engine.name}"]
    assert reuse is True
    s = FakeSession(location)
    func(s)
    assert [c[0] for c in s.calls] == ["chdir", "run"]

    req = module.TESTS / engine.requirements
    req.write_text(req.read_text() + "# a comment is not part of the recipe\n")
    assert sessions()[1][f"engines-{engine.name}"][1] is True
    req.write_text(req.read_text() + "six\n")
    module, registered = sessions()
    func, reuse = registered[f"engines-{engine.name}"]
    assert reuse is False                                    # nox makes the environment anew
    s = FakeSession(location)
    func(s)
    assert [c[0] for c in s.calls].count("install") == 3
    assert "six" in module.requirement_lines(req)
    assert (location / ".recipe").read_text() == module.recipe(engine, module.this_python())
    assert all(reuse is False for name, (_, reuse) in registered.items() if name != f"engines-{engine.name}")


def test_a_changed_torch_index_remakes_the_environment(sessions, monkeypatch):
    module, registered = sessions()
    engine = module.ENGINES[1]
    location = _location(module, engine.name)
    location.mkdir(parents=True)
    (location / ".recipe").write_text(module.recipe(engine, module.this_python()))
    assert sessions()[1][f"engines-{engine.name}"][1] is True
    monkeypatch.setenv("FLASHMLA_BACKEND_TORCH_INDEX", "https://example.invalid/cpu")
    module, registered = sessions()
    func, reuse = registered[f"engines-{engine.name}"]
    assert reuse is False
    s = FakeSession(location)
    func(s)
    torch_step = [c[1] for c in s.calls if c[0] == "install"][0]
    assert torch_step[1:5] == ["--extra-index-url", "https://example.invalid/cpu", "--index-strategy", "unsafe-best-match"]


def test_a_reused_env_with_another_recipe_is_not_tested_in(sessions):
    """nox reused an environment elsewhere than the noxfile looked (your --envdir) whose stamp is not this
    recipe: the session stops rather than install over it or test in it."""
    module, registered = sessions()
    engine = module.ENGINES[0]
    _location(module, engine.name).mkdir(parents=True)
    (_location(module, engine.name) / ".recipe").write_text(module.recipe(engine, module.this_python()))
    func, reuse = sessions()[1][f"engines-{engine.name}"]
    assert reuse is True
    elsewhere = module.ROOT / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / ".recipe").write_text("recipe 0\n")
    s = FakeSession(elsewhere)
    with pytest.raises(FakeSession.Error, match="not made from this recipe"):
        func(s)
    assert not s.calls


@pytest.mark.parametrize("rc", [1, 5])
def test_a_session_reports_pytests_exit_code(sessions, tmp_path, rc):
    module, registered = sessions()
    engine = module.ENGINES[2]
    location = _location(module, engine.name)
    location.mkdir(parents=True)
    (location / ".recipe").write_text(module.recipe(engine, module.this_python()))
    func, _ = sessions()[1][f"engines-{engine.name}"]
    with pytest.raises(CommandFailed):   # nox then reports the session failed
        func(FakeSession(location, pytest_rc=rc))
    assert (tmp_path / "rc").read_text() == f"{rc}\n"


# ---- tests/run.sh ---------------------------------------------------------------------------------

def test_core_run_installs_nothing_and_skips_the_engine_tests(run):
    assert run("-k", "something") == 0, run.out
    assert not run.by_active("-m pip") and not run.by_active("-m venv"), run.calls
    (pytest_call,) = run.by_active("-m pytest")
    assert "-k" in pytest_call and "something" in pytest_call
    assert pytest_call[-1] == "SKIP=" + " ".join(ENGINE_FILES)  # tests/conftest.py skips these
    assert pytest_call[-2] == f"PYTHONPATH={run.root}"          # the in-place build
    assert "engine conformance tests not run" in run.out and "bash tests/run.sh --engines" in run.out
    assert run.last_line() == "3 passed, 0 failed, 1 skipped"
    assert not (run.root / ".test-envs").exists() and not run.noxes()


def test_engines_run_one_nox_session_each_with_tools_made_once(run):
    envs = run.root / ".test-envs"
    assert run("--engines", "-x") == 0, run.out
    assert not run.by_active("-m pip"), "pip ran on the active interpreter"
    (venv,) = run.by_active("-m venv")
    assert venv[-3] == str(run.tools)                               # made by the active Python
    (pip,) = run.by_tools("-m pip install")
    assert NOX_REQ in pip and UV_REQ in pip and "==" in NOX_REQ and "==" in UV_REQ   # pinned
    assert "dependency resolver" in (envs / "tools.log").read_text() and "ERROR" not in run.out
    assert (run.tools / ".recipe").exists() and (envs / ".gitignore").read_text() == "*\n"
    noxes = run.noxes()
    assert [n[0] for n in noxes] == [f"engines-{e}" for e in ENVS]
    for session, args, env in noxes:
        assert args[:4] == ["-f", str(run.root / "noxfile.py"), "-s", session]
        posargs = args[args.index("--") + 1:]
        assert posargs[0] == "-rs" and posargs[1].startswith("--junitxml=") and posargs[2:] == ["-x"]
        assert env == {"PYTHONPATH": "unset", "ENGINE_PYTHONPATH": str(run.root)}
        assert (envs / f"{session[len('engines-'):]}.nox.log").read_text().startswith("stand-in nox")
    (core,) = run.by_active("-m pytest")
    assert all(f"--ignore={f}" in core for f in ENGINE_FILES) and core[-1] == "SKIP="
    assert all(f"  {e}: 3 passed, 0 failed, 1 skipped" in run.out for e in ENVS)
    assert run.last_line() == f"{3 * (1 + len(ENVS))} passed, 0 failed, {1 + len(ENVS)} skipped"

    assert run("--engines") == 0, run.out
    assert not run.by_active("-m venv") and not run.by_tools("-m pip"), "the tools were made again"
    assert len(run.noxes()) == len(ENVS) and "[tools] using" in run.out

    text = (run.root / "tests" / "run.sh").read_text()                # a new nox pin: the tools again
    (run.root / "tests" / "run.sh").write_text(text.replace(f'NOX_REQ="{NOX_REQ}"', 'NOX_REQ="nox==0.0.1"'))
    assert run("--engines") == 0, run.out
    assert len(run.by_active("-m venv")) == 1 and "nox==0.0.1" in run.by_tools("-m pip install")[0]
    assert "recipe changed" in run.out


def test_environments_of_the_former_layout_are_named_not_used(run):
    former = run.root / ".test-envs" / f"vllm-0.26.0-py{PYVER}"
    former.mkdir(parents=True)
    (former / ".recipe").write_text("recipe 1\n")
    assert run("--engines") == 0, run.out
    assert run.out.count(f"rm -rf them to free their disk: {former}\n") == 1 and former.exists()
    (former / ".recipe").unlink()
    assert run("--engines") == 0 and "not used any more" not in run.out


def test_tools_that_cannot_be_made_fail_the_engines_and_are_made_again(run):
    assert run("--engines", FAKE_PIP_FAIL="1") == 1
    assert "could not make" in run.out and "tools.log" in run.out
    assert not (run.tools / ".recipe").exists() and not run.noxes()
    assert len(run.by_active("-m pytest")) == 1                        # the core run still ran
    assert all(f"  {e}: not run" in run.out for e in ENVS)
    assert run.last_line() == "3 passed, 0 failed, 1 skipped"
    assert run("--engines") == 0, run.out
    assert len(run.by_active("-m venv")) == 1


def test_an_engine_env_that_cannot_be_made_fails_the_run_and_the_others_still_run(run):
    assert run("--engines", FAKE_NOX_ENV_FAIL="vllm-0.33.0") == 1
    assert "vllm-0.33.0: not run (nox exited with 1 before pytest" in run.out
    assert "FAILED: vllm-0.33.0: environment could not be made" in run.out
    assert len(run.noxes()) == len(ENVS)
    assert run.last_line() == f"{3 * len(ENVS)} passed, 0 failed, {len(ENVS)} skipped"


def test_extra_engine_envs_only_when_asked(run):
    assert EXTRA_ENVS and not set(EXTRA_ENVS) & set(ENVS)
    assert run("--engines") == 0, run.out
    assert not any(e in run.out for e in EXTRA_ENVS)
    assert run("--engines", FLASHMLA_BACKEND_EXTRA_ENGINES="1") == 0, run.out
    assert [n[0] for n in run.noxes()] == [f"engines-{e}" for e in ENVS + EXTRA_ENVS]
    assert all(f"  {e}: 3 passed" in run.out for e in ENVS + EXTRA_ENVS)


def test_missing_pytest_is_reported_not_installed(run):
    assert run("--engines", FAKE_NO_PYTEST="1") == 2
    assert "pip install pytest numpy" in run.out
    assert not run.by_active("-m pip") and not run.by_active("-m pytest") and not run.noxes()


@pytest.mark.parametrize("args, env, message, closing", [
    ((), {"FAKE_core": "0 0 0 5"}, "collected no tests (exit code 5)", "0 passed, 0 failed, 0 skipped"),
    ((), {"FAKE_core": "0 0 4 0"}, "core: no test passed", "0 passed, 0 failed, 4 skipped"),
    ((), {"FAKE_core": "2 1 0 1"}, "core: pytest exited with 1", "2 passed, 1 failed, 0 skipped"),
    (("--engines",), {"FAKE_sglang": "0 0 1 0"}, "sglang-0.5.21: no test passed",
     f"{3 * (1 + len(VLLM_ENVS))} passed, 0 failed, {1 + len(VLLM_ENVS) + len(SGLANG_ENVS)} skipped"),
    (("--engines",), {"FAKE_sglang": "0 0 0 5"}, "sglang-0.5.23: pytest collected no tests (exit code 5)",
     f"{3 * (1 + len(VLLM_ENVS))} passed, 0 failed, {1 + len(VLLM_ENVS)} skipped"),
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
    (core,) = run.by_active("-m pytest")
    assert core[-2] == f"PYTHONPATH={site}"                           # the user's environment as it is
    linked = run.root / ".test-envs" / f"package-py{PYVER}"
    noxes = run.noxes()
    assert noxes and all(env == {"PYTHONPATH": "unset", "ENGINE_PYTHONPATH": str(linked)} for _, _, env in noxes)
    assert sorted(p.name for p in linked.iterdir()) == ["flashmla_backend"]
    assert (linked / "flashmla_backend").resolve() == installed.resolve()


def test_conftest_skips_engine_tests_with_how_to_run_them():
    env = dict(os.environ, FLASHMLA_BACKEND_SKIP_ENGINE_TESTS=" ".join(ENGINE_FILES))
    p = subprocess.run([sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider",
                        *(str(REPO / "tests" / f) for f in ENGINE_FILES)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 5, p.stdout + p.stderr  # pytest: nothing but skipped modules is "no tests collected"
    assert f"{len(ENGINE_FILES)} skipped" in p.stdout and "bash tests/run.sh --engines" in p.stdout
