import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/kit.py
ROOT = Path(__file__).resolve().parent.parent

# Engine conformance test files that tests/run.sh runs in their own environments (bash tests/run.sh
# --engines: the nox sessions of noxfile.py): its core run names them here, and they are skipped whatever this environment holds.
SKIP_ENGINE_TESTS = set(os.environ.get("FLASHMLA_BACKEND_SKIP_ENGINE_TESTS", "").split())
ENGINE_TESTS_REASON = ("engine conformance tests run in their own environments under .test-envs/: "
                       "bash tests/run.sh --engines")


class _EngineTestsElsewhere(pytest.File):
    def collect(self):
        pytest.skip(ENGINE_TESTS_REASON)


def pytest_pycollect_makemodule(module_path, parent):
    if module_path.name in SKIP_ENGINE_TESTS:
        return _EngineTestsElsewhere.from_parent(parent, path=module_path)
    return None


def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    import flashmla_backend

    ok, reason = flashmla_backend.is_supported()
    return None if ok else reason


def pytest_collection_modifyitems(config, items):
    reason = _gpu_reason() if any("gpu" in item.keywords for item in items) else None
    if reason:
        skip = pytest.mark.skip(reason=f"GPU test: {reason}")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


# Worst errors seen by GPU kernel comparisons, printed at the end of the run (and written to
# $FLASHMLA_BACKEND_ERROR_REPORT as JSON when set): the closing-note evidence of the test matrix.
ERRORS: dict[str, dict] = {}


@pytest.fixture
def record_errors():
    def record(kernel: str, figures: dict) -> None:
        worst = ERRORS.setdefault(kernel, {"cases": 0})
        worst["cases"] += 1
        for k, v in figures.items():
            worst[k] = max(worst.get(k, 0.0), v)
    return record


def unbuilt_notice() -> str | None:
    """What the run says once, at its end, when the package under test has no compiled module (else None)."""
    try:
        import flashmla_backend
        from flashmla_backend import _ext
    except ImportError:
        return None
    if _ext.available():
        return None
    folder = Path(flashmla_backend.__file__).resolve().parent
    if folder == ROOT / "flashmla_backend":
        how = ("build it in place with `cmake -S . -B build -G Ninja && cmake --build build` (needs nvcc, no GPU; docs/build.md) and run the tests "
               "again; to test an installed package instead, run `bash tests/run.sh` (the checkout's sources then do "
               "not shadow it)")
    else:
        how = "install the package with `pip install -v .` on a machine with nvcc (CUDA 12.8+, no GPU needed)"
    return (f"flashmla_backend._C is not built: {folder} has no compiled module, so every test of the compiled "
            f"module was skipped (only the pure-PyTorch parts ran). To run them, {how}.")


def pytest_terminal_summary(terminalreporter):
    notice = unbuilt_notice()
    if notice:
        terminalreporter.write_sep("!", "flashmla_backend: compiled module not built", red=True, bold=True)
        terminalreporter.write_line(notice, red=True, bold=True)
    if not ERRORS:
        return
    terminalreporter.section("flashmla_backend worst errors vs reference")
    for kernel, w in sorted(ERRORS.items()):
        terminalreporter.write_line(
            f"{kernel}: {w['cases']} comparisons; out rel-norm {w.get('out_rel_norm', 0):.2e}, "
            f"out max-rel {w.get('out_max_rel', 0):.2e}, lse rel {w.get('lse_rel', 0):.2e}")
    path = os.environ.get("FLASHMLA_BACKEND_ERROR_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(ERRORS, f, indent=2)
