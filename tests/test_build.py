"""The compiled module: present where it must be, torch-free, built for the right targets."""
import json
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
    if REQUIRE:  # CI's build is a default one: the kernels' own measurement switches compiled out (docs/build.md)
        assert C.measure_build() is False
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
    assert c["min_part_blocks"] == scheduler.MIN_PART_BLOCKS
    assert c["sparse_min_part_blocks"] == scheduler.SPARSE_MIN_PART_BLOCKS
    assert c["meta_ints"] == scheduler.META_INTS
    assert (c["head_dim_k"], c["head_dim_v"]) == (geometry.HEAD_DIM_K, geometry.HEAD_DIM_V)


# ---- The build's configuration (CMakeLists.txt), checked by configuring it: no compile ----------------------

def _cmake_tools():
    cmake = shutil.which("cmake")
    if not cmake:
        pytest.skip("cmake not installed (pip's build installs its own; these tests configure the build by hand)")
    return cmake, ("Ninja" if shutil.which("ninja") else "Unix Makefiles")


def _configure(tmp_path, name, **env_vars):
    """Configures CMakeLists.txt into tmp_path/name with these environment variables; returns the result."""
    cmake, generator = _cmake_tools()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHMLA_BACKEND_") and k != "MAX_JOBS"}
    env.update(env_vars)
    return subprocess.run([cmake, "-S", str(ROOT), "-B", str(tmp_path / name), "-G", generator,
                           f"-DPython_EXECUTABLE={sys.executable}"], env=env, capture_output=True, text=True)


def _needs_nvcc_and_pybind11():
    if not (shutil.which("nvcc") or os.environ.get("CUDA_HOME") or Path("/usr/local/cuda/bin/nvcc").exists()):
        pytest.skip("nvcc not installed: configuring the build needs it")
    pytest.importorskip("pybind11", reason="pybind11 (the test extra) not installed: configuring the build needs it")


@pytest.fixture
def fake_cutlass(tmp_path):
    """A CUTLASS include folder as the build checks it (cute/ and cutlass/); configuring reads no header."""
    inc = tmp_path / "cutlass-include"
    (inc / "cute").mkdir(parents=True)
    (inc / "cutlass").mkdir()
    return str(inc)


def _commands(build_dir: Path) -> dict[str, str]:
    """compile_commands.json of a configured build: {path from the repository root: command line}."""
    entries = json.loads((build_dir / "compile_commands.json").read_text())
    return {Path(e["file"]).resolve().relative_to(ROOT).as_posix(): e["command"] for e in entries}


def _spill_reported_only() -> set[str]:
    """The FLASHMLA_SM90_SPILL_REPORTED_ONLY list of CMakeLists.txt."""
    text = (ROOT / "CMakeLists.txt").read_text()
    body = re.search(r"^set\(FLASHMLA_SM90_SPILL_REPORTED_ONLY\b(.*?)\)", text, flags=re.M | re.S)
    assert body, "CMakeLists.txt has no FLASHMLA_SM90_SPILL_REPORTED_ONLY list"
    return set(body.group(1).split())


def test_build_without_nvcc_says_what_is_missing(tmp_path):
    res = _configure(tmp_path, "b", CUDA_HOME=str(tmp_path / "no-cuda-here"), CUDA_PATH="")
    assert res.returncode != 0
    text = " ".join((res.stdout + res.stderr).split())   # CMake wraps its messages
    assert "nvcc" in text and "CUDA toolkit" in text and "no-cuda-here" in text, text[-2000:]


