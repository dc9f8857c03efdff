"""bench/capture_churn.py: the slow decode steps of a step log, what changed
in each, and a model of the attention key's capture rule."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[1]
sys.path.insert(0, str(REPO / "bench"))

import capture_churn  # noqa: E402


def step(t, padded, counters, width=24, prefix=128, classes=("h2o",), eager_groups=0):
    return {"t": t, "mode": "decode", "bs": padded, "region": padded, "padded": padded, "width": width,
            "prefix": prefix, "observed_slots": width * 16, "group_widths": [[c, width] for c in classes],
            "counters": dict(counters), "eager_groups": eager_groups}


def log():
    c = {"captures": 0, "replays": 0, "group_captures": 0, "group_replays": 0, "forward_captures": 0,
         "forward_replays": 0}
    lines = []

    def add(padded, **changes):
        lines.append(step(len(lines) * 0.02, padded, c))
        for k, v in changes.items():
            c[k] += v
    add(16, forward_replays=1)  # replays
    add(32)  # new rows: eager (no counter moves)
    add(32, captures=28)  # the second sighting captures its segments
    add(32, forward_captures=1)  # then the stack
    add(32, forward_replays=1)
    add(32, forward_replays=1)
    lines[-1]["compiles"] = [{"kernel": "_observe_kernel", "s": 1.1, "key": "k"}, {"kernel": "_merge_kernel", "s": 0.002}]
    lines.insert(0, {"t": -0.02, "mode": "extend", "bs": 1, "tokens": 64, "counters": dict(lines[0]["counters"]),
                     "compiles": [{"kernel": "_extend_kernel", "s": 2.0}]})  # warm-up, before any decode
    lines.append({"t": len(lines) * 0.02, "mode": "extend", "bs": 1, "tokens": 64, "counters": dict(c)})
    return lines


def test_slow_steps_are_classified_and_their_causes_named(tmp_path):
    result = capture_churn.churn(log())
    kinds = result["kinds"]
    assert {k: v["steps"] for k, v in kinds.items()} == {"stack_replay": 3, "eager": 1, "segment_capture": 1,
                                                         "stack_capture": 1}
    assert result["slow_steps"] == 3 and 0.4 < result["slow_share_of_decode_s"] < 0.6
    assert result["what_changed"]["eager"] == {"padded": 1}
    assert result["what_changed"]["segment_capture"] == {"none (second sighting or composition repeats)": 1}
    # The model: 16 then 32 rows; the second sighting of 32 captures, first sight would not run eagerly.
    assert result["what_if"]["as logged, second sight"] == {"eager": 2, "capture": 1, "replay": 3,
                                                           "mean_extra_rows": 0.0}
    assert result["what_if"]["as logged, first sight"]["eager"] == 0
    assert result["what_if"]["power of two, second sight"]["mean_extra_rows"] == 0.0  # 16 and 32 are powers of two
    # Only the compile that took long, past the first decode step (the warm-up's and cache loads are not listed).
    assert result["compiles"] == [{"step": 6, "mode": "decode", "bs": 32, "kernel": "_observe_kernel", "s": 1.1,
                                   "key": "k"}]
    assert capture_churn.two_per_doubling(40) == 48 and capture_churn.two_per_doubling(100) == 128


def test_the_script_reads_a_gzipped_log_and_writes_json(tmp_path):
    path = tmp_path / "steps.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(x) for x in log()) + "\n")
    out = tmp_path / "churn.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench/capture_churn.py"), str(path), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "6 decode steps; 3 not replays" in proc.stdout
    assert "compiles while serving (>= 0.05 s): 1" in proc.stdout and "_observe_kernel 1.10 s" in proc.stdout
    assert json.loads(out.read_text())["decode_steps"] == 6


def test_the_time_budget_splits_the_steady_steps_from_the_slow_ones_by_cause():
    # Replays of 10 ms, one of 40 ms whose metadata waited (CrystalCache's
    # breath cycle reads its snapshot back), one of 30 ms whose groups ran
    # eagerly, and a capture of 100 ms; 128 rows a step.
    c = {"captures": 0, "replays": 0, "group_captures": 0, "group_replays": 0, "forward_captures": 0,
         "forward_replays": 0}
    lines, t = [], 0.0
    # Then a replayed stack whose deferred groups captured a new shape (60 ms).
    for ms, meta, groups, counters in [(10, 3, 0.2, ["forward_replays"])] * 5 + [
            (40, 30, 0.2, ["forward_replays"]), (30, 3, 20, ["forward_replays"]), (100, 3, 0.2, ["captures"]),
            (10, 3, 0.2, ["forward_replays"]), (60, 3, 50, ["forward_replays", "group_captures"])]:
        line = step(t, 128, c)
        line.update(meta_ms=meta, host_groups_ms=groups)
        lines.append(line)
        for counter in counters:
            c[counter] += 28 if counter in ("captures", "group_captures") else 1
        t += ms / 1000
    lines.append({"t": t, "mode": "extend", "bs": 1, "tokens": 64, "counters": dict(c)})
    budget = capture_churn.time_budget(lines)
    assert budget["median_step_ms"] == 10.0 and budget["decode_s"] == 0.29 and budget["steady_s"] == 0.1
    assert budget["excess_s"] == {"segment_capture": 0.09, "group_capture": 0.05, "host metadata": 0.03,
                                  "host groups": 0.02}
    assert budget["median_step_tokens_per_s"] == 12800.0
    assert budget["whole_run_tokens_per_s"] == round(10 * 128 / 0.29, 1)
    assert budget["below_median_s"] == 0.0  # no step faster than the median


def test_the_time_budget_counts_what_steps_below_the_median_saved():
    # Three replays of 10 ms and two of 1 ms (a step of few rows under
    # traffic): 5 x 10 ms at the median is more than the 32 ms decoded, by
    # the 18 ms the fast steps saved.
    c = {"forward_replays": 0}
    lines, t = [], 0.0
    for ms in (10, 10, 10, 1, 1):
        lines.append(step(t, 128, c))
        c["forward_replays"] += 1
        t += ms / 1000
    lines.append({"t": t, "mode": "extend", "bs": 1, "tokens": 64, "counters": dict(c)})
    budget = capture_churn.time_budget(lines)
    assert budget["steady_s"] == 0.05 and budget["decode_s"] == 0.032 and budget["excess_s"] == {}
    assert budget["below_median_s"] == 0.018


def test_the_step_times_plot_is_written_with_each_logs_budget(tmp_path):
    paths = []
    for name, lines in (("a", log()), ("b", log()[:-2])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
        paths.append(f"{name}={path}")
    out = tmp_path / "times.png"
    proc = subprocess.run([sys.executable, str(REPO / "bench/plot_step_times.py"), str(out), *paths],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    import plot_step_times
    assert [round(t, 6) for t in plot_step_times.step_times(log())] == [20.0] * 5 + [40.0]  # the last step ends at the next extend, two slots later
    bad = subprocess.run([sys.executable, str(REPO / "bench/plot_step_times.py"), str(out), str(tmp_path / "a.jsonl")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "LABEL=path" in bad.stderr


def test_captures_soon_after_a_graph_reset_are_counted_as_the_resets():
    # A width change resets every graph in its step (which then captures);
    # the steps that capture again within RESET_WINDOW steps are the
    # reset's cost, a capture later is not.
    c = {"captures": 0, "replays": 0, "group_captures": 0, "group_replays": 0, "forward_captures": 0,
         "forward_replays": 0, "resets": 0}
    lines, t = [], 0.0
    group_capture = ["forward_replays", "group_captures"]  # a replayed stack whose deferred groups captured
    plan = ([(10, [])] * 5 + [(100, ["resets", "captures"]), (60, group_capture)] + [(10, [])] * 3
            + [(10, [])] * capture_churn.RESET_WINDOW + [(50, group_capture)])
    for ms, counters in plan:
        c["resets"] += "resets" in counters  # in begin_step: this step's line shows it
        lines.append(step(t, 128, c))
        c["forward_replays"] += not counters
        for counter in counters:
            c[counter] += 28 if counter != "resets" else 0
        t += ms / 1000
    lines.append({"t": t, "mode": "extend", "bs": 1, "tokens": 64, "counters": dict(c)})
    budget = capture_churn.time_budget(lines)
    assert budget["median_step_ms"] == 10.0
    assert budget["captures_after_resets_s"] == 0.09 + 0.05  # the reset's step and the capture after it
    assert budget["excess_s"]["group_capture"] == 0.05 + 0.04  # the late one counts there, not as the reset's


def test_a_step_profile_calls_log_is_cut_by_each_runs_wall_clock():
    """--profile: one engine's log holds every run of a step_profile call;
    each run's ramp and the rest are analysed apart by its wall clock (the
    log's clock), and a run without one (an older result) is left out."""
    profile = {"runs": {"mixed": {"wall_clock": {"start": -0.05, "ramp_end": 0.03, "end": 0.07}}, "older": {}}}
    runs = capture_churn.runs_of_profile(log(), profile)
    assert set(runs) == {"mixed"}
    ramp, rest = runs["mixed"]["ramp"], runs["mixed"]["after_ramp"]
    # The ramp: the warm-up's extend and the decode steps at 0.00 and 0.02 (a
    # step's time needs the next forward in the window: the first is timed).
    assert ramp["decode_steps"] == 2 and {k: v["steps"] for k, v in ramp["kinds"].items()} == {"stack_replay": 1}
    # After it: the steps at 0.04 (it captured its segments) and 0.06.
    assert rest["decode_steps"] == 2 and {k: v["steps"] for k, v in rest["kinds"].items()} == {"segment_capture": 1}
    assert capture_churn.between(log(), 0.05, 0.09) == [x for x in log() if 0.05 <= x["t"] < 0.09]
