"""The engine conformance environments: one nox session per engine release (tests/README.md, "--engines").

    bash tests/run.sh --engines                     # the way to run them: it brings nox and uv itself
    nox -s engines-vllm-0.26.0 -- -x               # one session, with a nox of your own (posargs go to pytest)

Each session is a virtualenv under .test-envs/ (git-ignored), made by uv where nox finds it (else venv and
pip) with the Python that runs nox, and reused while its recipe (`recipe()`) is unchanged: torch 2.13.0 (CPU
where the index has it), pytest, the engine with --no-deps, its requirement file from tests/. The session
then runs the release's CPU test files with pytest from tests/, flashmla_backend coming from PYTHONPATH
(this checkout, or what tests/run.sh puts in FLASHMLA_BACKEND_ENGINE_PYTHONPATH): nothing of it is
installed into the environment.

The table and the functions that build each session's recipe and install steps are plain Python, importable
without nox (tests/test_run_sh.py tests them; tests/run.sh reads the table with `python noxfile.py table`).

Environment: FLASHMLA_BACKEND_TORCH_INDEX (an extra index for torch, e.g.
https://download.pytorch.org/whl/cpu: the CPU build instead of the CUDA one with its NVIDIA wheels),
FLASHMLA_BACKEND_ENGINE_PYTHONPATH (where flashmla_backend comes from; default: this checkout),
FLASHMLA_BACKEND_PYTEST_RC (a file the session writes pytest's exit code to; tests/run.sh reads it).
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent
TESTS = ROOT / "tests"
ENVDIR = ".test-envs"
TORCH_REQ = "torch==2.13.0"
RECIPE_VERSION = 3  # raise when the way the environments are made changes: every one is made again


class Engine(NamedTuple):
    name: str                # the session is "engines-<name>"
    files: tuple[str, ...]   # test files in tests/
    nodeps: tuple[str, ...]  # installed with --no-deps
    requirements: str        # then: install -r tests/<requirements>
    extra: bool = False      # only with FLASHMLA_BACKEND_EXTRA_ENGINES=1 (tests/run.sh)


VLLM_FILES = ("test_vllm_cpu.py", "test_vllm_dcp_cpu.py", "test_vllm_sparse_cpu.py")
SGLANG_FILES = ("test_sglang_cpu.py", "test_sglang_dcp_cpu.py", "test_sglang_sparse_cpu.py")
# The engine conformance environments, one line each. extra=True: made and run only when asked
# (FLASHMLA_BACKEND_EXTRA_ENGINES=1 bash tests/run.sh --engines): older releases a plugin still supports,
# kept out of the default run for their time (tests/README.md).
ENGINES = [
    Engine("vllm-0.26.0",   VLLM_FILES,   ("vllm==0.26.0", "xgrammar==0.2.7"), "requirements-vllm-cpu.txt"),
    Engine("vllm-0.33.0",   VLLM_FILES,   ("vllm==0.33.0", "xgrammar==0.2.8"), "requirements-vllm-0.33-cpu.txt"),
    Engine("sglang-0.5.21", SGLANG_FILES, ("sglang==0.5.21",),                 "requirements-sglang-cpu.txt"),
    Engine("sglang-0.5.23", SGLANG_FILES, ("sglang==0.5.23",),                 "requirements-sglang-0.5.23-cpu.txt"),
    Engine("sglang-0.5.17", SGLANG_FILES, ("sglang==0.5.17",),                 "requirements-sglang-0.5.17-cpu.txt",
           extra=True),
]
# Why --no-deps: the engines' wheels pin a CUDA torch and CUDA-only packages the CPU tests do not need;
# the requirement files hold the rest (see their headers). xgrammar: all of its requirements are in
# vLLM's file except triton (1 GB, GPU-only); 0.2.7 with vLLM 0.26.0 because 0.2.8 needs apache-tvm-ffi
# 0.1.11 and vLLM 0.26.0 pins 0.1.10; vLLM 0.33.0 pins xgrammar 0.2.8 and apache-tvm-ffi 0.1.11.


def session_name(engine: Engine) -> str:
    return f"engines-{engine.name}"


def env_location(envdir: str | os.PathLike, engine: Engine) -> Path:
    """Where nox puts the session's virtualenv (nox's own naming: the session name, lower case, runs of
    anything but letters, digits, '_' and '-' made one '-')."""
    slug = re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "-", session_name(engine)).lower()).strip("-")
    return Path(envdir) / slug


def requirement_lines(path: Path) -> list[str]:
    """A requirement file's lines without comments and blank lines: what the recipe records."""
    lines = (re.sub(r"(^|\s+)#.*", "", line).strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def install_steps(engine: Engine, uv: bool, torch_index: str = "") -> list[tuple[str, list[str]]]:
    """The install commands of a session, in order, as (label, arguments of `pip install` / `uv pip
    install`). With an extra torch index, uv is told to pick the best version across the indexes, as pip
    does (uv's default takes every package the first index has only from that index); and uv compiles
    the .pyc files at install, as pip does."""
    index = ["--extra-index-url", torch_index] if torch_index else []
    if index and uv:
        index += ["--index-strategy", "unsafe-best-match"]
    # uv writes no .pyc files unless asked (pip does): without them every import compiles from source, and
    # with PYTHONDONTWRITEBYTECODE set it does so on every run (the vLLM runs took twice as long).
    compile_ = ["--compile-bytecode"] if uv else []
    return [
        (f"{TORCH_REQ} and pytest", [*compile_, *index, TORCH_REQ, "pytest"]),
        (f"{' '.join(engine.nodeps)} (--no-deps)", [*compile_, "--no-deps", *engine.nodeps]),
        (f"tests/{engine.requirements}", [*compile_, "-r", str(TESTS / engine.requirements)]),
    ]


def recipe(engine: Engine, python: str, torch_index: str = "") -> str:
    """What the environment is made of; stored as <env>/.recipe once it is complete. Any change (Python,
    torch and its index, the --no-deps packages, the requirement file's lines, RECIPE_VERSION) makes
    the session make its environment again."""
    req = hashlib.sha256("\n".join(requirement_lines(TESTS / engine.requirements)).encode()).hexdigest()
    return "\n".join([
        f"recipe {RECIPE_VERSION}",
        f"python {python}",
        f"torch {TORCH_REQ}" + (f" extra-index {torch_index}" if torch_index else ""),
        f"no-deps {' '.join(engine.nodeps)}",
        f"requirements {engine.requirements} {req}",
        "pytest pytest",
    ]) + "\n"


def this_python() -> str:
    """The Python the sessions are made with (the one running nox): version and base interpreter."""
    return f"{sys.version.split()[0]} {getattr(sys, '_base_executable', sys.executable)}"


def is_current(location: Path, wanted: str) -> bool:
    try:
        return (location / ".recipe").read_text() == wanted
    except OSError:
        return False


IMPORT_CHECK = """
import importlib, sys, torch, pytest
for spec in sys.argv[1:]:
    name = spec.split('==')[0]
    if name in ('vllm', 'sglang'):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:  # no environment holds torchvision (PyPI: CUDA builds only);
            if e.name != 'torchvision':   # the test files stand in for it (SGLang 0.5.17-0.5.20 import it)
                raise
            print(name, 'imports torchvision at import; the tests stand in for it')
print('imports OK with torch', torch.__version__)
"""

# Unset for every install: they would send packages elsewhere than the environment.
INSTALL_ENV = {"PYTHONPATH": None, "PIP_USER": None, "PIP_TARGET": None, "PIP_PREFIX": None}

# pip's settings that decide where packages come from, and uv's variables for the same (uv reads no pip.conf and
# no PIP_* variable). A machine whose pip is set up with a wheel folder, a mirror or constraints (this project's CI
# gets its CPU torch that way) must give uv the same, or uv would take torch's CUDA build from PyPI.
PIP_TO_UV = {"find-links": ("UV_FIND_LINKS", ","), "index-url": ("UV_INDEX_URL", " "),
             "extra-index-url": ("UV_EXTRA_INDEX_URL", " "), "constraint": ("UV_CONSTRAINT", " ")}
PIP_SCOPES = (":env:", "install", "site", "user", "global")   # the first scope that sets a key wins, as in pip


def uv_settings_from_pip(config_lines: list[str], environ: dict[str, str]) -> dict[str, str]:
    """uv variables for the package sources pip is configured with (`pip config list` lines, key='value'),
    skipping any uv variable already set in environ. With extra indexes uv is told to pick the best version
    across them, as pip does."""
    found: dict[str, dict[str, str]] = {}
    for line in config_lines:
        key, sep, value = line.partition("=")
        scope, dot, name = key.rpartition(".")
        if not sep or not dot or name not in PIP_TO_UV:
            continue
        found.setdefault(name, {})[scope] = value.strip().strip("'\"")
    out: dict[str, str] = {}
    for name, (var, joiner) in PIP_TO_UV.items():
        scopes = found.get(name, {})
        value = next((scopes[sc] for sc in PIP_SCOPES if sc in scopes), None)
        if value and var not in environ:
            out[var] = joiner.join(value.split())
    if "UV_EXTRA_INDEX_URL" in out and "UV_INDEX_STRATEGY" not in environ:
        out["UV_INDEX_STRATEGY"] = "unsafe-best-match"
    return out


def pip_config_lines() -> list[str]:
    """`pip config list` of the Python that runs nox (tests/run.sh's tools environment), [] where pip fails."""
    import subprocess

    try:
        res = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return res.stdout.splitlines() if res.returncode == 0 else []


def _main(argv: list[str]) -> int:
    """`python noxfile.py table`: one line per engine, "name session files extra" (tests/run.sh)."""
    if argv != ["table"]:
        print("usage: python noxfile.py table", file=sys.stderr)
        return 2
    for e in ENGINES:
        print(e.name, session_name(e), ",".join(e.files), int(e.extra))
    return 0


try:
    import nox
    import nox.command
except ImportError:   # imported by tests/run.sh or the tests without nox: the functions above suffice
    nox = None

if nox is not None:
    nox.options.envdir = ENVDIR
    nox.options.reuse_venv = "yes"
    nox.options.default_venv_backend = "uv|venv"   # venv and pip where uv is not there
    nox.options.sessions = [session_name(e) for e in ENGINES if not e.extra]

    def _make_session(engine: Engine):
        wanted = recipe(engine, this_python(), os.environ.get("FLASHMLA_BACKEND_TORCH_INDEX", ""))
        # nox reuses the environment only when its stamp records this recipe; otherwise it makes it anew.
        reuse = is_current(ROOT / env_location(ENVDIR, engine), wanted)

        def session(s: nox.Session) -> None:
            location = Path(s.virtualenv.location)
            log = location.with_name(location.name + ".log")
            if is_current(location, wanted):
                s.log(f"[{engine.name}] using {location} (recipe unchanged)")
            elif reuse:   # only with an --envdir or --reuse-venv=always of your own: do not guess
                s.error(f"{location} is not made from this recipe; run with --reuse-venv=no")
            else:
                _install(s, engine, location, log)
                (location / ".recipe").write_text(wanted)   # written last: marks the environment complete
            _pytest(s, engine)

        session.__name__ = session.__qualname__ = session_name(engine).replace("-", "_").replace(".", "_")
        session.__doc__ = f"{', '.join(engine.files)} with {', '.join(engine.nodeps)} (tests/{engine.requirements})"
        return nox.session(name=session_name(engine), reuse_venv=reuse)(session)

    def _install(s: nox.Session, engine: Engine, location: Path, log: Path) -> None:
        uv = s.venv_backend == "uv"
        steps = install_steps(engine, uv, os.environ.get("FLASHMLA_BACKEND_TORCH_INDEX", ""))
        env = dict(INSTALL_ENV)
        if uv:
            from_pip = uv_settings_from_pip(pip_config_lines(), dict(os.environ))
            env.update(from_pip)
            if from_pip:
                s.log(f"[{engine.name}] uv takes pip's package sources: "
                      + ", ".join(f"{k}={v}" for k, v in sorted(from_pip.items())))
        n = len(steps) + 1
        start = time.monotonic()
        times = []
        with open(log, "w") as out:
            s.log(f"[{engine.name}] making {location} ({'uv' if uv else 'venv, pip'}); "
                  f"the installers' output goes to {log}")
            for i, (label, args) in enumerate(steps, 1):
                s.log(f"[{engine.name}] {i}/{n} {label}")
                out.write(f"==== {label}: {'uv pip' if uv else 'pip'} install {' '.join(args)}\n")
                out.flush()
                t0 = time.monotonic()
                s.install(*args, env=env, stdout=out, silent=False, log=False)
                times.append(time.monotonic() - t0)
            s.log(f"[{engine.name}] {n}/{n} check: torch and the engine import")
            out.write("==== check: torch and the engine import\n")
            out.flush()
            s.run_install("python", "-c", IMPORT_CHECK, *engine.nodeps, env=env, stdout=out,
                          silent=False, log=False)
        s.log(f"[{engine.name}] ready in {time.monotonic() - start:.0f} s (steps: "
              + ", ".join(f"{t:.0f} s" for t in times) + ")")

    def _pytest(s: nox.Session, engine: Engine) -> None:
        pythonpath = os.environ.get("FLASHMLA_BACKEND_ENGINE_PYTHONPATH") or str(ROOT)
        rc_file = os.environ.get("FLASHMLA_BACKEND_PYTEST_RC")
        s.chdir(TESTS)   # as in the core run: node ids relative to tests/
        try:
            s.run("python", "-m", "pytest", *engine.files, *s.posargs,
                  env={"PYTHONPATH": pythonpath, "PYTHONNOUSERSITE": "1"})
        except nox.command.CommandFailed as e:
            if rc_file:
                Path(rc_file).write_text(f"{e.return_code if e.return_code is not None else 1}\n")
            raise
        if rc_file:
            Path(rc_file).write_text("0\n")

    for _engine in ENGINES:
        globals()[session_name(_engine)] = _make_session(_engine)

if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
