"""bench/gpu_smoke.py, the GPU gate, run with --quick: the same code path on
CPU with the embedded model (every policy alone, a mixed batch, the first
again; every region page back), plus headline points for a policy and for
built-in paper presets (issue #30: the GPU headline adds the presets)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_smoke", REPO / "bench/gpu_smoke.py")
gpu_smoke = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_smoke)

SPLIT = {"region_tokens_per_layer_head": 668468, "region_pages": 4679276}
SHAPE = {"layers": 28, "kv_heads": 4}


def test_a_preset_point_runs_its_own_kv_policy_and_rows_from_its_ceiling():
    plain = gpu_smoke.headline_point("streaming", 1024, 64, SPLIT, SHAPE)
    assert plain["kv_policy"] == {"name": "streaming", "budget": 1024} and plain["tokens"] == 1152
    assert plain["region_fit_rows"] == 668468 // 1040 and not plain["preset"]
    longflow = gpu_smoke.headline_point("longflow-paper", 1024, 64, SPLIT, SHAPE)
    assert longflow["preset"] and longflow["budget"] == 3200 and longflow["tokens"] == 3328
    assert longflow["kv_policy"]["params"]["window"] == 32
    pages = gpu_smoke.pages_per_head("longflow", longflow["kv_policy"], 64, 3328)
    assert longflow["region_fit_rows"] == 4679276 // (28 * 4 * pages) < plain["region_fit_rows"]
    skipkv = gpu_smoke.headline_point("skipkv-paper", 1024, 64, SPLIT, SHAPE)  # the paper leaves its budget open
    assert skipkv["kv_policy"]["budget"] == 1024 and skipkv["kv_policy"]["params"]["scoring"] == "paper"
    ratio = gpu_smoke.headline_point("crystalcache-paper-b30", 1024, 64, SPLIT, SHAPE)
    assert "budget" not in ratio["kv_policy"] and ratio["kv_policy"]["budget_ratio"] == 0.3


@pytest.mark.timeout(900)
def test_quick_gate_with_a_preset_headline_on_cpu(tmp_path):
    out = tmp_path / "gpu-smoke.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench/gpu_smoke.py"), "--quick",
                           "--headline", "streaming,skipkv-paper", "--out", str(out)],
                          capture_output=True, text=True, timeout=850, cwd=REPO)
    assert out.exists(), proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert proc.returncode == 0 and result["ok"], (proc.stdout[-3000:], proc.stderr[-3000:])
    for workload in result["workloads"]:
        assert workload["errors"] == 0 and workload["region_after"]["used"] == 0 and workload["engine_alive"], workload
    points = {p["policy"]: p for p in result["headline"]}
    assert set(points) == {"streaming", "skipkv-paper"}
    preset = points["skipkv-paper"]
    assert preset["preset"] == "skipkv-paper" and preset["kv_policy"]["params"]["scoring"] == "paper"
    for point in points.values():
        assert "error" not in point and point["tokens_per_s"] > 0 and point["region_after"]["used"] == 0
