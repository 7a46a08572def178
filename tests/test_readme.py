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


def test_api_example_is_the_flashmla_call():
    code = api_example()
    assert "get_mla_metadata(" in code and "flash_mla_with_kvcache(" in code
    assert 'device = "cuda" if torch.cuda.is_available() else "cpu"' in code


def test_api_example_runs_on_cpu(tmp_path):
    """Run in a fresh interpreter with no GPU visible, as a user without a GPU would."""
    script = tmp_path / "readme_example.py"
    script.write_text(api_example() + CHECKS)
    package_parent = str(Path(flashmla_backend.__file__).resolve().parents[1])
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH")) if p))
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "README example ok" in res.stdout


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
