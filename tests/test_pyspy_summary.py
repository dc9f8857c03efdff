"""bench/pyspy_summary.py: shares of py-spy's collapsed stacks, by function
and by leaf line, and the waits named with the frame that waits."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import pyspy_summary  # noqa: E402

RAW = """\
thread (1): MainThread;event_loop (sglang/srt/managers/scheduler.py:10);build (/x/radix_ext/step_meta.py:626);_region_rows (/x/radix_ext/step_meta.py:500) 30
thread (1): MainThread;event_loop (sglang/srt/managers/scheduler.py:10);build (/x/radix_ext/step_meta.py:626);_region_rows (/x/radix_ext/step_meta.py:511) 10
thread (1): MainThread;event_loop (sglang/srt/managers/scheduler.py:12);after_step (/x/radix_ext/runtime.py:400);cudaStreamSynchronize (libcudart.so) 40
thread (1): MainThread;event_loop (sglang/srt/managers/scheduler.py:14);sample (sglang/srt/layers/sampler.py:5) 15
thread (1): MainThread;event_loop (sglang/srt/managers/scheduler.py:16);_select_prompt (/x/radix_ext/backend.py:700) 5
thread (2): Thread-1 (_watchdog_thread);wait (threading.py:331) 500
"""


def test_the_main_thread_shares_by_function_leaf_and_wait(tmp_path):
    path = tmp_path / "raw.txt"
    path.write_text(RAW)
    result = pyspy_summary.summarize(pyspy_summary.read(str(path), thread="MainThread"))
    assert result["samples"] == 100  # the watchdog thread's 500 left out
    inclusive = {row["name"]: row["share"] for row in result["inclusive"]}
    assert inclusive["build (radix_ext/step_meta.py)"] == 0.4  # both lines of _region_rows under it
    assert inclusive["event_loop (managers/scheduler.py)"] == 1.0
    leaves = {row["name"]: row["share"] for row in result["leaves"]}
    assert leaves["_region_rows (radix_ext/step_meta.py:500)"] == 0.3
    assert leaves["_region_rows (radix_ext/step_meta.py:511)"] == 0.1
    waits = {row["name"]: row["share"] for row in result["waits"]}
    # A frame whose name only contains a wait's (`_select_prompt`) is no wait.
    assert waits == {"cudaStreamSynchronize <- after_step (radix_ext/runtime.py)": 0.4}


def test_every_thread_without_a_filter(tmp_path):
    path = tmp_path / "raw.txt"
    path.write_text(RAW)
    result = pyspy_summary.summarize(pyspy_summary.read(str(path)))
    assert result["samples"] == 600
    assert result["waits"][0]["name"].startswith("wait <- ")