def test_build_without_cutlass_says_what_is_missing(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    res = _configure(tmp_path, "b", FLASHMLA_BACKEND_CUTLASS_INCLUDE=str(empty))
    assert res.returncode != 0
    text = " ".join((res.stdout + res.stderr).split())
    assert "does not hold cute/ and cutlass/" in text, text[-2000:]


def test_build_refuses_unknown_targets(tmp_path, fake_cutlass):
    res = _configure(tmp_path, "b", FLASHMLA_BACKEND_CUTLASS_INCLUDE=fake_cutlass, FLASHMLA_BACKEND_CUDA_ARCHS="80;89")
    assert res.returncode != 0
    assert "supported targets: 80;90a" in " ".join((res.stdout + res.stderr).split())


def test_default_build_compiles_what_the_module_needs_with_the_spill_gate(tmp_path, fake_cutlass):
    """Default targets (80;90a): every unit's flags, read from the compile_commands.json the build writes."""
    _needs_nvcc_and_pybind11()
    res = _configure(tmp_path, "b", FLASHMLA_BACKEND_CUTLASS_INCLUDE=fake_cutlass, MAX_JOBS="3")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    cmds = _commands(tmp_path / "b")
    csrc = ROOT / "csrc"
    module_sources = {p.relative_to(ROOT).as_posix()
                      for p in [*csrc.glob("portable/**/*.cu"), *csrc.glob("sm90/**/*.cu"), *csrc.glob("smxx/*.cu")]
                      if "checks" not in p.relative_to(csrc).parts}
    module_sources.add("csrc/binding/module.cpp")
    assert set(cmds) == module_sources, "the module's sources: csrc/{portable,sm90}/**/*.cu, csrc/smxx/*.cu, the binding"
    assert not [f for f in cmds if "/checks/" in f], "files under checks/ are not part of the module"

    reported_only = _spill_reported_only()
    assert reported_only <= set(cmds), f"listed but not compiled: {sorted(reported_only - set(cmds))}"
    gate = "-Xptxas=--warn-on-spills,--warning-as-error"
    for f, cmd in cmds.items():
        args = cmd.split()
        assert "-fvisibility=hidden" in cmd and "-std=c++17" in args and "-O3" in args, (f, cmd)
        assert '-DFLASHMLA_BACKEND_ARCH_LIST="\\"80;90a\\""' in cmd, cmd   # the string _C.cuda_archs reports
        assert "-DFLASHMLA_BACKEND_WITH_SM90" in args, (f, cmd)
        codes = re.findall(r"--generate-code=arch=(compute_\w+),code=(\w+)", cmd)
        if f.startswith("csrc/sm90/"):
            assert codes == [("compute_90a", "sm_90a")], (f, cmd)
            ptxas = [a for a in args if a.startswith("-Xptxas")]
            assert ptxas == (["-Xptxas=--warn-on-spills"] if f in reported_only else [gate]), (f, ptxas)
        elif f.endswith(".cu"):
            assert codes == [("compute_80", "sm_80"), ("compute_80", "compute_80"), ("compute_90a", "sm_90a")], (f, cmd)
            assert "-Xptxas" not in cmd and "--expt-relaxed-constexpr" in args and "-lineinfo" in args, (f, cmd)
        else:  # the binding: the host compiler, no device code
            assert not codes and "-fPIC" in args, (f, cmd)

    ninja = tmp_path / "b" / "build.ninja"
    if ninja.exists():  # header dependencies (nvcc -MD depfiles) and MAX_JOBS as the compile pool
        text = ninja.read_text() + (tmp_path / "b" / "CMakeFiles" / "rules.ninja").read_text()
        assert text.count("pool = flashmla_compile") == len(cmds), "every compile runs in the MAX_JOBS pool"
        assert re.search(r"pool flashmla_compile\s+depth = 3", text), "MAX_JOBS=3 must cap the compiles"
        cuda_rule = re.search(r"rule CUDA_COMPILER__\S+\n(.*?)\n\n", text, flags=re.S).group(1)
        assert "deps = gcc" in cuda_rule and "-MD" in cuda_rule, cuda_rule


def test_targets_and_sm90_switch(tmp_path, fake_cutlass):
    """FLASHMLA_BACKEND_CUDA_ARCHS=80 and FLASHMLA_BACKEND_SM90_KERNEL=0 leave the sm90 units out."""
    _needs_nvcc_and_pybind11()
    for name, env in (("a80", {"FLASHMLA_BACKEND_CUDA_ARCHS": "80"}),
                      ("no90", {"FLASHMLA_BACKEND_SM90_KERNEL": "0", "FLASHMLA_BACKEND_NVCC_FLAGS": "-DX_ONE -DX_TWO"})):
        res = _configure(tmp_path, name, FLASHMLA_BACKEND_CUTLASS_INCLUDE=fake_cutlass, **env)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        cmds = _commands(tmp_path / name)
        assert cmds and not [f for f in cmds if f.startswith("csrc/sm90/")], sorted(cmds)
        assert not ["x" for c in cmds.values() if "-DFLASHMLA_BACKEND_WITH_SM90" in c.split()]
        portable = cmds["csrc/portable/dispatch.cu"]
        codes = re.findall(r"--generate-code=arch=(compute_\w+),code=(\w+)", portable)
        if name == "a80":
            assert codes == [("compute_80", "sm_80"), ("compute_80", "compute_80")], portable
        else:
            assert ("compute_90a", "sm_90a") in codes and "-DX_ONE -DX_TWO" in portable, portable
            assert "-DX_ONE" not in cmds["csrc/binding/module.cpp"], "the extra nvcc flags are for the .cu files"


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


def test_ops_sparse_path_sets_every_decode_field(monkeypatch):
    """The sparse path (ops._sparse_decode_cuda, params.h's sparse mapping) sets every ARG field too, nothing else,
    with the mapping's values: one row a query token, one KV head, the index rows and topk_length passed through."""
    import torch
    from flashmla_backend import FlashMLASchedMeta, geometry, ops, scheduler

    calls = []
    fake = types.SimpleNamespace(DecodeArgs=_RecordingArgs, mla_decode=calls.append)
    monkeypatch.setattr(ops._ext, "ext", lambda: fake)
    monkeypatch.setattr(ops.device, "sm_count", lambda dev: 132)
    monkeypatch.setattr(ops, "_raw_stream", lambda dev: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def fake_metadata(lengths, parts, min_part_blocks):
        assert min_part_blocks == scheduler.SPARSE_MIN_PART_BLOCKS
        return torch.zeros((parts, 8), dtype=torch.int32), torch.zeros((lengths.shape[0] + 1,), dtype=torch.int32)

    monkeypatch.setattr(ops, "_metadata_impl", fake_metadata)

    b, s_q, h_q, topk = 2, 3, 128, 100
    q = torch.zeros((b, s_q, h_q, geometry.HEAD_DIM_K), dtype=torch.bfloat16)
    k_cache = torch.zeros((4, geometry.PAGE_SIZE, 1, 656), dtype=torch.uint8)
    indices = torch.zeros((b, s_q, topk), dtype=torch.int32)
    topk_length = torch.tensor([100, 7], dtype=torch.int32)
    meta = FlashMLASchedMeta()
    config = meta.config_of(q, k_cache, False, True, topk)
    out, lse = ops._sparse_decode_cuda(q, k_cache, meta, config, 0.1, indices, topk_length, None)

    assert len(calls) == 1
    a = calls[0]
    args, derived = _param_fields()
    expected = {"kernel", *args}
    assert not (expected - set(a.set_names)), f"the sparse path does not set {sorted(expected - set(a.set_names))}"
    assert not (set(a.set_names) - expected), f"the sparse path sets unknown fields {sorted(set(a.set_names) - expected)}"
    assert (a.batch, a.seqlen_q, a.num_heads_q, a.num_heads_kv, a.sparse_seqlen_q) == (b * s_q, 1, h_q, 1, s_q)
    assert (a.indices, a.indices_stride, a.topk_length) == (indices.data_ptr(), topk, topk_length.data_ptr())
    # 6 rows of 2 blocks: 12 parts (scheduler.sparse_num_sm_parts: no more parts than blocks), one block each
    assert (a.num_kv_tokens, a.max_pages_per_seq, a.num_sm_parts) == (4 * geometry.PAGE_SIZE, 2, 12)
    assert meta.sparse_lengths.tolist() == [topk] * (b * s_q)  # the schedule does not depend on topk_length
    assert a.skip_combine is False and meta.sparse_split is True  # one-block pieces: rows are cut
    assert out.shape == (b, s_q, h_q, geometry.HEAD_DIM_V) and lse.shape == (b, h_q, s_q) and lse.is_contiguous()

    # s_q 1: the rows are the requests, a step of q's and indices' first strides (a size-1 dimension's stride can be
    # anything: here that of the tensors they were sliced from).
    q1, indices1 = q[:, :1], indices[:, :1]
    assert q1.stride(1) != q1.stride(0) and indices1.stride(1) != indices1.stride(0)
    meta1 = FlashMLASchedMeta()
    ops._sparse_decode_cuda(q1, k_cache, meta1, meta1.config_of(q1, k_cache, False, True, topk), 0.1, indices1, None,
                            None)
    a = calls[1]
    assert (a.batch, a.q_stride_b, a.q_pe_stride_b, a.indices_stride) == (b, q.stride(0), q.stride(0), indices.stride(0))
    assert (a.q, a.indices, a.topk_length) == (q.data_ptr(), indices.data_ptr(), 0)


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
        elif name == "kv_format":  # a byte: the codes of csrc/params.h's KvFormat (test_kv_formats_match_python)
            value = 3
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
    a.batch = 1
    a.kv_format = 9
    with pytest.raises(RuntimeError, match=r"kv_format must be a KvFormat code \(0 bf16, 1 fp16, 2 fp8_e4m3, 3 "
                                           r"fp8_ds_mla\), got 9"):
        C.mla_decode(a)
    with pytest.raises(RuntimeError, match=r"kv_format must be a KvFormat code .*got 300"):
        a.kv_format = 300
    a.kv_format = 1
    with pytest.raises(RuntimeError, match=r"a 16-bit KV cache is q's dtype: kv_format fp16 with dtype 0"):
        C.mla_decode(a)
    a.kv_format, a.q_fp8 = 0, True
    with pytest.raises(RuntimeError, match=r"q_fp8 needs kv_format fp8_e4m3"):
        C.mla_decode(a)
    a.q_fp8, a.skip_combine = False, True
    with pytest.raises(RuntimeError, match=r"skip_combine is for sparse decode \(indices\)"):
        C.mla_decode(a)


def test_kv_formats_match_python():
    """One identity of each KV format: the compiled module's names and codes (csrc/params.h: KvFormat) are
    flashmla_backend.kv_format's, and the formats each kernel reads (csrc/launch.h) are the kernel lists there."""
    _module_path()
    from flashmla_backend import kv_format
    C = _ext.ext()
    assert dict(C.kv_formats) == {f.name: f.code for f in kv_format.FORMATS}
    for kernel, reads in C.kernel_kv_formats.items():
        assert tuple(reads["dense"]) == tuple(f.name for f in kv_format.read_by(kernel)), kernel
        assert tuple(reads["sparse"]) == tuple(f.name for f in kv_format.read_by(kernel, sparse=True)), kernel
    named = {k for f in kv_format.FORMATS for k in f.dense_kernels + f.sparse_kernels}
    assert named <= set(C.kernel_kv_formats), "kv_format.py names a kernel the module does not report"
