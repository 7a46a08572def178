"""CPU checks of benchmarks/ablation.py's command line (the builds and timings need a Hopper GPU)."""
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ablation.py"


def test_help_lists_the_options():
    res = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "--variants" in res.stdout and "--shapes" in res.stdout


def test_rejects_unknown_mask_before_building(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--variants", "0,9", "--work-dir", str(tmp_path)],
                         capture_output=True, text=True)
    assert res.returncode != 0
    assert "masks are 0..7" in res.stdout + res.stderr
    assert not any(tmp_path.iterdir()), "nothing may be built for a bad mask list"
