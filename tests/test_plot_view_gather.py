"""bench/plot_view_gather.py: the view's gather forms and each policy's
step before and after a change, where only runs an AFTER file made count
(not the ones a --resume call carried over), as multiples of vanilla."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench/plot_view_gather.py"
sys.path.insert(0, str(REPO / "bench"))
import plot_view_gather  # noqa: E402


def profile(rates: dict, carried: tuple = ()) -> dict:
    out = {"runs": {name: {"tokens_per_s_unprofiled": rate} for name, rate in rates.items()}}
    if carried:
        out["resumed_from"] = [{"command": "earlier", "runs": sorted(carried)}]
    return out


def test_only_the_runs_an_after_file_made_are_compared():
    before = profile({"rkv": 100.0, "streaming": 200.0, "h2o": 90.0, "mixed:rkv+h2o": 95.0})
    cadence = profile({"rkv": 100.0, "streaming": 300.0, "h2o": 90.0}, carried=("rkv", "h2o"))
    fused = profile({"rkv": 130.0, "streaming": 310.0})
    rows = plot_view_gather.pairs(before, [("cadence", cadence), ("fused", fused)])
    assert [(r["policy"], r["before"], r["after"], r["change"]) for r in rows] == [
        ("rkv", 100.0, 130.0, "fused"), ("streaming", 200.0, 310.0, "fused")]
    assert [r["policy"] for r in plot_view_gather.pairs(before, [("cadence", cadence)])] == ["streaming"]


def test_the_figure_is_written_in_multiples_of_vanilla(tmp_path):
    files = {"view.json": {"machine": "GPU X", "rows": 6, "heads": 4, "columns": 3,
                           "forms": {"index": {"ms_per_layer": 0.4}, "fused": {"ms_per_layer": 0.1}}},
             "before.json": profile({"rkv": 1000.0, "streaming": 2000.0}),
             "after.json": profile({"rkv": 1500.0}),
             "vanilla.json": {"vanilla": [{"generate": 16384, "tokens_per_s": 500.0}]}}
    for name, body in files.items():
        (tmp_path / name).write_text(json.dumps(body))
    out = tmp_path / "view.png"
    proc = subprocess.run([sys.executable, str(SCRIPT), *(str(tmp_path / n) for n in ("view.json", "before.json",
                                                                                     "after.json")),
                           str(out), "--vanilla", str(tmp_path / "vanilla.json"), "--label-after", "fused view"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rkv: 1,000 -> 1,500 tok/s (fused view)" in proc.stdout and "streaming" not in proc.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "view.json"), str(tmp_path / "before.json"),
                          str(tmp_path / "after.json"), str(out), "--label-after", "a,b"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--label-after" in bad.stderr
