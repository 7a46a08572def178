"""benchmarks/ncu_source_summary.py on a small CSV in the layout of ncu's source page (CPU)."""
import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "ncu_source_summary.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import ncu_source_summary as nss  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_long_sb", "stall_barrier", "stall_wait", "stall_long_sb (Not Issued)"]
# (address, instruction, samples, executed, long_sb, barrier, wait): a loop of 4 executions a unit with an mbarrier
# wait (try_wait, another instruction, the branch holding the samples), a wgmma wait, and a body of 32 a unit.
ROWS = [
    (0x1000, "MOV R1, c[0x0][0x28]", 0, 2, 0, 0, 0),
    (0x1010, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2+UR4+0x32c30], R3", 1, 8, 0, 0, 1),
    (0x1020, "UMOV UR5, 0x40", 0, 8, 0, 0, 0),
    (0x1030, "@P0 BRA 0x1050", 40, 8, 40, 0, 0),
    (0x1040, "WARPGROUP.DEPBAR.LE gsb0, 0x0", 20, 8, 0, 20, 0),
    (0x1050, "FFMA R4, R5, R6, R4", 5, 64, 0, 0, 5),
    (0x1060, "F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R7, R8, R9, RZ", 4, 64, 0, 0, 4),
    (0x1070, "EXIT", 0, 2, 0, 0, 0),
]


def write_csv(path, rows=ROWS, header=HEADER, first=("Kernel Name", "void k<(int)0>(Params)")):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(first)
        w.writerow(header)
        for a, text, s, e, lsb, bar, wait in rows:
            w.writerow([f"0x7f00{a:08x}", text, s, 0, e, lsb, bar, wait, 0])


def test_summary_sections(tmp_path):
    path = tmp_path / "prof.csv"
    write_csv(path)
    kernel, rows = nss.load(str(path))
    assert kernel == "void k<(int)0>(Params)" and rows[0]["addr"] == 0 and rows[-1]["addr"] == 0x70
    text = nss.summarize(kernel, rows, units=2, top=5, regions=nss.parse_regions("loop=0x10-0x50,body=0x50-0x70"))
    assert "8 instructions, 70 samples" in text
    assert "stall reasons: long_sb 57%, barrier 29%, wait 14%" in text
    # the wait: the branch after the try_wait, with the try_wait's operand
    wait_line = next(line for line in text.splitlines() if "<-" in line)
    assert wait_line.split()[:3] == ["0x00030", "57.1%", "4.00"] and "[R2+UR4+0x32c30]" in wait_line
    # the body of 32 executions a unit, and the regions' instructions a unit
    assert any(line.split()[:4] == ["0x00050-0x00060", "32.00", "2", "12.9%"] for line in text.splitlines())
    assert "  loop:  87.1%" in text and "  body:  12.9%" in text


def test_cli_refuses_what_it_cannot_read(tmp_path):
    bad = tmp_path / "other.csv"
    bad.write_text("a,b\n1,2\n")
    res = subprocess.run([sys.executable, SCRIPT, str(bad)], capture_output=True, text=True)
    assert res.returncode == 2 and "not ncu's source page" in res.stderr
    missing = tmp_path / "nocol.csv"
    write_csv(missing, header=[h if h != "Instructions Executed" else "Other" for h in HEADER])
    res = subprocess.run([sys.executable, SCRIPT, str(missing)], capture_output=True, text=True)
    assert res.returncode == 2 and "'Instructions Executed'" in res.stderr
    good = tmp_path / "prof.csv"
    write_csv(good)
    for args, msg in ((["--units", "0"], "--units must be > 0"), (["--regions", "x=10"], "is not name=start-end"),
                      (["--regions", "x=0x50-0x10"], "ends before it starts")):
        res = subprocess.run([sys.executable, SCRIPT, str(good), *args], capture_output=True, text=True)
        assert res.returncode == 2 and msg in res.stderr, (args, res.stderr)
    res = subprocess.run([sys.executable, SCRIPT, str(good), "--units", "2"], capture_output=True, text=True)
    assert res.returncode == 0 and "loop bodies" in res.stdout


@pytest.mark.parametrize("text, op", [("@!P3  BRA 0x10", "BRA"), ("QGMMA.64x64x32.F32.E4M3.E4M3 R1, gdesc[UR4]", "QGMMA"),
                                      ("", "?")])
def test_opcode(text, op):
    assert nss.opcode(text) == op
