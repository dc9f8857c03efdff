"""bench/step_profile.py: the mixed run's comparison with its members (the
harmonic mean), the graph counters read from prometheus' multiprocess files,
the per-policy split of a trace, and its CPU path end to end (a real engine
on the session's tiny Llama, no profiler)."""

import gzip
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("step_profile", REPO / "bench/step_profile.py")
step_profile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_profile)


def test_harmonic_mean():
    assert step_profile.harmonic_mean([100.0, 100.0]) == pytest.approx(100.0)
    assert step_profile.harmonic_mean([100.0, 300.0]) == pytest.approx(150.0)
    assert step_profile.harmonic_mean([100.0, 300.0], [3, 1]) == pytest.approx(4 / (3 / 100 + 1 / 300))


def test_late_rows_are_those_admitted_well_after_the_median():
    first = [0.5, 0.6, 0.55, 9.0, None]
    rows = ["h2o", "rkv", "h2o", "rkv", "h2o"]
    seen = step_profile.late_rows(first, rows)
    assert seen["median_s"] == 0.6 and seen["last_s"] == 9.0
    assert seen["late"] == [{"row": 3, "policy": "rkv", "first_token_s": 9.0}]
    assert step_profile.late_rows([None], ["h2o"]) == {"median_s": None, "last_s": None, "late": []}


def test_options_log_level():
    argv = ["step_profile.py", "model", "out"]
    assert step_profile.options(argv)["log_level"] == "warning"
    assert step_profile.options(argv + ["--log-level", "info"])["log_level"] == "info"
    with pytest.raises(SystemExit, match="--gen-extra must be above 32"):
        step_profile.options(argv + ["--gen-extra", "16"])  # rows would end before the window's threshold


def test_comparison_of_a_mixed_run_with_its_members():
    runs = {"streaming": {"tokens_per_s_unprofiled": 100.0}, "rkv": {"tokens_per_s_unprofiled": 300.0},
            "mixed:streaming+rkv": {"tokens_per_s_unprofiled": 120.0}}
    out = step_profile.comparison(runs, ["streaming", "rkv"], 4)
    assert out["mixed"] == "mixed:streaming+rkv" and out["mixed_tokens_per_s"] == 120.0
    assert out["members_tokens_per_s"] == {"streaming": 100.0, "rkv": 300.0}
    assert out["members_harmonic_mean_tokens_per_s"] == 150.0 and out["ratio"] == 0.8
    # Rows dealt round robin: 3 of 5 are streaming, and the mean weighs them so.
    assert step_profile.comparison(runs, ["streaming", "rkv"], 5)["member_rows"] == {"streaming": 3, "rkv": 2}
    assert "window_not_full" not in out
    # A run whose batch ended inside its window is named: its rate is a tail's.
    runs["rkv"]["window_full"] = False
    assert step_profile.comparison(runs, ["streaming", "rkv"], 4)["window_not_full"] == ["rkv"]
    # A window that captured the whole step again is named with its count.
    assert "windows_with_captures" not in out
    runs["mixed:streaming+rkv"]["graphs"] = {"forward_captures": 1.0}
    runs["rkv"]["graphs"] = {"forward_captures": 0.0}
    assert step_profile.comparison(runs, ["streaming", "rkv"], 4)["windows_with_captures"] == \
        {"mixed:streaming+rkv": 1.0}
    # No whole-run rates (older results): no whole-run comparison.
    assert "whole_run" not in out and "methods_agree_within_10pct" not in out
    for name, rate in (("streaming", 90.0), ("rkv", 270.0), ("mixed:streaming+rkv", 81.0)):
        runs[name].update(tokens_per_s_whole_run=rate, whole_run_profiled_steps=0)
    out = step_profile.comparison(runs, ["streaming", "rkv"], 4)
    assert out["whole_run"] == {"mixed_tokens_per_s": 81.0, "members_tokens_per_s": {"streaming": 90.0, "rkv": 270.0},
                                "members_harmonic_mean_tokens_per_s": 135.0, "ratio": 0.6}
    assert out["methods_agree_within_10pct"] is False  # 0.6 against the window's 0.8
    runs["mixed:streaming+rkv"].update(tokens_per_s_whole_run=102.6, whole_run_profiled_steps=16)
    out = step_profile.comparison(runs, ["streaming", "rkv"], 4)
    assert out["whole_run"]["ratio"] == 0.76 and out["methods_agree_within_10pct"] is True
    assert out["whole_run"]["runs_with_profiled_steps"] == ["mixed:streaming+rkv"]
    # The whole run in its two phases, where the runs have them: the ramp and after it.
    assert "ramp" not in out["whole_run"]
    for name, ramp, after in (("streaming", 60.0, 120.0), ("rkv", 180.0, 360.0), ("mixed:streaming+rkv", 45.0, 144.0)):
        runs[name].update(tokens_per_s_ramp=ramp, tokens_per_s_after_ramp=after)
    whole = step_profile.comparison(runs, ["streaming", "rkv"], 4)["whole_run"]
    assert whole["ramp"] == {"mixed_tokens_per_s": 45.0, "members_harmonic_mean_tokens_per_s": 90.0, "ratio": 0.5}
    assert whole["after_ramp"] == {"mixed_tokens_per_s": 144.0, "members_harmonic_mean_tokens_per_s": 180.0,
                                   "ratio": 0.8}
    # The profiled steps' GPU busy time a step, where every run has them.
    assert "gpu_busy" not in out
    for name, busy_ms, share in (("streaming", 80.0, 0.95), ("rkv", 40.0, 0.7), ("mixed:streaming+rkv", 72.0, 0.9)):
        runs[name]["profile"] = {"gpu_busy_ms": busy_ms, "steps": 8, "gpu_busy_share": share}
    busy = step_profile.comparison(runs, ["streaming", "rkv"], 4)["gpu_busy"]
    # 10 and 5 ms a step, two rows each: a mix as fast as its members takes 7.5; it takes 9.
    assert busy["members_harmonic_mean_ms_per_step"] == 7.5 and busy["mixed_ms_per_step"] == 9.0
    assert busy["ratio"] == 0.833 and busy["busy_share"]["rkv"] == 0.7
    # A member without a solo run: named, no mean.
    out = step_profile.comparison({"mixed:a+b": {"tokens_per_s_unprofiled": 5.0}, "a": {"tokens_per_s_unprofiled": 5.0}},
                                  ["a", "b"], 2)
    assert out["missing_members"] == ["b"] and "ratio" not in out


