"""bench/plot_mix_ratios.py draws committed mixed_kernel_parts results
(window and GPU-busy ratios, call by call) and refuses a result without
the GPU-busy ratio, naming the file."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench/plot_mix_ratios.py"
LOGS = REPO / "bench/results/logs"


def test_calls_side_by_side(tmp_path):
    out = tmp_path / "ratios.png"
    runs = ["1d24a65=" + str(LOGS / "h200-2026-12-02d/call1-mixed-kernel-parts.json"),
            "83337d5=" + str(LOGS / "h200-2026-12-02e/call3-mixed-kernel-parts.json")]
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), *runs], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 15_000


def test_a_result_without_the_gpu_busy_ratio_is_refused(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"results": [{"ratio": 0.8}]}))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "x.png"), f"old={old}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "gpu_busy_ratio" in proc.stderr and str(old) in proc.stderr
    assert not (tmp_path / "x.png").exists()
