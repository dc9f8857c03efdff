"""bench/graph_buckets.py's group-cache counts: a mix whose group shapes
take turns among more than the cache keeps drops segments and makes them
again; a cache that holds them all makes each once."""

import gzip
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import graph_buckets  # noqa: E402

from kvsieve.radix_ext import region_graphs  # noqa: E402


def test_the_group_cache_bound_decides_evictions_and_recaptures():
    bound = region_graphs.MAX_GROUP_SHAPES
    runs = {n: graph_buckets.simulate("rkv+h2o+streaming", 12, 60, 48, 32, buckets=True, group_shapes=n,
                                      first_sight=True) for n in (2, 256)}
    small, large = runs[2], runs[256]
    assert region_graphs.MAX_GROUP_SHAPES == bound  # a run's bound is its own graphs', not the engine's
    assert (small["group_shapes"], large["group_shapes"]) == (2, 256)
    assert large["group_evictions"] == 0 and large["group_recaptures"] == 0
    assert small["group_evictions"] == small["group_entries"] - 2
    assert small["group_recaptures"] > 0 and small["group_entries"] > large["group_entries"]
    assert small["group_replayed_share"] < large["group_replayed_share"]


def test_a_served_runs_rows_drive_the_workload_and_new_group_keys_are_attributed(tmp_path):
    # A step log's decode steps (compressed rows = region - pool_only):
    # 6 rows, up to 10, down to 3; an extend step and a step without
    # compressed rows are not decode steps with rows.
    lines = [{"mode": "extend", "bs": 1}] + [{"mode": "decode", "region": n + 1, "pool_only": 1} for n in
                                             [6] * 10 + [10] * 10 + [3] * 10] + [{"mode": "decode", "bs": 4}]
    log = tmp_path / "steps.jsonl.gz"
    with gzip.open(log, "wt") as f:
        f.write("\n".join(json.dumps(x) for x in lines) + "\n")
    trace = graph_buckets.read_rows_trace(str(log))
    assert trace == [6] * 10 + [10] * 10 + [3] * 10
    run = graph_buckets.simulate("h2o+streaming", 0, 0, 32, 32, buckets=True, first_sight=True, rows_trace=trace)
    assert run["steps"] == 30 and run["rows_traced"]
    changes = run["new_group_keys_by_change"]
    assert sum(changes.values()) == run["distinct_group_keys"] > 0
    # Joining and leaving requests move the groups across row buckets.
    assert any(k.endswith("rows") or "rows +" in k for k in changes)
    assert all(k.split(": ")[0].split()[0] in ("H2O", "Streaming") for k in changes)


def test_key_changes_name_the_parts_that_differ():
    shapes = (((8,), "i64"), ((8, 4), "b"))
    key = (("H2OPolicy", "decide", 20, (), ("a",), ("keep",), shapes), 0)
    wider = (("H2OPolicy", "decide", 24, (), ("a",), ("keep",), shapes), 0)
    more_rows = (("H2OPolicy", "decide", 20, (), ("a",), ("keep",), (((16,), "i64"), ((16, 4), "b"))), 0)
    longer_input = (("H2OPolicy", "decide", 20, (), ("a",), ("keep",), (((8,), "i64"), ((8, 6), "b"))), 0)
    assert graph_buckets.key_change(key, wider) == "width"
    assert graph_buckets.key_change(key, more_rows) == "rows"
    assert graph_buckets.key_change(key, longer_input) == "input shapes"
    assert graph_buckets.key_change(key, (key[0], 1)) == "ordinal"
