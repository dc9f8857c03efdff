"""bench/client_capacity.py: gpu_replicas' streaming client against a stand-in
server that adds nothing with load, so what it measures is the client."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("client_capacity", REPO / "bench/client_capacity.py")
client_capacity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(client_capacity)


def test_a_short_run_streams_every_request_and_reads_the_stand_ins_timing(tmp_path):
    out = tmp_path / "cap.json"
    assert client_capacity.main(["--rates", "8", "--duration", "2", "--gen-min", "16", "--gen-max", "48",
                                 "--prefill-ms", "40", "--tpot-ms", "5", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    (row,) = record["rates"]
    assert row["requests"] > 0 and row["errors"] == 0 and row["unfinished"] == 0 and not row["cut_off"]
    # Every token arrived, and the first chunk never before the stand-in's pause.
    trace = client_capacity.poisson_trace(8, 2, 16, 48, 768, 0)
    assert row["tokens"] == sum(r["gen"] for r in trace)
    assert 0.04 <= row["ttft_p50_s"] < 1.0
    assert 4.5 <= row["tpot_p50_ms"] < 20


def test_the_trace_is_poisson_arrivals_inside_the_duration():
    trace = client_capacity.poisson_trace(50, 10, 128, 1024, 16, seed=3)
    assert 350 < len(trace) < 650
    assert all(0 < r["arrival"] <= 10 and 128 <= r["gen"] <= 1024 for r in trace)
    assert [r["arrival"] for r in trace] == sorted(r["arrival"] for r in trace)
    assert client_capacity.percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and client_capacity.percentile([], 0.5) is None
