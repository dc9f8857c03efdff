"""A policy group's CUDA graph replayed on a step with more rows than the
one it was recorded on (tests/helpers/group_rows.py): before graphs were
kept per observation view shape (region_graphs.observation_shape) the replay
gathered the group's rows 192-207 from the recorded 192-row view, a
device-side "index out of bounds" (the rate-12 crash under traffic)."""

import torch

from helpers.group_rows import replay_past_recorded_rows
from kvsieve.radix_ext.region_graphs import RegionGraphs


def test_a_group_graph_reads_the_observations_of_the_step_it_replays_in():
    graphs = RegionGraphs()
    seen, expected = replay_past_recorded_rows(graphs, "cuda")
    torch.cuda.synchronize()
    for got, want in zip(seen, expected):
        assert torch.equal(got, want)
    # One graph per view rows: the second step recorded its own.
    assert graphs.group_captures == 4  # 2 layers x 2 view sizes