def test_resume_keeps_only_runs_made_the_same_way(tmp_path):
    cfg = step_profile.options(["x", "MODEL", "OUT", "--policy", "a,b", "--mixed", "1", "--resume", "1",
                                "--device", "cpu", "--gen-extra", "64"])
    path = tmp_path / "sp.json"
    path.write_text(json.dumps({"config": dict(cfg, resume=False, solo="a"), "runs": {"a": {"x": 1}}}))
    assert step_profile.earlier_runs(str(path), cfg, step_profile.SAME_RUNS)[0] == {"a": {"x": 1}}
    # Another generation length: a --mixed-only call still takes the solo runs, a resumed one does not.
    path.write_text(json.dumps({"config": dict(cfg, gen_extra=32), "runs": {"a": {"x": 1}}}))
    assert step_profile.earlier_runs(str(path), cfg)[0] == {"a": {"x": 1}}
    assert step_profile.earlier_runs(str(path), cfg, step_profile.SAME_RUNS) == ({}, None)
    assert step_profile.run_label(["a"]) == "a" and step_profile.run_label(["a", "b"]) == "mixed:a+b"


def test_options_mixed_only_implies_mixed_and_cpu_defaults():
    cfg = step_profile.options(["x", "MODEL", "OUT", "--policy", "a,b", "--mixed-only", "1", "--device", "cpu"])
    assert cfg["mixed"] and cfg["mixed_only"] and cfg["steps"] == 0 and cfg["requests"] == 4
    cfg = step_profile.options(["x", "MODEL", "OUT"])
    assert not cfg["mixed"] and (cfg["budget"], cfg["requests"], cfg["steps"]) == (1024, 512, 16)
    assert cfg["warmup"] and not step_profile.options(["x", "MODEL", "OUT", "--warmup", "0"])["warmup"]


