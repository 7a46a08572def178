"""The compiled module: present where it must be, torch-free, built for the right targets."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashmla_backend import _ext

ROOT = Path(__file__).resolve().parent.parent
REQUIRE = os.environ.get("FLASHMLA_BACKEND_REQUIRE_EXT") == "1"  # .ci/run sets it: CI must have compiled it


def _module_path() -> Path:
    if not _ext.available():
        if REQUIRE:
            _ext.ext()  # raises with the reason
        pytest.skip("flashmla_backend._C not built (set FLASHMLA_BACKEND_REQUIRE_EXT=1 to make this an error)")
    return Path(_ext.ext().__file__)


def test_extension_loads_without_torch_libraries():
    path = _module_path()
    if not shutil.which("readelf"):
        pytest.skip("readelf not installed")
    dyn = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    needed = [line.split("[")[1].rstrip("]") for line in dyn.splitlines() if "(NEEDED)" in line]
    assert needed, dyn
    bad = [n for n in needed if n.startswith(("libtorch", "libc10", "libcudart"))]
    assert not bad, f"the module must not link libtorch/c10 or a shared libcudart; NEEDED: {needed}"
    syms = subprocess.run(["nm", "-D", "--undefined-only", str(path)], capture_output=True, text=True).stdout
    assert "_ZN3c10" not in syms and "_ZN2at" not in syms, "undefined torch symbols in the module"


def test_extension_targets():
    path = _module_path()
    C = _ext.ext()
    archs = C.cuda_archs.split(";")
    assert set(archs) <= {"80", "90a"} and archs
    assert C.cuda_runtime_version >= 12080
    assert C.portable_decode_smem_bytes() > 48 * 1024
    if REQUIRE and "90a" in archs:  # CI builds everything (FLASHMLA_BACKEND_SM90_KERNEL=0 leaves it out)
        assert C.sm90_compiled()
    if shutil.which("cuobjdump"):
        listing = subprocess.run(["cuobjdump", "--list-elf", str(path)], capture_output=True, text=True).stdout
        for arch in archs:
            assert f"sm_{arch}" in listing, f"no sm_{arch} code in {path.name}:\n{listing}"


def test_schedule_constants_match_python():
    _module_path()
    from flashmla_backend import scheduler, validate
    c = _ext.ext().schedule_constants
    assert c["page_size"] == scheduler.PAGE_SIZE == validate.PAGE_SIZE
    assert c["block_m"] == scheduler.BLOCK_M
    assert c["fixed_overhead_blocks"] == scheduler.FIXED_OVERHEAD_BLOCKS
    assert c["meta_ints"] == scheduler.META_INTS
    assert (c["head_dim_k"], c["head_dim_v"]) == (validate.HEAD_DIM_K, validate.HEAD_DIM_V)


def test_build_without_nvcc_says_what_is_missing(tmp_path):
    env = dict(os.environ, CUDA_HOME=str(tmp_path / "no-cuda-here"))
    env.pop("CUDA_PATH", None)
    res = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-temp", str(tmp_path / "b"),
                          "--build-lib", str(tmp_path / "l")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode != 0
    text = res.stdout + res.stderr
    assert "nvcc" in text and "CUDA toolkit" in text, text[-2000:]
