"""bench/gap_context.py: the frames and runtime calls over a GPU idle gap."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def span(name, cat, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_a_gap_names_the_frames_and_the_wait_over_it(tmp_path):
    # Two kernels 2 ms apart; over the gap the host was in
    # run_batch > build > realloc, where a .cpu() synchronized for 900 us.
    events = [span("gemm", "kernel", 0, 1000), span("copy", "kernel", 3000, 100), span("tiny", "kernel", 3150, 10),
              span("run_batch", "python_function", 500, 3000), span("build", "python_function", 900, 2500),
              span("realloc", "python_function", 1100, 1800), span("other", "python_function", 3200, 100),
              span("cudaStreamSynchronize", "cuda_runtime", 1100, 900), span("cudaLaunchKernel", "cuda_runtime", 2900, 5)]
    trace = tmp_path / "t.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    out = tmp_path / "gaps.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench/gap_context.py"), str(trace), "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["gaps_over_least"] == 1 and result["idle_ms_in_them"] == 2.0  # the 40 us one is under 500 us
    (gap,) = result["gaps"]
    assert (gap["gap_ms"], gap["at_ms"], gap["gpu_before"], gap["gpu_after"]) == (2.0, 1.0, "gemm", "copy")
    assert gap["frames"] == ["run_batch", "build", "realloc"]
    assert gap["runtime_calls"] == [{"name": "cudaStreamSynchronize", "us": 900.0, "at_ms": 1.1}]