def test_graph_counters_from_another_process(tmp_path):
    # The scheduler records them in its own process; the bench reads the files.
    code = ("from kvsieve.radix_ext import metrics\n"
            "for _ in range(3): metrics.record_graph_replay('region')\n"
            "metrics.record_graph_capture('region'); metrics.record_graph_replay('forward')\n")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    counters = step_profile.graph_counters(str(tmp_path))
    assert counters == {"region": {"captures": 1.0, "replays": 3.0}, "forward": {"captures": 0.0, "replays": 1.0}}
    rates = step_profile.graph_rates({"region": {"captures": 1.0, "replays": 1.0}}, counters, 4)
    assert rates["region_replays"] == 2.0 and rates["region_replays_per_step"] == 0.5
    assert rates["forward_replays_per_step"] == 0.25 and rates["region_captures"] == 0.0
    assert "note" in step_profile.graph_rates({}, {}, 4)
    assert step_profile.graph_counters(str(tmp_path / "missing")) == {}


def test_every_policy_of_a_mixed_run_shows_in_the_split(tmp_path):
    # Two profiled steps: h2o decides in one, rkv observes in both, `full` has no range.
    def kernel(ts, dur):
        return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur}

    def gpu_range(name, ts, dur):
        return {"ph": "X", "cat": "gpu_user_annotation", "name": name, "ts": ts, "dur": dur}

    events = [kernel(0, 100), kernel(100, 50), kernel(200, 100), kernel(300, 40),
              gpu_range("kvsieve.decide.h2o", 100, 50), gpu_range("kvsieve.observe.rkv", 300, 40),
              gpu_range("kvsieve.observe.rkv", 0, 10),
              {"ph": "X", "cat": "user_annotation", "name": "kvsieve.step_inputs.h2o", "ts": 0, "dur": 8}]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    prof = step_profile.summarize(str(path), 2)
    assert prof["split_per_step_ms"]["decision.h2o"] == 0.025
    assert prof["split_per_step_ms"]["observation.rkv"] == 0.025
    ranges = step_profile.policy_ranges(prof, ["h2o", "rkv", "full"])
    assert ranges["per_policy_ranges_ms"]["h2o"] == {"decide": 0.025, "observe": 0.0, "step_inputs_host": 0.004}
    assert ranges["per_policy_ranges_ms"]["rkv"]["observe"] == 0.025
    assert ranges["policies_without_ranges"] == ["full"]


