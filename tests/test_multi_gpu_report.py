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
