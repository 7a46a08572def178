"""`python -m pytest tests` from a checkout without a build says so once, loudly, with how to build in place."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADING = "flashmla_backend: compiled module not built"


def _checkout_copy(tmp_path: Path) -> Path:
    """The package's sources without any compiled module, this conftest and one test that needs the module."""
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "flashmla_backend", root / "flashmla_backend",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    (root / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", root / "tests" / "conftest.py")
    (root / "tests" / "test_needs_module.py").write_text(
        "import pytest\n"
        "from flashmla_backend import _ext\n\n"
        "def test_pure_python():\n    assert True\n\n"
        "def test_compiled():\n"
        "    if not _ext.available():\n        pytest.skip('needs the compiled module')\n")
    return root


def test_unbuilt_checkout_says_so_once(tmp_path):
    root = _checkout_copy(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-m", "pytest", "tests", "-p", "no:cacheprovider"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert out.count(HEADING) == 1, out
    assert out.count("flashmla_backend._C is not built") == 1, out
    assert f"{root / 'flashmla_backend'} has no compiled module" in out
    assert "`cmake -S . -B build -G Ninja && cmake --build build`" in out and "bash tests/run.sh" in out


def test_no_notice_with_the_module(monkeypatch):
    import conftest
    from flashmla_backend import _ext

    monkeypatch.setattr(_ext, "available", lambda: True)
    assert conftest.unbuilt_notice() is None
    monkeypatch.setattr(_ext, "available", lambda: False)
    assert "is not built" in conftest.unbuilt_notice()