def test_cpu_path_solo_and_mixed_runs(tmp_path, tiny_llama):
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}  # its own metrics dir

    def call(*extra):
        proc = subprocess.run([sys.executable, str(REPO / "bench/step_profile.py"), str(tiny_llama), str(tmp_path),
                               "--device", "cpu", "--policy", "streaming,crystalcache", "--mixed", "1",
                               "--budget", "8", "--out", "sp.json", *extra],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        return proc, json.loads((tmp_path / "sp.json").read_text())

    # A first call cut short: streaming alone and the mix; the second,
    # resumed, runs only what the first did not (crystalcache alone).
    _, first = call("--solo", "streaming")
    assert set(first["runs"]) == {"streaming", "mixed:streaming+crystalcache"}
    proc, result = call("--resume", "1")
    assert result["runs"]["streaming"] == first["runs"]["streaming"]
    assert result["runs"]["mixed:streaming+crystalcache"] == first["runs"]["mixed:streaming+crystalcache"]
    assert [r["runs"] for r in result["resumed_from"]] == [["mixed:streaming+crystalcache", "streaming"]]
    assert "--solo streaming" in result["resumed_from"][0]["command"]
    assert result["device"] == "cpu"
    assert set(result["runs"]) == {"streaming", "crystalcache", "mixed:streaming+crystalcache"}
    # crystalcache refuses budget 8: it runs at the smallest budget it accepts.
    assert result["policies"]["crystalcache"]["budget"] >= 132
    assert result["runs"]["crystalcache"]["policy"]["budget"] == result["policies"]["crystalcache"]["budget"]
    mixed = result["runs"]["mixed:streaming+crystalcache"]
    assert mixed["member_rows"] == {"streaming": 2, "crystalcache": 2}
    assert mixed["window_budget"] == result["policies"]["crystalcache"]["budget"]
    assert all(r["tokens_per_s_unprofiled"] > 0 and r["graphs"]["steps"] > 0 for r in result["runs"].values())
    comp = result["comparison"]
    assert comp["mixed"] == "mixed:streaming+crystalcache" and comp["ratio"] > 0
    assert all(r["tokens_per_s_whole_run"] > 0 and r["whole_run_s"] > 0 for r in result["runs"].values())
    assert comp["whole_run"]["ratio"] > 0 and isinstance(comp["methods_agree_within_10pct"], bool)
    assert all(r["tokens_per_s_ramp"] > 0 and r["tokens_per_s_after_ramp"] > 0 for r in result["runs"].values())
    # Each run's wall clock (the step log's clock): capture_churn --profile cuts a log by it.
    walls = sorted((r["wall_clock"] for r in result["runs"].values()), key=lambda w: w["start"])
    assert all(w["start"] < w["ramp_end"] <= w["end"] for w in walls)
    assert all(a["end"] <= b["start"] for a, b in zip(walls, walls[1:]))  # one run after another
    assert walls[-1] == result["runs"]["crystalcache"]["wall_clock"]  # the resumed call's run came last
    assert comp["whole_run"]["ramp"]["ratio"] > 0 and comp["whole_run"]["after_ramp"]["ratio"] > 0
    assert comp["members_harmonic_mean_tokens_per_s"] == pytest.approx(step_profile.harmonic_mean(
        [comp["members_tokens_per_s"]["streaming"], comp["members_tokens_per_s"]["crystalcache"]]), abs=0.1)
    # The warm-up batch (the default) ran first, every policy in it, and is no recorded run.
    warm = result["warmup"]
    assert warm["members"] == ["streaming", "crystalcache"] and 0 < warm["ramp_s"] <= warm["whole_run_s"]
    assert warm["wall_clock"]["end"] <= walls[-1]["start"]
    assert "warm-up: 2 policies" in proc.stdout
    # Every row's first token was seen; no row of these small batches came late.
    for run in result["runs"].values():
        first = run["first_tokens"]
        assert 0 < first["median_s"] <= first["last_s"] and first["late"] == []


def test_gaps_are_told_apart_by_when_their_next_operation_was_launched(tmp_path):
    # Kernel 2 was launched (correlation 2) long before the gap before it:
    # the GPU waited on something else. Kernel 3's launch ended inside its gap:
    # the host was late. One blocking synchronization on the host.
    def kernel(ts, dur, corr):
        return {"ph": "X", "cat": "kernel", "name": f"k{corr}", "ts": ts, "dur": dur, "args": {"correlation": corr}}

    def launch(name, ts, dur, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    events = [kernel(0, 100, 1), kernel(300, 100, 2), kernel(1000, 100, 3),
              launch("cudaLaunchKernel", -20, 5, 1), launch("cudaGraphLaunch", 10, 20, 2),
              launch("cudaLaunchKernel", 900, 10, 3),
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 420, "dur": 400}]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    causes = step_profile.summarize(str(path), 1)["gap_causes"]
    assert causes["gap_ms_per_step"] == {"host_late": 0.6, "launched_before": 0.2, "unmatched": 0.0}
    assert causes["gap_ms_per_step_by_launch"] == {"host_late: cudaLaunchKernel": 0.6,
                                                   "launched_before: cudaGraphLaunch": 0.2}
    assert causes["gap_ms_per_step_by_next_op"] == {"k3": 0.6, "k2": 0.2}
    assert causes["host_blocking_calls"] == {"cudaStreamSynchronize": {"per_step_ms": 0.4, "count": 1}}


def test_kernel_sizes_count_the_tiny_kernels_per_step():
    sizes = step_profile.kernel_sizes([2.0, 4.0, 8.0, 40.0, 400.0, 3.0], steps=2)
    assert sizes["kernels_per_step"] == 3.0
    assert sizes["under_5us"] == {"per_step": 1.5, "ms_per_step": 0.0045}
    assert sizes["under_10us"] == {"per_step": 2.0, "ms_per_step": 0.0085}
    assert sizes["under_50us"] == {"per_step": 2.5, "ms_per_step": 0.0285}
