"""bench/plot_mixed_attention.py draws committed mixed_attention_ab results
by kernel and refuses a result without the kernel split, naming the file."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench/plot_mixed_attention.py"
LOGS = REPO / "bench/results/logs/h200-2026-12-02d"


def test_two_results_by_kernel(tmp_path):
    out = tmp_path / "ab.png"
    runs = ["old=" + str(LOGS / "call3-mixed-attention-ab-128-1d24a65.json"),
            "new=" + str(LOGS / "call4-mixed-attention-ab-128-32d1b77.json")]
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), *runs], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000


def test_a_result_without_the_kernel_split_is_refused(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"ms_per_launch": {"mixed": 0.09}}))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "x.png"), f"old={old}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "kernels_ms_per_launch" in proc.stderr and str(old) in proc.stderr
    assert not (tmp_path / "x.png").exists()
