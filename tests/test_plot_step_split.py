"""bench/plot_step_split.py: each traced run's GPU time a step by part (a
policy's decision and observation ranges summed), runs without a trace
left out, and a clear exit when no file holds one."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench/plot_step_split.py"
sys.path.insert(0, str(REPO / "bench"))
import plot_step_split  # noqa: E402


def traced(split: dict, step_ms: float) -> dict:
    return {"requests": 6, "step_ms_unprofiled": step_ms, "profile": {"split_per_step_ms": split}}


def write(tmp_path, name, runs) -> str:
    path = tmp_path / name
    path.write_text(json.dumps({"device": "GPU X", "date": "2026-12-03 12:00 UTC", "runs": runs}))
    return str(path)


def test_parts_are_summed_per_run_and_untraced_runs_left_out(tmp_path):
    a = write(tmp_path, "a.json", {
        "rkv": traced({"attention_kernel": 10.0, "decision_inputs_view": 2.0, "region_writes": 1.0,
                       "model_layers_and_rest": 8.0, "host_gpu_idle": 50.0, "decision.rkv": 3.0,
                       "observation.rkv": 0.5}, 30.0),
        "h2o": {"requests": 6, "step_ms_unprofiled": 40.0}})  # a throughput run, no trace
    b = write(tmp_path, "b.json", {"mixed:rkv+h2o": traced({"attention_kernel": 12.0, "decision.rkv": 1.0,
                                                            "decision.h2o": 2.0}, 20.0)})
    runs = plot_step_split.traced_runs([a, b])
    assert [r["run"] for r in runs] == ["rkv", "mixed"]
    assert runs[0]["gpu_ms_by_part"] == {"model_layers_and_rest": 8.0, "attention_kernel": 10.0,
                                         "decision_inputs_view": 2.0, "region_writes": 1.0, "policy": 3.5}
    assert runs[0]["gpu_ms"] == 24.5 and runs[0]["unprofiled_step_ms"] == 30.0  # host idle is not GPU time
    assert runs[1]["gpu_ms_by_part"]["policy"] == 3.0 and runs[1]["gpu_ms"] == 15.0


def test_the_figure_and_json_are_written(tmp_path):
    a = write(tmp_path, "a.json", {"longflow": traced({"attention_kernel": 17.7, "decision.longflow": 1.3}, 35.5)})
    out = tmp_path / "plots" / "split.png"
    done = subprocess.run([sys.executable, str(SCRIPT), str(out), a, "--json", str(tmp_path / "bars.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert out.stat().st_size > 10_000
    assert json.loads((tmp_path / "bars.json").read_text())[0]["gpu_ms"] == 19.0


def test_no_traced_run_is_a_clear_exit(tmp_path):
    a = write(tmp_path, "a.json", {"h2o": {"requests": 6, "step_ms_unprofiled": 40.0}})
    with pytest.raises(SystemExit, match="no traced run"):
        plot_step_split.traced_runs([a])
