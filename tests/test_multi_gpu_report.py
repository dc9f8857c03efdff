"""bench/multi_gpu_report.py merges gpu_replicas runs that split the set-ups
between device calls (a --deadline skipped one that a later call ran)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "multi_gpu_report", Path(__file__).resolve().parent.parent / "bench" / "multi_gpu_report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def _load(goodput, hit, errors=0):
    return {"goodput_tok_s": goodput, "radix_hit_rate": hit, "errors": errors}


def test_a_later_run_fills_the_skipped_set_up_and_its_kill_test():
    first = {"command": "a", "elapsed_s": 300.0, "setups": {
        "n1-prefix": {"replicas": 1, "routing": "prefix", "load": _load(5000.0, 0.30)},
        "n2-prefix": {"replicas": 2, "routing": "prefix", "status": "skipped"},
        "n2-pow2": {"replicas": 2, "routing": "pow2", "load": _load(9000.0, 0.25)}},
        "kill": {"ok": False, "error": "not run (its set-up failed or was skipped)"}, "ok": False}
    second = {"command": "b", "elapsed_s": 200.0, "setups": {
        "n2-prefix": {"replicas": 2, "routing": "prefix", "load": _load(9500.0, 0.40)}},
        "kill": {"setup": "n2-prefix", "ok": True}, "ok": True}
    merged = report.merge_replicas([first, second])
    assert merged["setups"]["n2-prefix"]["load"]["goodput_tok_s"] == 9500.0
    assert merged["scaling"] == {"1": {"prefix": 1.0}, "2": {"prefix": 1.9, "pow2": 1.8}}
    assert merged["radix_hit_rate"] == {"n1-prefix": 0.30, "n2-prefix": 0.40, "n2-pow2": 0.25}
    assert merged["kill"] == {"setup": "n2-prefix", "ok": True}
    assert merged["ok"] is True and merged["commands"] == ["a", "b"] and merged["elapsed_s"] == 500.0
    assert first["setups"]["n2-prefix"]["status"] == "skipped"  # the inputs are left as they were


def test_a_set_up_with_errors_or_no_kill_test_is_not_ok():
    run = {"command": "a", "elapsed_s": 1.0, "setups": {
        "n1-prefix": {"replicas": 1, "routing": "prefix", "load": _load(5000.0, 0.3)},
        "n2-prefix": {"replicas": 2, "routing": "prefix", "load": _load(9000.0, 0.4, errors=2)}},
        "kill": {"setup": "n2-prefix", "ok": True}}
    assert report.merge_replicas([run, {"command": "b", "setups": {}, "kill": None}])["ok"] is False
    run["setups"]["n2-prefix"]["load"]["errors"] = 0
    run["kill"] = {"ok": False, "error": "not run"}
    assert report.merge_replicas([run, {"command": "b", "setups": {}, "kill": None}])["ok"] is False


_plot_spec = importlib.util.spec_from_file_location(
    "plot_multi_gpu", Path(__file__).resolve().parent.parent / "bench" / "plot_multi_gpu.py")
plot_multi_gpu = importlib.util.module_from_spec(_plot_spec)
_plot_spec.loader.exec_module(plot_multi_gpu)


def test_the_plot_scales_each_host_by_its_own_single_replica_and_draws(tmp_path):
    load = lambda goodput, ttft: {"goodput_tok_s": goodput, "ttft_p50_s": ttft}  # noqa: E731
    run = {"device": "4 x GPU", "date": "2026-11-28T05:23", "setups": {
        "n4-prefix": {"replicas": 4, "routing": "prefix", "load": load(18000.0, 2.3)},
        "n1-prefix": {"replicas": 1, "routing": "prefix", "load": load(5000.0, 0.1)},
        "n4-pow2": {"replicas": 4, "routing": "pow2", "load": load(17000.0, 2.0)},
        "n2-prefix": {"replicas": 2, "routing": "prefix", "status": "skipped"}}}
    assert plot_multi_gpu.scaling_points(run) == [(1, 1.0, 0.1), (4, 3.6, 2.3)]
    assert plot_multi_gpu.scaling_points({"setups": {}}) == []
    workloads = lambda solo, mixed: [{"name": "solo:h2o", "tokens_per_s": solo}, {"name": "solo:rkv",  # noqa: E731
                                                                                    "tokens_per_s": solo + 2},
                                     {"name": "mixed", "tokens_per_s": mixed}]
    tp = {"tp_points": {"tp1": {"device": "GPU", "headline": [{"policy": "streaming", "tokens_per_s": 100.0}],
                                "workloads": workloads(10.0, 8.0)},
                        "tp2": {"headline": [{"policy": "streaming", "tokens_per_s": 40.0}],
                                "workloads": workloads(4.0, 4.0)}}}
    assert plot_multi_gpu.tp_bars(tp) == [("headline\nstreaming", 100.0, 40.0), ("gate solos\n(mean)", 11.0, 5.0),
                                          ("gate\nmixed", 8.0, 4.0)]
    out = tmp_path / "plot.png"
    plot_multi_gpu.plot([run], tp, out)
    assert out.stat().st_size > 10_000
