"""bench/step_meta_host.py end to end on CPU: a decode step's host metadata
at the 7B's attention shapes, every step's groups shipped in one transfer
(radix_ext/byte_pack.py) and its static copies refilled."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]


def run_bench(out: Path, *args: str) -> dict:
    """bench/step_meta_host.py with `args`, its result written to `out`."""
    proc = subprocess.run([sys.executable, str(REPO / "bench/step_meta_host.py"), *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_cpu_run_counts_each_steps_ops_and_shapes(tmp_path):
    result = run_bench(tmp_path / "meta.json", "--rows", "8,24", "--steps", "24", "--policies", "h2o,rkv,streaming")
    assert result["policies"] == ["h2o", "rkv", "streaming"] and result["machine"]
    small, large = result["runs"]
    assert (small["rows"], large["rows"]) == (8, 24)
    for run in (small, large):
        assert run["groups"] == 3  # one group per policy class, every row past its budget
        assert run["padded_rows"] % 16 == 0 and run["padded_rows"] >= run["rows"]
        assert run["host_ms_median"] > 0 and run["gpu_ops_per_step"] == 0  # no GPU here
        assert run["ops_by_name"] and abs(run["ops_per_step"] - sum(run["ops_by_name"].values())) < 1
        # The attention's shapes recur: one entry, refilled every step; one per group.
        assert run["graph_entries"] == 1 and run["group_entries"] == 3



def test_the_steps_that_meet_new_shapes_are_named(tmp_path):
    # Plain rows (`full`) fold into the pass with their whole KV as prefix
    # and grow it every step (321 tokens at the first step, 390 at the
    # last): their prefix table is the planned width from the first step
    # (StepBuilder._decode_prefix_width), so the attention keeps its shapes;
    # rkv's first decision, at step 15, is a group segment not met before.
    (run,) = run_bench(tmp_path / "keys.json", "--rows", "8", "--steps", "70", "--policies", "rkv,full")["runs"]
    assert run["pool_only_rows"] == 4 and run["graph_entries"] == 1
    assert run["new_keys"] == [{"step": 15, "segment": "group", "policy": "rkv", "action": "decide", "rows": 4,
                                "width": 20}]


def test_thinkv_cuts_keep_their_shapes_as_segments_halve(tmp_path):
    # Budget 256, refresh 128: from step 256 each row cuts its oldest
    # segments in halves (128 -> 64 -> ... -> 4 tokens held). The cut shapes
    # start at a segment's width (N 128, T 64), so the halvings replay the
    # first cut's group; only more segments (targets 4 -> 8, step 568) is new.
    (run,) = run_bench(tmp_path / "thinkv.json", "--rows", "8", "--steps", "700", "--policies", "thinkv")["runs"]
    assert [(k["step"], k["policy"], k["action"]) for k in run["new_keys"]] == [
        (256, "thinkv", "decide"), (568, "thinkv", "decide")]


def test_the_ten_policy_batch_meets_new_group_shapes_only_where_expected(tmp_path):
    # 600 decode steps of the ten-policy mix at 32 rows (the H200 runs'
    # composition, 2026-12-02): past the first step a group segment is new
    # only at crystal_kv's first observe, rkv's and skipkv's first
    # decisions (step 15), thinkv's first cut (256) and its segments
    # doubling (568: targets 4 -> 8, named by `changed`). A policy whose
    # inputs change shape as a request ages adds a capture here.
    ten = "h2o,rkv,streaming,snapkv,skipkv,thinkv,crystal_kv,longflow,crystalcache,full"
    (run,) = run_bench(tmp_path / "ten.json", "--rows", "32", "--steps", "600", "--policies", ten)["runs"]
    assert [(k["step"], k["policy"], k["action"]) for k in run["new_keys"]] == [
        (1, "crystal_kv", "observe"), (15, "rkv", "decide"), (15, "skipkv", "decide"), (256, "thinkv", "decide"),
        (568, "thinkv", "decide")]
    assert run["new_keys"][-1]["changed"] == {"input targets": [[4, 4], [4, 8]]}


def test_a_class_sweep_deals_the_same_rows_over_fewer_policies(tmp_path):
    runs = run_bench(tmp_path / "classes.json", "--rows", "12", "--steps", "12", "--policies", "h2o,rkv,streaming",
                     "--classes", "1,3")["runs"]
    assert [(r["rows"], r["classes"], r["groups"]) for r in runs] == [(12, 1, 1), (12, 3, 3)]
    # More classes, more groups to cut, pad and ship: the number issue #29 wants flat.
    assert runs[1]["ops_per_step"] > runs[0]["ops_per_step"]
    bad = subprocess.run([sys.executable, str(REPO / "bench/step_meta_host.py"), "--rows", "8", "--policies", "h2o",
                          "--classes", "2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--classes" in bad.stderr

# Two H200 runs by row count (GPU operations), and two CPU class sweeps:
# bars per (rows, classes), all operations (no GPU ones).
@pytest.mark.parametrize("before,after", [("step-meta-host-h200-9410b3c.json", "step-meta-host-h200-1a940db.json"),
                                          ("step-meta-host-cpu-4facf3d.json", "step-meta-host-cpu-3adeb71.json")])
def test_the_plot_of_two_runs_is_written(tmp_path, before, after):
    out = tmp_path / "meta.png"
    results = REPO / "bench/results"
    proc = subprocess.run([sys.executable, str(REPO / "bench/plot_step_meta_host.py"),
                           str(results / before), str(results / after), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_full_rows_fold_into_the_step_as_served(tmp_path):
    run = run_bench(tmp_path / "full.json", "--rows", "12", "--steps", "12", "--policies", "h2o,full,rkv")["runs"][0]
    # Four of twelve rows are plain requests: pool-only rows of the step, in no group.
    assert run["pool_only_rows"] == 4 and run["groups"] == 2 and run["padded_rows"] >= 12
