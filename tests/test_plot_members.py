"""bench/plot_members.py draws committed step_profile comparisons and
refuses a result without one, naming the file."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench/plot_members.py"


def test_two_comparisons_side_by_side(tmp_path):
    out = tmp_path / "members.png"
    runs = ["old=" + str(REPO / "bench/results/step-profile-mixed-h200-2026-11-29g.json"),
            "new=" + str(REPO / "bench/results/logs/h200-2026-12-02b/call3-members-and-mixed-4a7f93b.json")]
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), *runs], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000


def test_a_result_without_a_comparison_is_refused(tmp_path):
    solo = tmp_path / "solo.json"
    solo.write_text('{"runs": {}}')
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "x.png"), f"solo={solo}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "no `comparison`" in proc.stderr and str(solo) in proc.stderr
    assert not (tmp_path / "x.png").exists()
