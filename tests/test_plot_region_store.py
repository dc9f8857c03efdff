"""bench/plot_region_store.py draws committed bench/region_store.py reports
(two builds, uniform and mixed widths) and refuses a report without fused
rows, naming the file."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench/plot_region_store.py"
LOGS = REPO / "bench/results/logs/h200-2026-12-02f"


def test_two_builds_side_by_side(tmp_path):
    out = tmp_path / "store.png"
    reports = [f"{build}={LOGS}/call2-region-store-{build}-{widths}.json"
               for build in ("c98746e", "24552e7") for widths in ("uniform", "wide36")]
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), *reports], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 15_000


def test_a_report_without_fused_rows_is_refused(tmp_path):
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"results": [{"form": "pytorch", "rows": 3, "step_ms": 1.0}]}))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "x.png"), f"cpu={cpu}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "no fused rows" in proc.stderr and str(cpu) in proc.stderr
    assert not (tmp_path / "x.png").exists()
