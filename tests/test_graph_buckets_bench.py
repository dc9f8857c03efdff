"""bench/graph_buckets.py's group-cache counts: a mix whose group shapes
take turns among more than the cache keeps drops segments and makes them
again; a cache that holds them all makes each once."""

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
