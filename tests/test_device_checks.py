"""The standalone check programs of the sm90 kernel, run as tests.

- csrc/sm90/decode/checks/protocol_model.py: pure-Python model of the KV load / mbarrier protocol (CPU).
- csrc/sm90/decode_fp8/checks/protocol_model.py: the FP8 tensor-core kernel's producer / consumer barriers under
  random interleavings: no deadlock, no missed phase, no parity wait passing early, no stage, V^T or P buffer
  overwritten while read (CPU).
- csrc/common/checks/error_text_check.cu: the text of a failed host check (common/check.h) for each kind of value
  the checks print (needs nvcc, no GPU).
- csrc/sm90/decode/checks/layout_check.cu: host-only check of the kernel's hand-written index formulas against
  the CuTe layouts (needs nvcc and the CUTLASS headers, no GPU).
- csrc/sm90/decode_fp8/checks/layout_check.cu: the same for the FP8 tensor-core kernel (layout.h), with a host
  replay of its V transposition against the P fragment's key order (needs nvcc and the CUTLASS headers, no GPU).
- csrc/sm90/sparse_fp8/checks/layout_check.cu: the sparse kernel's gather of fp8_ds_mla tokens (sparse_fp8/layout.h)
  against the e4m3 and bf16 wgmma tile layouts, with a host replay of a gathered block (nvcc and CUTLASS, no GPU).
- csrc/sm90/sparse_fp8/checks/block_probe.cu: the sparse kernel's two products of a gathered block against fp64
  (sparse_fp8/qk.cuh: group-scaled e4m3 Q K^T and the bf16 rope; sparse_fp8/pv.cuh: P s[t, g] on e4m3 P V over the
  transposed latent tiles), with one and two e4m3 terms, and the two-term P V over a top-k of 32 blocks in one
  accumulator and in one a block (compiled on the CPU; run on a GPU).
- csrc/sm90/sparse_fp8/checks/gather_probe.cu: the sparse kernel's gather (sparse_fp8/gather.cuh) as a two-stage
  pipeline, every chunk of every block and its entry mask checked (skipped, out-of-cache and unused entries read as
  zeros; compiled on the CPU; run on a GPU).
- csrc/sm90/sparse_fp8/checks/gather_rate_probe.cu: how fast one SM gathers fp8_ds_mla tokens alone, the kernel's
  cp.async gather against the bulk copy engine (a token a lane), with 1..4 stages; the last block of every SM checked
  byte for byte (compiled on the CPU; run on a GPU).
- csrc/sm90/sparse_fp8/checks/wgmma_issue_probe.cu: how long a warpgroup takes to issue a batch of e4m3 wgmma and
  until it completes, for m64nNk32 with N 64, 128 and 256, by one warpgroup and by two at once (compiled on the CPU;
  run on a GPU).
- csrc/sm90/sparse_fp8/checks/attention_probe.cu: the sparse kernel's arithmetic end to end in one warpgroup (gather,
  group-scaled Q K^T, masks, online softmax, two-term P V under group factors that only go down, out and lse) against
  fp64 attention on the dequantized tokens, rows with no token included (compiled on the CPU; run on a GPU).
- tests/device_checks/mbarrier_chain.cu: the mbarrier chain that orders the FP8 kernel's writes of a V buffer slot by
  different producer warps (through the consumers' full / empty barriers), for racecheck's verdict on it (GPU).
- tests/device_checks/mbarrier_arrivals.cu: the sparse kernel's mbarrier hand-off whose phase several warps complete
  (each writes its part and arrives once), against one whose phase one warp completes, for racecheck's verdict on
  each (compiled on the CPU; run on a GPU).
- tests/device_checks/named_barrier_war.cu: the named-barrier hand-off of the kernel's row-state exchange in
  isolation (compiled on the CPU; run on a GPU).
- tests/device_checks/row_sum_handoff.cu: the epilogue's row-sum exchange (publish_row_sums / final_row_stats)
  in isolation, one mode per suspect of its racecheck reports: __syncthreads, the FP8 kernel's non-aligned consumer
  barrier, PDL, named-barrier hand-offs nearby, and a real race as control (compiled on the CPU; run on a GPU).
"""
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ROOT / "csrc" / "sm90" / "decode" / "checks"
PROTOCOL_MODEL = CHECKS / "protocol_model.py"
FP8_PROTOCOL_MODEL = ROOT / "csrc" / "sm90" / "decode_fp8" / "checks" / "protocol_model.py"
LAYOUT_CHECK = CHECKS / "layout_check.cu"
FP8_LAYOUT_CHECK = ROOT / "csrc" / "sm90" / "decode_fp8" / "checks" / "layout_check.cu"
NAMED_BARRIER_WAR = ROOT / "tests" / "device_checks" / "named_barrier_war.cu"
MBARRIER_CHAIN = ROOT / "tests" / "device_checks" / "mbarrier_chain.cu"
MBARRIER_ARRIVALS = ROOT / "tests" / "device_checks" / "mbarrier_arrivals.cu"
ROW_SUM_HANDOFF = ROOT / "tests" / "device_checks" / "row_sum_handoff.cu"
SPARSE_BLOCK_PROBE = ROOT / "csrc" / "sm90" / "sparse_fp8" / "checks" / "block_probe.cu"
SPARSE_GATHER_PROBE = ROOT / "csrc" / "sm90" / "sparse_fp8" / "checks" / "gather_probe.cu"
SPARSE_GATHER_RATE_PROBE = ROOT / "csrc" / "sm90" / "sparse_fp8" / "checks" / "gather_rate_probe.cu"
SPARSE_WGMMA_ISSUE_PROBE = ROOT / "csrc" / "sm90" / "sparse_fp8" / "checks" / "wgmma_issue_probe.cu"
SPARSE_ATTENTION_PROBE = ROOT / "csrc" / "sm90" / "sparse_fp8" / "checks" / "attention_probe.cu"
FP8_VREGS_PROBE = ROOT / "csrc" / "sm90" / "decode_fp8" / "checks" / "vregs_probe.cu"
SPARSE_PROTOCOL_MODEL = ROOT / "csrc" / "sm90" / "sparse_fp8" / "checks" / "protocol_model.py"


