"""radix_ext/step_log.py: the per-forward log's summary splits time by mode
and by what the graphs did, from consecutive lines' times and counters."""

import json
import time
from types import SimpleNamespace

import torch

from kvsieve.radix_ext import step_log


def _line(t, mode, counters=None, region=None, tokens=None, eager_groups=None):
    line = {"t": t, "mode": mode, "bs": 4}
    if counters is not None:
        line["counters"] = counters
    if region is not None:
        line.update(region=region, padded=16, width=8, groups=2)
    if tokens is not None:
        line["tokens"] = tokens
    if eager_groups is not None:
        line["eager_groups"] = eager_groups
    return line


def _counters(captures=0, replays=0, group_captures=0, group_replays=0, resets=0, fc=0, fr=0):
    return {"captures": captures, "replays": replays, "group_captures": group_captures,
            "group_replays": group_replays, "resets": resets, "forward_captures": fc, "forward_replays": fr}


def test_time_goes_to_modes_and_decode_kinds_by_counter_deltas():
    lines = [
        _line(0.0, "extend", _counters(), tokens=100),                  # 0.2 s prefill
        _line(0.2, "decode", _counters(), region=4),                    # eager: nothing moved
        _line(0.25, "decode", _counters(), region=4),                   # captures 28 layers
        _line(0.45, "decode", _counters(captures=28, group_captures=56), region=4),  # replays segments
        _line(0.47, "decode", _counters(28, 28, 56, 56), region=4, eager_groups=1),  # partly eager
        dict(_line(0.50, "decode", _counters(28, 56, 56, 84), region=4),  # whole stack replay
             meta_ms=1.5, gpu_stack_ms=6.0, gpu_groups_ms=2.5),
        _line(0.51, "decode", _counters(28, 56, 56, 84, fr=1), region=4),  # 3 s: slow (a compile)
        _line(3.51, "extend", _counters(28, 56, 56, 84, fr=1), tokens=50),
        _line(3.60, "decode", _counters(28, 56, 56, 84, fr=1), region=5),
    ]
    out = step_log.summarize(lines)
    assert out["forwards"] == 9
    assert out["modes"]["extend"] == {"steps": 2, "s": 0.29, "max_ms": 200.0, "slow": 0, "tokens": 150,
                                      "ms_per_step": 145.0}
    assert out["modes"]["decode"]["steps"] == 6 and out["modes"]["decode"]["slow"] == 1  # the last line has no end
    assert out["modes"]["decode"]["max_ms"] == 3000.0
    kinds = out["decode_kinds"]
    assert kinds["eager"]["steps"] == 2 and kinds["eager"]["ms_per_step"] == 1525.0 and kinds["eager"]["slow"] == 1
    assert kinds["segment_capture"] == {"steps": 1, "s": 0.2, "max_ms": 200.0, "slow": 0, "ms_per_step": 200.0}
    assert kinds["segments_replay"]["steps"] == 1 and kinds["segments_partly_eager"]["steps"] == 1
    assert kinds["stack_replay"]["steps"] == 1 and kinds["stack_replay"]["ms_per_step"] == 10.0
    # Its parts' times, where the lines carry them.
    assert (kinds["stack_replay"]["meta_ms_mean"], kinds["stack_replay"]["gpu_stack_ms_mean"],
            kinds["stack_replay"]["gpu_groups_ms_mean"]) == (1.5, 6.0, 2.5)
    assert "meta_ms_mean" not in kinds["eager"]
    assert out["graph_counters"]["captures"] == 28 and out["graph_counters"]["forward_replays"] == 1
    assert out["decode_widths"] == [8] and out["decode_region_rows_mean"] == 4.0


def test_the_window_keeps_forwards_that_start_inside_it():
    lines = [_line(float(t), "decode", _counters(), region=2) for t in range(10)]
    out = step_log.summarize(lines, start=3.0, end=7.0)
    assert out["forwards"] == 4 and out["modes"]["decode"]["steps"] == 3


