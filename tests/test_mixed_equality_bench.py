"""bench/mixed_equality.py: its comparisons, and its `--quick` CPU run end
to end (a real engine on the session's tiny Llama): every registered policy
in the mixed batch, rows compared, and on CPU every row of the mixed batch
equal to its solo run (tests/test_mixed_policies.py checks the same through
`kvsieve serve` at one row per policy)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from kvsieve.policies import policy_names

REPO = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("mixed_equality", REPO / "bench/mixed_equality.py")
mixed_equality = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mixed_equality)


def test_first_difference():
    first = mixed_equality.first_difference
    assert first([1, 2, 3], [1, 2, 3]) is None
    assert first([1, 2, 3], [1, 5, 3]) == 1
    assert first([1, 2], [1, 2, 3]) == 2  # a row that ended short differs where it ended


def test_compare_rows_counts_and_positions():
    out = mixed_equality.compare_rows([([1, 2, 3, 4], [1, 2, 3, 4]), ([1, 2, 3, 4], [1, 9, 9, 9]),
                                       ([1, 2, 3, 4], [1, 2, 3, 9]), (None, [1, 2, 3, 4])])
    assert (out["rows"], out["equal"], out["differing"], out["errors"]) == (3, 1, 2, 1)
    assert out["first_difference"] == {"min": 1, "median": 2.0, "max": 3}
    assert out["equal_prefix_share"] == {"mean": 0.5, "min": 0.25}
    assert "first_difference" not in mixed_equality.compare_rows([([7], [7])])


def test_plan_deals_every_policy_and_prompts_start_apart():
    names = ["full", "h2o", "rkv"]
    assert mixed_equality.deal(names, 7) == ["full", "h2o", "rkv", "full", "h2o", "rkv", "full"]
    assert mixed_equality.deal(names, 2) == names  # at least one row per policy
    batch = mixed_equality.prompts(300, 64, 152064, seed=1)
    assert len({p[0] for p in batch}) == 300 and all(len(p) == 64 for p in batch)
    assert mixed_equality.prompts(20, 8, 512, seed=1) == mixed_equality.prompts(20, 8, 512, seed=1)


def test_quick_cpu_run_every_row_equals_its_solo_run(tmp_path, tiny_llama):
    out = tmp_path / "mixed-equality.json"
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}  # its own metrics dir
    proc = subprocess.run([sys.executable, str(REPO / "bench/mixed_equality.py"), "--quick", "--model", str(tiny_llama),
                           "--out", str(out), "--commit", "test"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=540)
    tail = proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert proc.returncode == 0 and result["ok"], tail
    assert result["commit"] == "test" and result["device"] == "cpu" and result["command"].startswith("python3 bench/")
    names = policy_names()
    mixed = result["comparisons"]["mixed_vs_solo"]
    assert sorted(mixed) == sorted(names)
    assert all(mixed[n]["rows"] > 0 and mixed[n]["errors"] == 0 for n in names)
    assert result["totals"]["mixed_vs_solo"]["rows"] == result["rows"]["used"] >= len(names)
    # On CPU a row's greedy tokens do not depend on its batch: all equal.
    for key in ("mixed_vs_solo", "batch_size", "same_size_vs_mixed", "same_size_vs_solo"):
        total = result["totals"][key]
        assert total["rows"] > 0 and total["equal"] == total["rows"], (key, result["comparisons"][key])
    assert result["all_rows_equal"] is True
    workloads = {w["name"]: w for w in result["workloads"]}
    assert {"mixed", "same-size:full", "half:full:1", "half:full:2"} | {f"solo:{n}" for n in names} <= set(workloads)
    assert all(w["status"] == "done" and not w["errors"] and w["engine_alive"] for w in workloads.values())