# ---- protocol model ---------------------------------------------------------------------------------------------
def _load_script(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _assert_script_says_consistent(path: Path) -> None:
    res = subprocess.run([sys.executable, str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "consistent" in res.stdout


@pytest.fixture(scope="module")
def model():
    return _load_script(PROTOCOL_MODEL, "protocol_model")


def test_protocol_model_accepts_the_kernel_schedule():
    _assert_script_says_consistent(PROTOCOL_MODEL)


def test_protocol_model_reads_the_refill_masks_of_config_h(model):
    masks = model.read_refill_masks()
    assert set(masks) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for stage in (0, 1):  # every piece of a stage is refilled by exactly one warpgroup
        assert masks[(stage, 0)] | masks[(stage, 1)] == (1 << model.NUM_PIECES) - 1
        assert masks[(stage, 0)] & masks[(stage, 1)] == 0


def _drop_tail(steps):
    def mutated(nblk):
        return steps(nblk)[:-1] if nblk % 2 == 1 and nblk > 1 else steps(nblk)
    return mutated


def _one_step_for_three(steps):
    def mutated(nblk):  # the last three blocks in one step that claims a next block of stage 1
        out = steps(nblk)
        if nblk - out[-1][3] == 1 and len(out) > 1 and out[-2][1] and not out[-2][2]:
            out = out[:-2] + [(True, True, True, out[-2][3])]
        return out
    return mutated


@pytest.mark.parametrize("mutation", ["piece 8 of stage 0 never refilled", "piece 0 of stage 1 refilled twice",
                                      "tail step dropped", "wrong step specialization"])
def test_protocol_model_rejects_a_broken_schedule(model, mutation):
    refill, steps = dict(model.read_refill_masks()), model.steps
    if mutation == "piece 8 of stage 0 never refilled":
        refill[(0, 1)] &= ~(1 << 8)
    elif mutation == "piece 0 of stage 1 refilled twice":
        refill[(1, 1)] |= 1
    elif mutation == "tail step dropped":
        steps = _drop_tail(steps)
    else:
        steps = _one_step_for_three(steps)
    with pytest.raises(model.ProtocolError):
        for nblk in range(12):
            model.run([nblk, 3, nblk], refill, steps)


def test_protocol_model_rejects_a_changed_config_h(model, tmp_path):
    text = (CHECKS.parent / "config.h").read_text()
    assert "{0x10Fu, 0x0F0u}" in text, "update this test to the refill masks of config.h"
    config = tmp_path / "config.h"
    config.write_text(text.replace("{0x10Fu, 0x0F0u}", "{0x00Fu, 0x0F0u}"))  # stage 1's piece 8 never refilled
    with pytest.raises(model.ProtocolError):
        model.run([5], model.read_refill_masks(config))


# ---- protocol model of the FP8 tensor-core kernel (producer warpgroup + consumers) -------------------------------
@pytest.fixture(scope="module")
def fp8_model():
    return _load_script(FP8_PROTOCOL_MODEL, "fp8_protocol_model")


def test_fp8_protocol_model_accepts_the_kernel_schedule():
    _assert_script_says_consistent(FP8_PROTOCOL_MODEL)


def test_fp8_protocol_model_reads_launch_cuh_and_traits_h(fp8_model):
    variants = fp8_model.read_variants()
    assert set(variants) == {"kFastE4m3Q", "kFastE4m3QStream", "kFastE4m3QCluster", "kFastE4m3QMulticast",
                             "kAccurateBF16", "kAccurateFP16",
                             "kAccurateStackedBF16", "kAccurateStackedBF16Left2",
                             "kAccurateStackedFP16", "kAccurateStackedFP16Left2", "kAccurateStackedP2BF16",
                             "kAccurateStackedP2FP16"}
    assert variants["kFastE4m3Q"] == (1, 2, 2, 4, False) and variants["kFastE4m3QStream"] == (1, 3, 2, 2, False)
    assert variants["kFastE4m3QMulticast"] == (1, 3, 2, 2, False)
    assert variants["kAccurateStackedP2BF16"] == (2, 3, 2, 2, False) == variants["kAccurateStackedP2FP16"]
    assert variants["kAccurateBF16"] == (2, 2, 1, 1, True) == variants["kAccurateFP16"]
    assert variants["kAccurateStackedBF16"] == (2, 3, 1, 1, True) == variants["kAccurateStackedFP16"]
    assert variants["kAccurateStackedBF16Left2"] == (2, 2, 2, 1, True) == variants["kAccurateStackedFP16Left2"]
    assert all(stages >= 2 and left >= 1 and right >= 1 for _, stages, left, right, _ in variants.values())
    assert fp8_model.vt_empty_copies(3, 2, 2) == 2 and fp8_model.vt_empty_copies(2, 2, 4) == 1
    arrivals = fp8_model.read_arrivals()
    assert arrivals["kNumVPairs"] == 4 and arrivals["kKvEmptyArrivals"] == 4 + arrivals["kNumVPairs"]
    assert arrivals["kVtFullArrivals"] == 2 and arrivals["kVtEmptyArrivals"] == 4


def test_fp8_protocol_model_refuses_a_variant_it_cannot_read(fp8_model, tmp_path):
    """A VariantTraits whose Traits arguments the model's pattern does not take is an error, not a variant left out
    of the check."""
    launch = tmp_path / "launch.cuh"
    launch.write_text(fp8_model.LAUNCH_CUH.read_text().replace(
        "Traits<cutlass::bfloat16_t, 2, 3, 1, 1, 224, 56, false, true, true>",
        "Traits<cutlass::bfloat16_t, 2, 3, 1, 1, 224, 56, false, true, true, 7>"))
    with pytest.raises(fp8_model.ProtocolError, match="kAccurateStackedBF16"):
        fp8_model.read_variants(launch)


def test_fp8_protocol_model_refuses_a_specialization_written_otherwise(fp8_model, tmp_path):
    """A VariantTraits written in a way the model's pattern does not read (here a comment after the brace) is an error
    too, not a variant silently left out of the check."""
    launch = tmp_path / "launch.cuh"
    text = fp8_model.LAUNCH_CUH.read_text()
    assert "struct VariantTraits<Variant::kAccurateBF16> {\n" in text
    launch.write_text(text.replace("struct VariantTraits<Variant::kAccurateBF16> {\n",
                                   "struct VariantTraits<Variant::kAccurateBF16> {  // a note\n"))
    with pytest.raises(fp8_model.ProtocolError, match="kAccurateBF16"):
        fp8_model.read_variants(launch)


@pytest.mark.parametrize("mutation", ["copy ignores kv_empty", "transposer ignores vt_empty",
                                      "transposer does not release the stage", "early vt_empty"])
def test_fp8_protocol_model_rejects_a_broken_schedule(fp8_model, mutation):
    with pytest.raises(fp8_model.ProtocolError):
        for seed in range(40):
            for stages, rings in ((2, (2, 4)), (2, (2, 2)), (3, (2, 3))):
                fp8_model.run([9, 4, 7], stages, rings, seed=seed, mutation=mutation)


def test_fp8_protocol_model_rejects_p0_rewritten_before_it_was_read(fp8_model):
    with pytest.raises(fp8_model.ProtocolError, match="p"):
        for seed in range(200):
            fp8_model.run([9, 4, 7], 2, (1, 1), seed=seed, mutation="p0 rewritten early", f16pv=True,
                          starve="wg1")


def test_fp8_protocol_model_reads_the_cluster_variants(fp8_model):
    """The 2-CTA cluster plan that shares the fast mode's V transposition, which run_cluster plays as two CTAs."""
    assert fp8_model.read_cluster_variants() == {"kFastE4m3QCluster": (2, 3, 3)}


def test_fp8_protocol_model_refuses_a_shared_widening(fp8_model, tmp_path):
    """A kShareVt variant with fp16 P V is an error for the model, which plays only the shared transposition."""
    launch = tmp_path / "launch.cuh"
    launch.write_text(fp8_model.LAUNCH_CUH.read_text() + (
        "template <>\nstruct VariantTraits<Variant::kX> {\n"
        "  using type = Traits<cutlass::bfloat16_t, 2, 2, 1, 1, 224, 56, true, true>;\n};\n"))
    with pytest.raises(fp8_model.ProtocolError, match="kPvF16"):
        fp8_model.read_cluster_variants(launch)


def test_fp8_protocol_model_rejects_a_broken_cluster_schedule(fp8_model):
    """A pair that does not wait for the peer's release of the slot's copy."""
    with pytest.raises(fp8_model.ProtocolError):
        for seed in range(60):
            for reqs in ([9, 4, 7], [12, 4]):
                fp8_model.run_cluster(reqs, 2, (3, 3), seed=seed, mutation="no peer_empty",
                                      starve=[None, "dma0", "wg0@0", "transposer1.0"][seed % 4])


def test_fp8_protocol_model_reads_the_vregs_tile(fp8_model):
    """The V-in-registers tile's variants (TraitsVR in launch.cuh) and its kv_empty count (vregs.h: every consumer
    warp)."""
    assert fp8_model.read_vregs_variants() == {"kAccurateVRegsBF16": 3, "kAccurateVRegsFP16": 3, "kFastVRegs": 4}
    assert fp8_model.read_vregs_kv_empty_arrivals() == 8


@pytest.mark.parametrize("mutation", ["vregs p0 rewritten early", "vregs early kv_empty", "vregs scale0 read late",
                                      "copy ignores kv_empty"])
def test_fp8_protocol_model_rejects_a_broken_vregs_schedule(fp8_model, mutation):
    """P0 rewritten before warpgroup 1's P0 V completed (no kP0Free), a warp releasing the stage before its V reads,
    warpgroup 1 reading scale0 after it published scale1 (warpgroup 0 may then rewrite it), the copy not waiting."""
    with pytest.raises(fp8_model.ProtocolError):
        for seed in range(300):
            for reqs in ([9, 4, 7], [6, 5]):
                fp8_model.run(reqs, 3, (1, 1), seed=seed, mutation=mutation, vregs=True,
                              starve=[None, "copy", "wg0", "wg1"][seed % 4])


def test_fp8_protocol_model_catches_a_parity_wait_two_phases_ahead(fp8_model, monkeypatch):
    # One vt_empty barrier a slot, as before kVtEmptyCopies: the 3-stage plan with rings of 2, and the rings of one
    # of the fp16 P V mode, let a transposer warp wait for a release while the one before it is still pending.
    monkeypatch.setattr(fp8_model, "vt_empty_copies", lambda stages, left, right: 1)
    for stages, rings, f16pv in ((3, (2, 2), False), (2, (1, 1), True)):
        with pytest.raises(fp8_model.ProtocolError, match="parity wait would pass"):
            for seed in range(200):
                fp8_model.run([9, 4, 7, 5], stages, rings, seed=seed, f16pv=f16pv)


# ---- the sparse kernel's protocol model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sparse_model():
    return _load_script(SPARSE_PROTOCOL_MODEL, "sparse_protocol_model")


# The roles starved in turn over the seeds of a mutation test (None: none).
SPARSE_STARVED = [None, "gather0", "wg0", "wg1", "transposer0", "transposer1"]


def test_sparse_protocol_model_accepts_the_kernel_schedule():
    _assert_script_says_consistent(SPARSE_PROTOCOL_MODEL)


@pytest.mark.parametrize("mutation", ["transposer ignores vt_empty", "row sums read early",
                                      "factors read before vt_full", "half 0 released before its P V",
                                      "half 1 read before vt_full", "pairs read after their half's release",
                                      "p slot rewritten early", "first q half read before it was written"])
def test_sparse_protocol_model_rejects_a_broken_schedule(sparse_model, mutation):
    with pytest.raises(sparse_model.ProtocolError):
        for seed in range(60):
            sparse_model.run([5, 2, 7], seed=seed, mutation=mutation,
                             starve=SPARSE_STARVED[seed % len(SPARSE_STARVED)])


def test_sparse_protocol_model_rejects_a_missing_qk_issued_arrival(sparse_model):
    # qk_issued (lead.cuh) without warpgroup 0's arrival at a row piece's last block: warpgroup 1 waits forever
    with pytest.raises(sparse_model.ProtocolError, match="deadlock"):
        for seed in range(60):
            sparse_model.run([5, 2, 7], seed=seed, mutation="qk_issued missing at a row piece's last block")


def test_sparse_protocol_model_accepts_one_qk_issued_barrier_with_one_v_t_half_0_slot(sparse_model):
    # lead.cuh's claim: qk_issued is two barriers by turns so that a ring of V^T half 0 slots would not break its
    # parity wait; with today's one slot warpgroup 0 cannot get two blocks ahead, and one barrier holds too
    for seed in range(60):
        sparse_model.run([5, 2, 7], seed=seed, mutation="one qk_issued barrier",
                         starve=SPARSE_STARVED[seed % len(SPARSE_STARVED)])


def test_sparse_protocol_model_rejects_wrong_arrival_counts(sparse_model):
    real = sparse_model.read_counts()
    # vt_empty - 4: one arrival a warp and half, as when each half had one reader warpgroup.
    for name, delta in (("lead_empty", -1), ("p_slot", -1), ("p_slot", 1), ("vt_full", -1), ("full", -1),
                        ("vt_empty", -1), ("vt_empty", -4), ("qk_issued", -1), ("qk_issued", 1)):
        counts = dict(real)
        counts[name] = real[name] + delta
        with pytest.raises(sparse_model.ProtocolError):
            for seed in range(60):
                sparse_model.run([5, 2, 7], counts, seed=seed)


@pytest.mark.parametrize("name, count", [
    ("kVtEmptyArrivals", 8),  # the count of the full-block buffers: a half slot would never be released
    ("kVtFullArrivals", 1),   # a half would count as written after one of its two piece pairs
    ("kKvEmptyArrivals", 7),  # one arrival per transposer warp instead of per pair
])
def test_fp8_protocol_model_rejects_wrong_arrival_counts(fp8_model, name, count):
    arrivals = dict(fp8_model.read_arrivals())
    arrivals[name] = count
    with pytest.raises(fp8_model.ProtocolError):
        for seed in range(40):
            fp8_model.run([9, 4, 7], 2, (2, 4), arrivals=arrivals, seed=seed)


# ---- CUDA check programs ----------------------------------------------------------------------------------------
def _nvcc() -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var) and (Path(os.environ[var]) / "bin" / "nvcc").exists():
            return str(Path(os.environ[var]) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _cutlass_include() -> str | None:
    env = os.environ.get("FLASHMLA_BACKEND_CUTLASS_INCLUDE")
    if env:
        return env
    try:
        import cutlass_library
    except ImportError:
        return None
    path = Path(cutlass_library.__file__).resolve().parent / "source" / "include"
    return str(path) if (path / "cute").is_dir() else None


def _missing(nvcc: str | None, cutlass: str | None) -> str | None:
    """The skip reason of the layout check: only what is missing, or None when both are there."""
    missing = []
    if nvcc is None:
        missing.append("nvcc (CUDA toolkit: nvcc on PATH, or CUDA_HOME)")
    if cutlass is None:
        missing.append("the CUTLASS headers (pip install nvidia-cutlass==4.2.0.0, or FLASHMLA_BACKEND_CUTLASS_INCLUDE)")
    return "needs " + " and ".join(missing) if missing else None


def test_layout_check_skip_names_only_what_is_missing():
    assert _missing("/usr/bin/nvcc", "/inc") is None
    only_cutlass = _missing("/usr/bin/nvcc", None)
    assert only_cutlass.startswith("needs the CUTLASS headers") and "nvcc" not in only_cutlass
    only_nvcc = _missing(None, "/inc")
    assert only_nvcc.startswith("needs nvcc") and "CUTLASS" not in only_nvcc
    assert "nvcc" in _missing(None, None) and "CUTLASS" in _missing(None, None)


def _compile(args: list[str], what: str) -> None:
    res = subprocess.run(args, capture_output=True, text=True)
    assert res.returncode == 0, f"{what} does not compile:\n{' '.join(args)}\n{res.stdout}{res.stderr[-4000:]}"


def _run_layout_check(csrc: Path, check: str, exe: Path) -> subprocess.CompletedProcess:
    """Compiles the host-only check program `check` (a path under csrc) against the tree `csrc` and runs it;
    skips with what is missing when nvcc or the CUTLASS headers are not there."""
    nvcc, cutlass = _nvcc(), _cutlass_include()
    reason = _missing(nvcc, cutlass)
    if reason:
        pytest.skip(reason)
    _compile([nvcc, "-std=c++17", "--expt-relaxed-constexpr", f"-I{csrc}", f"-I{cutlass}", str(csrc / check),
              "-o", str(exe)], check)
    return subprocess.run([str(exe)], capture_output=True, text=True)


def _edited_csrc(tmp_path: Path, edit: tuple[str, str, str]) -> Path:
    """A copy of csrc/ with one exact-match edit (path under csrc, old text, new text) applied."""
    csrc = tmp_path / "csrc"
    shutil.copytree(ROOT / "csrc", csrc)
    path, old, new = edit
    source = csrc / path
    text = source.read_text()
    assert old in text, f"update this test to {path}"
    source.write_text(text.replace(old, new, 1))
    return csrc


FP8_CHECK = str(FP8_LAYOUT_CHECK.relative_to(ROOT / "csrc"))
SPARSE_CHECK = "sm90/sparse_fp8/checks/layout_check.cu"


def test_layout_check_compiles_and_agrees(tmp_path):
    res = _run_layout_check(ROOT / "csrc", str(LAYOUT_CHECK.relative_to(ROOT / "csrc")), tmp_path / "layout_check")
    assert res.returncode == 0 and "all layouts agree" in res.stdout, res.stdout + res.stderr


def test_fp8_layout_check_compiles_and_agrees(tmp_path):
    res = _run_layout_check(ROOT / "csrc", FP8_CHECK, tmp_path / "fp8_layout_check")
    assert res.returncode == 0 and "all layouts agree" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("edit", [
    ("sm90/decode_fp8/layout.h", "+ (i & 1) + 4 * (i >> 1);", "+ i;"),     # P bytes in plain key order
    ("sm90/decode_fp8/layout.h", "(lane >> 1) & 3,", "(lane >> 2) & 3,"),  # the ldmatrix row swizzle
    # the stmatrix rows in natural column order (2-way bank conflicts, and V^T rows the epilogue does not expect)
    ("sm90/decode_fp8/layout.h", "8 * (mm & 1) + (lane & 7)", "2 * (lane & 7) + (mm & 1)"),
    ("sm90/decode/epilogue.cuh", "4 * (k & 1) + (k >> 1)", "k"),           # the epilogue's column map
])
def test_fp8_layout_check_rejects_a_changed_formula(tmp_path, edit):
    res = _run_layout_check(_edited_csrc(tmp_path, edit), FP8_CHECK, tmp_path / "fp8_layout_check")
    assert res.returncode != 0 and "MISMATCH" in res.stdout, res.stdout + res.stderr


def test_sparse_layout_check_compiles_and_agrees(tmp_path):
    res = _run_layout_check(ROOT / "csrc", SPARSE_CHECK, tmp_path / "sparse_layout_check")
    assert res.returncode == 0 and "all layouts agree (sparse gather)" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("edit", [
    ("sm90/sparse_fp8/layout.h", "((chunk ^ (row & 7)) << 4)", "((chunk ^ (row & 3)) << 4)"),  # the rope swizzle
    ("sm90/sparse_fp8/layout.h", "kScalesAt + row * kChunkBytes", "kScalesAt + (row ^ 1) * kChunkBytes"),  # scales
    ("sm90/sparse_fp8/layout.h", "constexpr int kRopeChunk0 = 33;", "constexpr int kRopeChunk0 = 34;"),  # token bytes
])
def test_sparse_layout_check_rejects_a_changed_formula(tmp_path, edit):
    res = _run_layout_check(_edited_csrc(tmp_path, edit), SPARSE_CHECK, tmp_path / "sparse_layout_check")
    assert res.returncode != 0, res.stdout + res.stderr


def _build_sparse_probe(tmp_path: Path, source: Path) -> Path:
    """A GPU probe (csrc/sm90/sparse_fp8/checks/, csrc/sm90/decode_fp8/checks/vregs_probe.cu) built against the CUTLASS
    headers; skipped without them."""
    nvcc, cutlass = _nvcc(), _cutlass_include()
    reason = _missing(nvcc, cutlass)
    if reason:
        pytest.skip(reason)
    exe = tmp_path / source.stem
    _compile([nvcc, "-std=c++17", "-arch=sm_90a", "--expt-relaxed-constexpr", f"-I{ROOT / 'csrc'}", f"-I{cutlass}",
              str(source), "-o", str(exe)], str(source.relative_to(ROOT)))
    return exe


def _run_sparse_probe(tmp_path: Path, source: Path, timeout: int) -> subprocess.CompletedProcess:
    """Builds and runs a sparse-kernel probe on the GPU, its output printed; skipped where the GPU is not sm_90."""
    res = subprocess.run([str(_build_sparse_probe(tmp_path, source))], capture_output=True, text=True,
                         timeout=timeout)
    print(res.stdout, end="")
    if res.returncode == 2 and "needs an sm_90 GPU" in res.stdout:
        pytest.skip(res.stdout.strip())
    return res


def _ptxas_report(tmp_path: Path, source: Path, defines: tuple[str, ...] = ()) -> tuple[str, list[str], list[int]]:
    """Compiles one translation unit for sm_90a with ptxas's report (skips without nvcc or CUTLASS; fails naming the
    defines if it does not compile): (ptxas's stderr, its wgmma serialization notes C7510-C7515, the spill stores
    in bytes of each entry function)."""
    nvcc, cutlass = _nvcc(), _cutlass_include()
    reason = _missing(nvcc, cutlass)
    if reason:
        pytest.skip(reason)
    args = [nvcc, "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-DNDEBUG", *(f"-D{d}" for d in defines),
            "--generate-code=arch=compute_90a,code=sm_90a", "-Xptxas=-v", f"-I{ROOT / 'csrc'}", f"-I{cutlass}", "-c",
            str(source), "-o", str(tmp_path / "ptxas_report.o")]
    res = subprocess.run(args, capture_output=True, text=True)
    with_defines = "".join(f" -D{d}" for d in defines)
    assert res.returncode == 0, f"{source.name}{with_defines} does not compile:\n{res.stderr[-4000:]}"
    notes = [line for line in res.stderr.splitlines() if re.search(r"\(C751[0-5]\)", line)]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", res.stderr)]
    return res.stderr, notes, spills


def test_sparse_kernel_wgmma_is_not_serialized(tmp_path):
    """The sparse kernel's translation unit compiles for sm_90a without ptxas's wgmma serialization notes
    (C7510-C7515: ptxas 13 prints them as infos, which --warning-as-error does not catch) and with no more spills than
    the 8 bytes CMakeLists.txt accounts for (one register of warpgroup 0 stored and reloaded a block). A run-time branch
    around a wgmma (a measurement switch that skipped P V) once serialized every wgmma of the kernel."""
    stderr, notes, spills = _ptxas_report(tmp_path, ROOT / "csrc" / "sm90" / "sparse_fp8" / "sparse.cu")
    assert not notes, "ptxas serializes wgmma in the sparse kernel:\n" + "\n".join(notes)
    assert stderr.count("Compiling entry function") == 1, "one kernel is instantiated"
    assert spills and all(n <= 8 for n in spills), "the sparse kernel spills more:\n" + stderr[-2000:]


@pytest.mark.parametrize("define", ["FMLA_SPARSE_TIMELINE=1"])
def test_sparse_build_switches_keep_wgmma_unserialized(tmp_path, define):
    """The sparse kernel's build switches (docs/build.md) compile without ptxas's wgmma serialization notes, so that a
    build with one times the kernel as it runs: the timeline recorder (csrc/sm90/sparse_fp8/timeline.cuh; its first
    form printed with device printf, a call that serialized every wgmma, C7510)."""
    _, notes, _ = _ptxas_report(tmp_path, ROOT / "csrc" / "sm90" / "sparse_fp8" / "sparse.cu", (define,))
    assert not notes, f"ptxas serializes wgmma with -D{define}:\n" + "\n".join(notes)


def test_sparse_block_probe_compiles(tmp_path):
    _build_sparse_probe(tmp_path, SPARSE_BLOCK_PROBE)


@pytest.mark.gpu
def test_sparse_block_probe_matches_fp64_on_the_gpu(tmp_path):
    res = _run_sparse_probe(tmp_path, SPARSE_BLOCK_PROBE, timeout=120)
    errors = {(m.group(1), m.group(2), int(m.group(3))): float(m.group(4))
              for m in re.finditer(r"(qk|pv) case (\S+) terms (\d): rel-norm error (\S+)", res.stdout)}
    assert set(errors) == {(k, c, t) for k in ("qk", "pv") for c in ("one-scale", "spread-scales") for t in (1, 2)}, \
        res.stdout + res.stderr
    chain = {(m.group(1), m.group(2)): float(m.group(3))
             for m in re.finditer(r"pv-chain case (\S+) terms 2 accumulator (piece|block): rel-norm error (\S+)",
                                  res.stdout)}
    assert set(chain) == {(c, a) for c in ("one-scale", "spread-scales") for a in ("piece", "block")}, \
        res.stdout + res.stderr
    lengths = {(m.group(1), int(m.group(2)), m.group(3)): float(m.group(4))
               for m in re.finditer(r"pv-chain-length case (\S+) blocks (\d+) accumulator (piece|block): rel-norm "
                                    r"error (\S+)", res.stdout)}
    assert set(lengths) == {(c, n, a) for c in ("one-scale", "spread-scales") for n in (8, 16, 64, 128)
                            for a in ("piece", "block")}, res.stdout + res.stderr
    print("\n".join(line for line in res.stdout.splitlines() if line.startswith("pv-chain")))
    assert res.returncode == 0 and "block probe: ok" in res.stdout, res.stdout + res.stderr


def test_sparse_gather_probe_compiles(tmp_path):
    _build_sparse_probe(tmp_path, SPARSE_GATHER_PROBE)


@pytest.mark.gpu
def test_sparse_gather_probe_reads_every_chunk_right_on_the_gpu(tmp_path):
    res = _run_sparse_probe(tmp_path, SPARSE_GATHER_PROBE, timeout=120)
    cases = re.findall(r"gather case (\S+): (\d+) blocks, (\d+) wrong chunks, (\d+) wrong masks", res.stdout)
    assert {c[0] for c in cases} == {"all-used", "cut-mid-block", "cut-at-block", "none-used", "one-block"}, \
        res.stdout + res.stderr
    assert all(c[2] == "0" and c[3] == "0" for c in cases), res.stdout
    assert res.returncode == 0 and "gather probe: ok" in res.stdout, res.stdout + res.stderr


def test_sparse_gather_rate_probe_compiles(tmp_path):
    _build_sparse_probe(tmp_path, SPARSE_GATHER_RATE_PROBE)


@pytest.mark.gpu
def test_sparse_gather_rate_probe_lands_every_byte_on_the_gpu(tmp_path):
    res = _run_sparse_probe(tmp_path, SPARSE_GATHER_RATE_PROBE, timeout=300)
    rows = re.findall(r"\| (cp\.async|bulk|bulk2) \| (\d) \| ([\d.]+) \| ([\d.]+) \| (\d+) \|", res.stdout)
    assert {(r[0], r[1]) for r in rows} == {(v, str(s)) for v in ("cp.async", "bulk", "bulk2") for s in range(1, 5)}, \
        res.stdout + res.stderr
    assert all(float(r[2]) > 0 for r in rows), res.stdout
    assert res.returncode == 0 and "gather rate probe: ok" in res.stdout, res.stdout + res.stderr


def test_sparse_wgmma_issue_probe_compiles(tmp_path):
    _build_sparse_probe(tmp_path, SPARSE_WGMMA_ISSUE_PROBE)


@pytest.mark.gpu
def test_sparse_wgmma_issue_probe_times_every_batch_on_the_gpu(tmp_path):
    res = _run_sparse_probe(tmp_path, SPARSE_WGMMA_ISSUE_PROBE, timeout=120)
    rows = re.findall(r"\| m64n(\d+)k32 \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|", res.stdout)
    assert len(rows) == 15, res.stdout + res.stderr
    # a batch completes no sooner than it is issued, and no sooner than its tensor-core cycles
    assert all(int(r[4]) >= int(r[3]) and int(r[4]) >= int(r[2]) for r in rows), res.stdout
    assert len(re.findall(r"\| 2 x m64n(\d+)k32 \|", res.stdout)) == 5, res.stdout   # two warpgroups at once
    assert res.returncode == 0 and "wgmma issue probe: ok" in res.stdout, res.stdout + res.stderr


def test_sparse_attention_probe_compiles(tmp_path):
    _build_sparse_probe(tmp_path, SPARSE_ATTENTION_PROBE)


@pytest.mark.gpu
def test_sparse_attention_probe_matches_fp64_on_the_gpu(tmp_path):
    res = _run_sparse_probe(tmp_path, SPARSE_ATTENTION_PROBE, timeout=300)
    measured = set(re.findall(r"attention case (\S+): out rel-norm error", res.stdout))
    assert measured == {"one-scale", "spread-scales", "spread-scales-cut", "short-row"}, res.stdout + res.stderr
    assert "attention case no-token: out all 0, lse all +inf" in res.stdout, res.stdout
    assert res.returncode == 0 and "attention probe: ok" in res.stdout, res.stdout + res.stderr


def test_layout_check_skip_reason_without_cutlass(monkeypatch, tmp_path):
    """With nvcc but no CUTLASS headers the skip names the headers (it used to say nvcc too)."""
    monkeypatch.setitem(globals(), "_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setitem(globals(), "_cutlass_include", lambda: None)
    with pytest.raises(pytest.skip.Exception, match=r"^needs the CUTLASS headers \(pip install nvidia-cutlass"):
        test_layout_check_compiles_and_agrees(tmp_path)


def test_named_barrier_war_compiles(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc")
    _compile([nvcc, "-arch=sm_90a", "-c", str(NAMED_BARRIER_WAR), "-o", str(tmp_path / "probe.o")],
             "named_barrier_war.cu")


@pytest.mark.gpu
def test_named_barrier_war_runs_on_the_gpu(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc")
    exe = tmp_path / "named_barrier_war"
    _compile([nvcc, "-arch=sm_90a", str(NAMED_BARRIER_WAR), "-o", str(exe)], "named_barrier_war.cu")
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    wrong = re.search(r"(\d+) wrong values", res.stdout)
    assert res.returncode == 0 and wrong and int(wrong.group(1)) == 0, res.stdout + res.stderr
    # What the probe is for: whether racecheck reports this (correct) hand-off. Informational: the verdict
    # is the tool's, and the kernel's racecheck reports are judged against it (see the probe's header).
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer:
        rc = subprocess.run([sanitizer, "--tool", "racecheck", str(exe)], capture_output=True, text=True, timeout=300)
        print(f"racecheck on the named-barrier hand-off (rc {rc.returncode}):\n{rc.stdout[-2000:]}")


def test_mbarrier_chain_compiles(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc")
    _compile([nvcc, "-arch=sm_90a", "-c", str(MBARRIER_CHAIN), "-o", str(tmp_path / "probe.o")], "mbarrier_chain.cu")


@pytest.mark.gpu
def test_mbarrier_chain_runs_on_the_gpu(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc")
    exe = tmp_path / "mbarrier_chain"
    _compile([nvcc, "-arch=sm_90a", "-lineinfo", str(MBARRIER_CHAIN), "-o", str(exe)], "mbarrier_chain.cu")
    res = subprocess.run([str(exe), "chain"], capture_output=True, text=True, timeout=60)
    wrong = re.search(r"(\d+) wrong values", res.stdout)
    assert res.returncode == 0 and wrong and int(wrong.group(1)) == 0, res.stdout + res.stderr
    # Informational, as for named_barrier_war.cu: racecheck's verdict on the correct chain and on the control.
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer:
        for mode in ("chain", "race"):
            rc = subprocess.run([sanitizer, "--tool", "racecheck", str(exe), mode], capture_output=True, text=True,
                                timeout=300)
            print(f"racecheck on the mbarrier chain, mode {mode} (rc {rc.returncode}):\n{rc.stdout[-1500:]}")


# Probes with modes (mbarrier_arrivals.cu, row_sum_handoff.cu): `--list` prints them, each run prints "N wrong values",
# and `race` is the control, a real race whose values are not checked.
def _build_mode_probe(tmp_path: Path, source: Path) -> Path:
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc")
    exe = tmp_path / source.stem
    _compile([nvcc, "-arch=sm_90a", "-lineinfo", str(source), "-o", str(exe)], source.name)
    return exe


def _assert_probe_lists(exe: Path, modes: tuple[str, ...]) -> None:
    # `--list` is host code only (no CUDA call), so it runs here: the probe's modes are the ones the GPU test runs.
    res = subprocess.run([str(exe), "--list"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and tuple(res.stdout.split()) == modes, res.stdout + res.stderr


def _run_probe_modes(exe: Path, modes: tuple[str, ...], racecheck_timeout: int, report_chars: int) -> None:
    sanitizer = shutil.which("compute-sanitizer")
    for mode in modes:
        res = subprocess.run([str(exe), mode], capture_output=True, text=True, timeout=60)
        wrong = re.search(r"(\d+) wrong values", res.stdout)
        assert res.returncode == 0 and wrong, f"mode {mode}:\n{res.stdout}{res.stderr}"
        if mode != "race":  # the control races on purpose; its values are not checked
            assert int(wrong.group(1)) == 0, f"mode {mode}:\n{res.stdout}"
        print(res.stdout, end="")
        # What the probe is for: racecheck's verdict on each pattern. Informational, as for named_barrier_war.cu:
        # the kernels' reports are judged against these (see the probe's header for how to read them).
        if sanitizer:
            rc = subprocess.run([sanitizer, "--tool", "racecheck", str(exe), mode], capture_output=True, text=True,
                                timeout=racecheck_timeout)
            print(f"racecheck, mode {mode} (rc {rc.returncode}):\n{rc.stdout[-report_chars:]}")
            # A control the tool does not report would make the other modes' verdicts mean nothing.
            if mode == "race":
                assert "Race reported" in rc.stdout, f"racecheck missed the control:\n{rc.stdout[-report_chars:]}"


# The probe's modes (its header says how to read racecheck's verdict on each: the sparse kernel's reports at its P
# and pair hand-offs are judged against them).
MBARRIER_ARRIVAL_MODES = ("one-warp", "four-warps", "race")


def test_mbarrier_arrivals_compiles(tmp_path):
    _assert_probe_lists(_build_mode_probe(tmp_path, MBARRIER_ARRIVALS), MBARRIER_ARRIVAL_MODES)


@pytest.mark.gpu
def test_mbarrier_arrivals_runs_on_the_gpu(tmp_path):
    _run_probe_modes(_build_mode_probe(tmp_path, MBARRIER_ARRIVALS), MBARRIER_ARRIVAL_MODES, 300, 1500)


# The probe's modes (row_sum_handoff.cu's header says what each reproduces).
ROW_SUM_MODES = ("syncthreads", "named", "syncthreads-pdl", "named-pdl", "syncthreads-arrive", "named-arrive",
                 "syncthreads-steps", "named-steps", "named-steps-mbar", "race")


def test_row_sum_handoff_compiles(tmp_path):
    _assert_probe_lists(_build_mode_probe(tmp_path, ROW_SUM_HANDOFF), ROW_SUM_MODES)


@pytest.mark.gpu
def test_row_sum_handoff_runs_on_the_gpu(tmp_path):
    _run_probe_modes(_build_mode_probe(tmp_path, ROW_SUM_HANDOFF), ROW_SUM_MODES, 600, 2000)


# ---- the error text of the host checks (common/check.h) -----------------------------------------------------------
def test_error_text_check_compiles_and_agrees(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc (CUDA toolkit: nvcc on PATH, or CUDA_HOME)")
    exe = tmp_path / "error_text_check"
    _compile([nvcc, "-std=c++17", "-I", str(ROOT / "csrc"), str(ROOT / "csrc" / "common" / "checks" /
              "error_text_check.cu"), "-o", str(exe)], "error_text_check.cu")
    res = subprocess.run([str(exe)], capture_output=True, text=True)
    assert res.returncode == 0 and "error text: ok" in res.stdout, res.stdout + res.stderr


def test_fp8_vregs_probe_compiles(tmp_path):
    _build_sparse_probe(tmp_path, FP8_VREGS_PROBE)


@pytest.mark.gpu
def test_fp8_vregs_probe_matches_fp64_on_the_gpu(tmp_path):
    """V read into registers as the A operand of O^T = V^T P^T (fp16 and e4m3 wgmma) against fp64, and the six P V
    forms timed (printed)."""
    res = _run_sparse_probe(tmp_path, FP8_VREGS_PROBE, timeout=120)
    checks = dict(re.findall(r"check (\S+): rel-norm error (\S+)", res.stdout))
    assert set(checks) == {"f16-vregs", "e4m3-vregs"}, res.stdout + res.stderr
    assert len(re.findall(r"^time ", res.stdout, re.M)) == 6, res.stdout
    assert res.returncode == 0 and "vregs probe: ok" in res.stdout, res.stdout + res.stderr
