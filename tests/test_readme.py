"""The README's Python API example runs as written on a machine without a GPU, and the repository's Markdown
links point at files that exist."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import flashmla_backend

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# What the example's own comments promise, checked after it ran (names are the example's variables).
CHECKS = """
assert device == "cpu", device
assert tuple(out.shape) == (b, s_q, h_q, 512) and out.dtype == torch.bfloat16, (out.shape, out.dtype)
assert tuple(lse.shape) == (b, h_q, s_q) and lse.dtype == torch.float32, (lse.shape, lse.dtype)
assert bool(torch.isfinite(out).all())
empty = cache_seqlens == 0                                  # a request without keys: out 0, lse +inf
assert bool((out[empty] == 0).all()) and bool(torch.isposinf(lse[empty]).all())
assert bool(torch.isfinite(lse[~empty]).all())
print("README example ok")
"""


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def api_example() -> str:
    """The Python block of the README's API section."""
    text = README.read_text()
    section = text.split("\n## API\n", 1)[1].split("\n## ", 1)[0]
    blocks = python_blocks(section)
    assert blocks, "the API section of README.md has no ```python block"
    return blocks[0]


FP8_CHECKS = """
assert device == "cpu", device
assert k_cache_fp8.dtype == q_fp8.dtype == torch.float8_e4m3fn and descale_k.dtype == torch.float32
assert tuple(out.shape) == tuple(out_fast.shape) == (b, s_q, h_q, 512), (out.shape, out_fast.shape)
assert out.dtype == q.dtype and out_fast.dtype == torch.bfloat16 and lse.dtype == lse_fast.dtype == torch.float32
ref, ref_lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, meta, num_splits,
                                      softmax_scale=scale, causal=True)   # the same call on the 16-bit cache
for got in (out, out_fast):                                              # e4m3 rounding: a few percent
    err = float((got.float() - ref.float()).norm() / ref.float().norm())
    assert 0 < err < 0.1, err
print("README FP8 example ok")
"""


def fp8_example() -> str:
    """The Python block of the README's FP8 KV cache subsection."""
    text = README.read_text()
    section = text.split("\n### FP8 KV cache\n", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    blocks = python_blocks(section)
    assert blocks, "the FP8 KV cache section of README.md has no ```python block"
    return blocks[0]


def run_on_cpu(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run in a fresh interpreter with no GPU visible, as a user without a GPU would."""
    script = tmp_path / "readme_example.py"
    script.write_text(code)
    package_parent = str(Path(flashmla_backend.__file__).resolve().parents[1])
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_api_example_is_the_flashmla_call():
    code = api_example()
    assert "get_mla_metadata(" in code and "flash_mla_with_kvcache(" in code
    assert 'device = "cuda" if torch.cuda.is_available() else "cpu"' in code


def test_api_example_runs_on_cpu(tmp_path):
    res = run_on_cpu(api_example() + CHECKS, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "README example ok" in res.stdout


def test_fp8_example_is_self_contained():
    """It defines its inputs, quantizes a cache and imports what it calls; the FP8 entry point by keyword."""
    code = fp8_example()
    assert "import torch" in code and "flash_mla_with_kvcache_fp8" in code.split("\n\n", 1)[0]
    assert "torch.float8_e4m3fn" in code and "descale_k=descale_k" in code and "descale_q=descale_q" in code


def test_fp8_example_runs_on_cpu(tmp_path):
    res = run_on_cpu(fp8_example() + FP8_CHECKS, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "README FP8 example ok" in res.stdout


def test_readme_errors_section_matches_the_fp8_api():
    """The FP8 cache is served by the API: the errors section must not say it raises NotImplementedError."""
    text = README.read_text()
    errors = text.split("\n### Errors and the checked mode\n", 1)[1].split("\n### ", 1)[0]
    assert "FP8 caches and sparse indices raise `NotImplementedError`" not in errors
    assert "descale_k" in errors and "FLASHMLA_BACKEND_CHECK=1" in errors


def test_license_matches_pyproject():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^license = "MIT"', pyproject, re.M)
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n") and "Copyright (c) 2026 The flashmla_backend authors" in text
    assert "[`LICENSE`](LICENSE)" in README.read_text()


def test_pyproject_classifiers():
    """What a package index shows: Python versions from requires-python on, OS, CUDA, topics, and the license as
    the SPDX expression alone (PEP 639 forbids "License ::" classifiers next to it)."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11 on")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    classifiers = project["classifiers"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    assert not [c for c in classifiers if c.startswith("License ::")]
    minimum = tuple(int(x) for x in re.fullmatch(r">=(\d+)\.(\d+)", project["requires-python"]).groups())
    matches = (re.fullmatch(r"Programming Language :: Python :: (\d+)\.(\d+)", c) for c in classifiers)
    versions = sorted(tuple(int(x) for x in m.groups()) for m in matches if m)
    assert versions and versions[0] == minimum
    assert versions == [(3, minor) for minor in range(minimum[1], versions[-1][1] + 1)], "a gap in the versions"
    for needed in ("Operating System :: POSIX :: Linux", "Environment :: GPU :: NVIDIA CUDA",
                   "Programming Language :: Python :: 3 :: Only",
                   "Topic :: Scientific/Engineering :: Artificial Intelligence"):
        assert needed in classifiers, needed
    try:
        from trove_classifiers import classifiers as known
    except ImportError:
        return
    assert not [c for c in classifiers if c not in known], "classifiers a package index would reject"
    assert classifiers == sorted(classifiers)


def test_readme_commands():
    text = README.read_text()
    assert "pip install -v \".[test]\" && (cd ~ && python -m flashmla_backend)" in text
    assert re.search(r"^bash tests/run\.sh(\s|$)", text, re.M) and re.search(r"^bash tests/run\.sh --engines", text, re.M)
    assert "python benchmarks/bench.py" in text and (ROOT / "benchmarks" / "bench.py").is_file()
    assert "flashmla_backend.bench" not in text          # the harness is not in the package


def markdown_files() -> list[Path]:
    files = [README, ROOT / "integration" / "README.md"]
    files += sorted((ROOT / "benchmarks").glob("*.md")) + sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if f.is_file()]


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(md):
    """Every relative link and image of the repository's user documents names a file in the checkout."""
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (md.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            missing.append(target)
    assert not missing, f"{md.relative_to(ROOT)} links to missing files: {missing}"
