"""The compiled module: present where it must be, torch-free, built for the right targets."""
import os
import re
import shutil
import subprocess
import sys
import types
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
    from flashmla_backend import geometry, scheduler
    c = _ext.ext().schedule_constants
    assert c["page_size"] == scheduler.PAGE_SIZE == geometry.PAGE_SIZE
    assert c["block_m"] == scheduler.BLOCK_M
    assert c["fixed_overhead_blocks"] == scheduler.FIXED_OVERHEAD_BLOCKS
    assert c["meta_ints"] == scheduler.META_INTS
    assert (c["head_dim_k"], c["head_dim_v"]) == (geometry.HEAD_DIM_K, geometry.HEAD_DIM_V)


def test_build_without_nvcc_says_what_is_missing(tmp_path):
    env = dict(os.environ, CUDA_HOME=str(tmp_path / "no-cuda-here"))
    env.pop("CUDA_PATH", None)
    res = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-temp", str(tmp_path / "b"),
                          "--build-lib", str(tmp_path / "l")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode != 0
    text = res.stdout + res.stderr
    assert "nvcc" in text and "CUDA toolkit" in text, text[-2000:]


# ---- The decode field list (csrc/params.h FMLA_DECODE_PARAMS) ------------------------------------------

def _param_fields() -> tuple[list[str], list[str]]:
    """(ARG names, DERIVED names) of the FMLA_DECODE_PARAMS list in csrc/params.h, in order."""
    lines = (ROOT / "csrc" / "params.h").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#define FMLA_DECODE_PARAMS("))
    body = []
    for line in lines[start + 1:]:
        body.append(line)
        if not line.rstrip().endswith("\\"):
            break
    text = re.sub(r"/\*.*?\*/", "", "\n".join(body), flags=re.S)
    entries = re.findall(r"\b(ARG|DERIVED)\(\s*([^,()]+?)\s*,\s*(\w+)\s*\)", text)
    assert entries, "no entries found in FMLA_DECODE_PARAMS"
    return [n for kind, _, n in entries if kind == "ARG"], [n for kind, _, n in entries if kind == "DERIVED"]


class _RecordingArgs:
    """Stands in for _C.DecodeArgs: records every attribute ops.py sets."""

    def __init__(self):
        object.__setattr__(self, "set_names", [])

    def __setattr__(self, name, value):
        self.set_names.append(name)
        object.__setattr__(self, name, value)


def test_field_list_parses():
    args, derived = _param_fields()
    assert {"q", "kv", "out", "o_accum", "stream", "pdl", "dtype"} <= set(args)
    assert set(derived) == {"ngroups", "q_rows", "num_m_blocks", "scale_log2"}
    assert len(set(args + derived)) == len(args) + len(derived), "a field is listed twice"


def test_ops_sets_every_decode_field(monkeypatch):
    """flashmla_backend/ops.py's CUDA path sets every ARG field of params.h (and the kernel name), nothing else.

    Runs on the CPU: the extension, the device queries and the layout check are replaced by stand-ins, and
    _decode_cuda is called with CPU tensors (it only allocates outputs and reads pointers and strides).
    """
    import torch
    from flashmla_backend import geometry, ops, validate

    calls = []
    fake = types.SimpleNamespace(DecodeArgs=_RecordingArgs, mla_decode=calls.append)
    monkeypatch.setattr(ops._ext, "ext", lambda: fake)
    monkeypatch.setattr(ops.device, "kernel_for", lambda dev: "portable")
    monkeypatch.setattr(ops.device, "device_props", lambda index: types.SimpleNamespace(major=9, minor=0))
    monkeypatch.setattr(ops, "_raw_stream", lambda dev: 0)
    monkeypatch.setattr(ops.validate, "check_kernel_layout", lambda q, k, q_pe=None: None)

    b, s_q, h_q, h_kv, pages, parts = 2, 1, 16, 1, 4, 3
    q = torch.zeros((b, s_q, h_q, geometry.HEAD_DIM_K), dtype=torch.bfloat16)
    k_cache = torch.zeros((pages, geometry.PAGE_SIZE, h_kv, geometry.HEAD_DIM_K), dtype=torch.bfloat16)
    block_table = torch.zeros((b, 2), dtype=torch.int32)
    seqlens = torch.full((b,), 10, dtype=torch.int32)
    meta = torch.zeros((parts, 8), dtype=torch.int32)
    num_splits = torch.zeros((b + 1,), dtype=torch.int32)
    shapes = validate.shapes_of(q, k_cache, block_table, meta)
    ops._decode_cuda(q, k_cache, block_table, seqlens, meta, num_splits, 0.1, True, shapes)

    assert len(calls) == 1
    set_names = calls[0].set_names
    args, derived = _param_fields()
    expected = {"kernel", *args}
    assert not (expected - set(set_names)), f"ops.py does not set {sorted(expected - set(set_names))}"
    assert not (set(set_names) - expected), f"ops.py sets unknown fields {sorted(set(set_names) - expected)}"
    assert not set(derived) & set(set_names), "derived fields are computed by the module, not set by Python"


def test_module_exports_the_field_list():
    _module_path()
    C = _ext.ext()
    args, derived = _param_fields()
    assert list(C.decode_fields) == ["kernel", *args]
    a = C.DecodeArgs()
    for name in derived:
        assert not hasattr(a, name), f"derived field {name} must not be settable from Python"


def test_every_decode_field_is_settable():
    _module_path()
    C = _ext.ext()
    a = C.DecodeArgs()
    assert a.kernel == "portable"
    for i, name in enumerate(C.decode_fields):
        old = getattr(a, name)
        if isinstance(old, str):
            value = "sm90"
        elif isinstance(old, bool):
            value = not old
        elif isinstance(old, float):
            value = 0.25 + i
        else:
            assert isinstance(old, int), (name, old)
            value = 16 * (i + 1)  # pointers are ints too; small enough for the int32 fields
        setattr(a, name, value)
        assert getattr(a, name) == value, name
    a.q = 0x7F12_3456_7890  # a pointer takes a full 64-bit address
    assert a.q == 0x7F12_3456_7890
    a.dtype = 1
    assert a.dtype == 1


def test_mla_decode_refuses_bad_arguments_before_any_launch():
    _module_path()
    C = _ext.ext()
    a = C.DecodeArgs()  # all zero: batch 0
    with pytest.raises(RuntimeError, match=r"batch must be >= 1"):
        C.mla_decode(a)
    a.batch, a.seqlen_q, a.num_heads_q, a.num_heads_kv, a.num_sm_parts, a.max_pages_per_seq = 1, 1, 16, 1, 1, 1
    a.dtype = 7
    with pytest.raises(RuntimeError, match=r"dtype must be 0 \(bf16\) or 1 \(fp16\), got 7"):
        C.mla_decode(a)
    a.dtype = 0
    a.num_heads_q = 24
    a.num_heads_kv = 16
    with pytest.raises(RuntimeError, match=r"num_heads_q must be a positive multiple of num_heads_kv"):
        C.mla_decode(a)
    a.num_heads_q, a.num_heads_kv = 16, 1
    a.batch = 70000
    with pytest.raises(RuntimeError, match=r"batch must be <= 65535"):
        C.mla_decode(a)
