"""Shared pieces of the GPU integration tests and the benchmark: environment, checkpoint, subprocesses.

Every engine run is a subprocess with a timeout, its output streamed to a log file under the run
directory (FLASHMLA_BACKEND_RUN_DIR, default /tmp/flashmla_backend_integration) and echoed with a
"[name]" prefix; a failed run prints its log's tail.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

INTEGRATION = Path(__file__).resolve().parent
REPO = INTEGRATION.parent
MODELS = INTEGRATION / "models"
RUN_DIR = Path(os.environ.get("FLASHMLA_BACKEND_RUN_DIR", "/tmp/flashmla_backend_integration"))
# Default time limit of one engine subprocess (seconds); FLASHMLA_BACKEND_RUN_TIMEOUT overrides it.
RUN_TIMEOUT_S = int(os.environ.get("FLASHMLA_BACKEND_RUN_TIMEOUT", "540"))
PLUGIN_ENTRY_POINT = "flashmla_backend = flashmla_backend.vllm:register"
# What our decode line in vLLM's log says when a DCP group has more than one rank (flashmla_backend/vllm/impl.py).
OUR_DCP_LOG_WORDS = "decode context parallelism (rank"
# The FP8 fast mode rounds P to e4m3 as FLASHMLA-FP8 does: the layer tests judge it by the relative norm of its error
# against the reference on the same e4m3 q, with the bound tests/fp8kit.py gives that mode (FAST_OUT;
# tests/test_bench_vllm_throughput.py checks that the two agree).
FAST_MODE_REL = 4e-2


class RunFailed(RuntimeError):
    pass


def plugin_visible_to_vllm(env: dict) -> bool:
    """Whether a Python started with `env` sees flashmla_backend's vllm.general_plugins entry point."""
    code = ("from importlib.metadata import entry_points as e; "
            "import sys; sys.exit(0 if any(p.name == 'flashmla_backend' for p in e(group='vllm.general_plugins')) else 1)")
    return subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


def entry_point_shim(folder: Path, engine: str, group: str, entry_point: str) -> Path:
    """Writes into `folder` a minimal dist-info declaring `entry_point` in `group` and returns `folder`:
    on sys.path / PYTHONPATH it makes an engine load the plugin of a checkout that is not pip-installed."""
    info = folder / f"flashmla_backend_{engine}_plugin-0.0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flashmla_backend_{engine}_plugin\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{entry_point}\n")
    return folder


def engine_env(extra: dict | None = None) -> dict:
    """Environment of every engine subprocess.

    VLLM_USE_FLASHINFER_SAMPLER=0 (FlashInfer is not installed on the test machines), HF_HUB_OFFLINE=1
    and TRANSFORMERS_OFFLINE=1 (no network). The repository is put on PYTHONPATH; if flashmla_backend
    is not pip-installed (a source checkout with the extension built in place), a directory with a
    minimal dist-info that declares the same entry point as pyproject.toml is added too, so that vLLM
    loads the plugin through its normal mechanism in every process (front end, engine core, workers).
    """
    env = dict(os.environ)
    env.update({"VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    if not plugin_visible_to_vllm(env):
        shim = entry_point_shim(RUN_DIR / "plugin-entry-point", "vllm", "vllm.general_plugins", PLUGIN_ENTRY_POINT)
        env["PYTHONPATH"] = os.pathsep.join([str(shim), env["PYTHONPATH"]])
        print(f"[harness] flashmla_backend is not installed: declaring its vLLM entry point from {shim}", flush=True)
    if extra:
        env.update(extra)
    return env


def run_logged(name: str, cmd: list[str], env: dict, timeout_s: int = RUN_TIMEOUT_S) -> str:
    """Runs cmd, streams its output to RUN_DIR/<name>.log and to stdout; returns the whole output.

    A watchdog kills the command's process group after timeout_s (also when it prints nothing)."""
    import threading

    RUN_DIR.mkdir(parents=True, exist_ok=True)
    log = RUN_DIR / f"{name}.log"
    print(f"\n[{name}] start (timeout {timeout_s} s): {' '.join(cmd)}", flush=True)
    t0 = time.time()
    lines: list[str] = []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(REPO), start_new_session=True)
    timed_out = threading.Event()

    def watchdog():
        timed_out.set()
        kill_group(proc)

    timer = threading.Timer(timeout_s, watchdog)
    timer.start()
    try:
        with open(log, "w") as f:
            assert proc.stdout is not None
            for line in proc.stdout:
                f.write(line)
                lines.append(line)
                print(f"[{name}] {line}", end="", flush=True)
        proc.wait()
    finally:
        timer.cancel()
        kill_group(proc)
    dt = time.time() - t0
    if timed_out.is_set():
        raise RunFailed(f"[{name}] timed out after {timeout_s} s; log: {log}\n" + "".join(lines[-60:]))
    if proc.returncode != 0:
        raise RunFailed(f"[{name}] exited {proc.returncode} after {dt:.0f} s; log: {log}\n" + "".join(lines[-80:]))
    print(f"[{name}] done in {dt:.0f} s (log: {log})", flush=True)
    return "".join(lines)


def kill_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM, then SIGKILL, the process group started for proc (start_new_session=True): also the
    engine-core and worker processes a finished or crashed vLLM front end may leave behind."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break  # the group is empty
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue
        time.sleep(1)  # let the group's other members exit on the first signal


def tiny_checkpoint(config: Path = MODELS / "tiny-deepseek-v3" / "config.json", mtp: bool = True) -> Path:
    """The random-weight checkpoint for `config` (built once, reused while config and script are unchanged)."""
    script = INTEGRATION / "make_tiny_checkpoint.py"
    stamp_src = config.read_bytes() + script.read_bytes() + (b"mtp" if mtp else b"")
    stamp = hashlib.sha256(stamp_src).hexdigest()[:16]
    out = Path(os.environ.get("FLASHMLA_BACKEND_CKPT_DIR", "/tmp/flashmla_backend_ckpt")) / (
        f"{config.parent.name}{'-mtp' if mtp else ''}-{stamp}")
    if not (out / "model.safetensors").exists():
        cmd = [sys.executable, str(script), "--config", str(config), "--out", str(out), "--check"]
        if mtp:
            cmd.append("--mtp")
        run_logged("make_tiny_checkpoint", cmd, engine_env(), timeout_s=600)
    return out


def write_json(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))
    return path


# ---- HTTP servers (vllm serve, sglang.launch_server) ------------------------------------------------

def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_json(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_healthy(proc: subprocess.Popen, base_url: str, timeout_s: float, what: str) -> float:
    """Polls base_url/health until it answers 200; returns the seconds it took. RuntimeError if the server
    process exits first or the time runs out."""
    t0 = time.time()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} while starting")
        if time.time() - t0 > timeout_s:
            raise RuntimeError(f"{what} not healthy after {timeout_s:.0f} s")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as r:
                if r.status == 200:
                    return time.time() - t0
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(2)
