"""CPU checks of benchmarks/ablation.py (the builds and timings need nvcc and a Hopper GPU).

The variants are textual edits of a copy of csrc/; these tests keep the edits in step with the kernel sources,
so that a change of the kernel cannot leave the ablation script silently broken.
"""
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "ablation.py"


@pytest.fixture(scope="module")
def ablation():
    spec = importlib.util.spec_from_file_location("ablation_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def copy_edited_files(ablation, dst: Path) -> None:
    for rel in {e.path for edits in ablation.EDITS.values() for e in edits}:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, dst / rel)


def test_help_lists_the_options():
    res = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    for option in ("--variants", "--shapes", "--build-only", "--check-edits"):
        assert option in res.stdout, option


def test_rejects_unknown_mask_before_building(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--variants", "0,9", "--work-dir", str(tmp_path)],
                         capture_output=True, text=True)
    assert res.returncode != 0
    assert "masks are 0..7" in res.stdout + res.stderr
    assert not any(tmp_path.iterdir()), "nothing may be built for a bad mask list"


def test_release_sources_carry_no_ablation_switch():
    hits = [str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*")
            if p.is_file() and "FMLA_ABLATE" in p.read_text(errors="ignore")]
    assert not hits, f"ablation switches belong in benchmarks/ablation.py, found in {hits}"


@pytest.mark.parametrize("mask", range(1, 8))
def test_every_variant_edits_the_current_sources(ablation, mask, tmp_path):
    copy_edited_files(ablation, tmp_path)
    changed = ablation.apply_edits(tmp_path, mask)
    assert changed, f"variant {mask} changes nothing"
    for edit in ablation.variant_edits(mask):
        text = (tmp_path / edit.path).read_text()
        assert text.count(edit.new) == 1 and text != (ROOT / edit.path).read_text(), (mask, edit.path)
    # each bit touches its own lines: the combined variant holds every single-bit edit
    for bit in (1, 2, 4):
        if mask & bit:
            assert all(e.new in (tmp_path / e.path).read_text() for e in ablation.EDITS[bit])


def test_variant_zero_is_the_unchanged_tree(ablation, tmp_path):
    copy_edited_files(ablation, tmp_path)
    assert ablation.apply_edits(tmp_path, 0) == []


def test_edits_are_unique_in_the_sources(ablation):
    for bit, edits in ablation.EDITS.items():
        for edit in edits:
            assert (ROOT / edit.path).read_text().count(edit.old) == 1, (bit, edit.path, edit.old)


def test_a_source_that_no_longer_matches_fails_naming_variant_and_file(ablation, tmp_path):
    copy_edited_files(ablation, tmp_path)
    edit = ablation.EDITS[4][0]
    path = tmp_path / edit.path
    path.write_text(path.read_text().replace(edit.old, edit.old.replace("tOrO", "tOrAcc")))
    with pytest.raises(ablation.EditMismatch) as err:
        ablation.apply_edits(tmp_path, 7)
    msg = str(err.value)
    assert "variant 7" in msg and edit.path in msg and "no longer matches" in msg, msg
    # nothing was written: the other files of the variant are still the release sources
    for rel in {e.path for e in ablation.variant_edits(7)} - {edit.path}:
        assert (tmp_path / rel).read_text() == (ROOT / rel).read_text()


def test_a_duplicated_match_fails_too(ablation, tmp_path):
    copy_edited_files(ablation, tmp_path)
    edit = ablation.EDITS[2][0]
    path = tmp_path / edit.path
    path.write_text(path.read_text() + edit.old)
    with pytest.raises(ablation.EditMismatch, match="occurs 2 times"):
        ablation.apply_edits(tmp_path, 2)


def test_check_edits_needs_no_gpu_or_build(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--check-edits", "--work-dir", str(tmp_path)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "variant 7" in res.stdout
    assert not any(tmp_path.iterdir())
