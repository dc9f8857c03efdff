"""Top-10 attended-token recall (bench/eval/recall.py) through a real
`kvsieve serve` with the recall probe, on the tiny Llama: a budget that
evicts nothing recalls every top-10 token at every recorded step, a budget
of 16 over a compressed ~150-token needle prompt loses some; the resume
sends nothing again."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _recall(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.eval", "recall", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=400)


def test_recall_is_one_without_eviction_and_drops_under_a_small_budget(tiny_llama, tmp_path):
    out = tmp_path / "recall.json"
    args = ["--out", str(out), "--model", str(tiny_llama), "--policies", "h2o", "--budgets", "ref,16",
            "--tasks", "needle", "--needle-lengths", "96", "--needle-depths", "0,1", "--every", "4"]
    first = _recall(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["cells"]) == {"needle|h2o|ref", "needle|h2o|16"}
    for key, cell in data["cells"].items():
        assert len(cell["records"]) == 2
        for rec in cell["records"].values():
            assert "error" not in rec, rec
            assert rec["steps"] >= 2 and len(rec["per_layer"]) == 2  # the tiny Llama's layers
    ref = data["cells"]["needle|h2o|ref"]
    assert all(r["kv_usage"]["evicted_tokens"] == 0 for r in ref["records"].values())
    assert ref["recall"] == 1.0
    small = data["cells"]["needle|h2o|16"]
    assert all(r["kv_usage"]["evicted_tokens"] > 0 for r in small["records"].values())
    assert 0 < small["recall"] < 1

    again = _recall(*args)
    assert again.returncode == 0 and "nothing to run" in again.stderr