def test_a_record_is_one_json_line_per_forward(tmp_path):
    path = tmp_path / "steps.jsonl"
    log = step_log.StepLog(str(path))
    mode = SimpleNamespace(is_decode=lambda: False, is_extend=lambda: True)
    fb = SimpleNamespace(forward_mode=mode, batch_size=3, extend_seq_lens_cpu=[5, 6, 7])
    groups = [SimpleNamespace(policy=SimpleNamespace(name=name), width=w) for name, w in
              (("rkv", 4), ("h2o", 6), ("rkv", 4))]
    region = SimpleNamespace(real=2, pool_rows=torch.zeros(16), tables=torch.zeros(16, 2, 2, 12), groups=groups,
                             pool_only=1, prefix_slots=torch.zeros(16, 256), observed_slots=96)
    graphs = SimpleNamespace(captures=1, replays=2, group_captures=3, group_replays=4, resets=5, group_entries=6,
                             group_evictions=7, group_recaptures=8, group_stale=9, table_version=10, current=None,
                             defer_step=True)
    log.record(fb, SimpleNamespace(region=region), graphs, None, meta_ms=1.25)
    log.mark("forward")
    time.sleep(0.01)
    log.mark("stack")
    log.mark("end")
    assert step_log.read(str(path)) == []  # a forward's line is written once its times are known
    log.record(fb, None, None, None)
    log.mark("forward")  # no stack mark: no stack time
    log.close()
    first, second = step_log.read(str(path))
    assert first["meta_ms"] == 1.25 and first["host_stack_ms"] >= 10 and first["host_groups_ms"] >= 0
    assert "host_stack_ms" not in second and "meta_ms" not in second
    assert first["mode"] == "extend" and first["tokens"] == 18 and first["bs"] == 3
    assert (first["region"], first["padded"], first["width"], first["groups"]) == (2, 16, 12, 3)
    assert (first["pool_only"], first["prefix"]) == (1, 256)
    # What decides whether the groups run after the stack: the slots kept of each row, each group's columns.
    assert first["observed_slots"] == 96 and first["deferred"] is True
    assert first["group_widths"] == [["h2o", 6], ["rkv", 4]]
    assert first["counters"] == {"captures": 1, "replays": 2, "group_captures": 3, "group_replays": 4, "resets": 5,
                                 "group_entries": 6, "group_evictions": 7, "group_recaptures": 8, "group_stale": 9,
                                 "table_version": 10}
    assert "region" not in second and "counters" not in second
    assert json.loads(path.read_text().splitlines()[0]) == first


def test_the_step_parts_plot_reads_replayed_steps_by_band_of_rows(tmp_path):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("plot_step_parts",
                                                  Path(__file__).parents[1] / "bench/plot_step_parts.py")
    parts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parts)
    lines = []
    for i in range(6):  # 10-row steps 40 ms apart, the stack replayed in each
        line = _line(0.04 * i, "decode", _counters(fr=i), region=10)
        lines.append(dict(line, pool_only=1, meta_ms=5.0, gpu_stack_ms=10.0, gpu_groups_ms=15.0 + i))
    lines.append(_line(0.24, "decode", _counters(fr=5), region=10))  # no replay in the step before it ends
    lines.append(_line(2.0, "extend", _counters(fr=5), tokens=10))
    steps = parts.replayed_steps(lines)
    assert len(steps) == 5 and round(steps[0]["step_ms"]) == 40  # the sixth: its stack did not replay
    (band,) = parts.bands(steps)
    assert band["rows"] == "1-19" and band["steps"] == 5 and band["gpu_groups_ms"] == 17.0
    assert band["rest_ms"] == round(40 - 5 - 10 - 17, 1)
    parts.plot(parts.bands(steps), str(tmp_path / "parts.png"), "t")
    assert (tmp_path / "parts.png").stat().st_size > 1000


def test_a_forward_names_the_triton_kernels_compiled_in_it(tmp_path, monkeypatch):
    from triton import knobs

    # The log chains Triton's JIT hooks; put back whatever was there after the test.
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    path = tmp_path / "steps.jsonl"
    log = step_log.StepLog(str(path))
    mode = SimpleNamespace(is_decode=lambda: True, is_extend=lambda: False)
    fb = SimpleNamespace(forward_mode=mode, batch_size=2)
    fn = SimpleNamespace(name="_partial_kernel")
    log.record(fb, None, None, None)
    # Triton calls its hooks with keywords around each compile (runtime/jit.py _do_compile).
    assert not knobs.runtime.jit_cache_hook(key=("spec", 1), repr="r", fn=fn, compile={}, is_manual_warmup=False,
                                            already_compiled=False)
    time.sleep(0.02)
    knobs.runtime.jit_post_compile_hook(key=("spec", 1), repr="r", fn=fn, compile={}, is_manual_warmup=False,
                                        already_compiled=False)
    log.record(fb, None, None, None)  # nothing compiles in this one
    log.close()
    first, second = step_log.read(str(path))
    assert [c["kernel"] for c in first["compiles"]] == ["_partial_kernel"] and first["compiles"][0]["s"] >= 0.02
    assert first["compiles"][0]["key"] == str(("spec", 1))  # which variant compiled
    assert "compiles" not in second
    summary = step_log.summarize([first, second])
    assert summary["compiles"]["count"] == 1 and summary["compiles"]["kernels"] == {"_partial_kernel": 1}


def test_a_replayed_stack_whose_deferred_groups_captured_is_a_group_capture():
    # The stack replays; a group past it (a policy's first decision) meets a
    # new shape and captures its segments: the step's time is that capture's.
    lines = [
        _line(0.0, "decode", _counters(28, 28, 56, 56, fr=1), region=4),
        _line(0.08, "decode", _counters(28, 28, 60, 56, fr=2), region=4),
        _line(0.09, "decode", _counters(28, 28, 60, 56, fr=3), region=4),
        _line(0.10, "decode", _counters(28, 28, 60, 56, fr=4), region=4),
    ]
    kinds = step_log.summarize(lines)["decode_kinds"]
    assert {k: v["steps"] for k, v in kinds.items()} == {"stack_replay": 2, "group_capture": 1}
    assert kinds["group_capture"]["max_ms"] == 80.0
