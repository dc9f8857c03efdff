"""The host side of the compressed decode pass's CUDA graphs
(radix_ext/region_graphs.py): which steps are captured, under which key,
and that a later step of the same shapes reuses the entry with its metadata
copied in. tests/test_region_pass.py runs the pass on the captured static
tensors against the eager pass on CPU; recording and replaying a CUDA graph
needs a GPU (tests_gpu/test_region_pass_cuda.py)."""

from types import SimpleNamespace

import pytest
import torch

from kvsieve.policies import get_policy
from kvsieve.radix_ext.region_graphs import (
    RegionGraphs, first_sight_enabled, group_signature, group_tensors, signature, step_tensors)

from helpers.group_rows import replay_past_recorded_rows
from test_step_meta import admit, decode_batch, runtime  # noqa: F401  (fixture)

#: A streaming row that decides every step (its default decides every 16th): a group in each step.
EVERY_STEP_STREAMING = {"name": "streaming", "budget": 8, "params": {"buffer": 1}}



@pytest.fixture
def builder(runtime):
    """The step builder on the real page manager (test_step_meta's fixture)."""
    return runtime


def test_steps_of_the_same_shapes_share_one_entry_with_fresh_metadata(builder):
    for rid, row in (("a", 3), ("b", 5)):
        admit(rid, {"name": "h2o", "budget": 8}, prompt_len=5, row=row).prefix_len = 5
    graphs = RegionGraphs()
    first = builder.build(decode_batch(["a", "b"], [3, 5], [6, 6]))
    graphs.begin_step(first, needs_keys=False)
    assert graphs.current is None  # shapes seen once run eagerly
    graphs.begin_step(first, needs_keys=False)
    entry = graphs.current
    assert entry is not None and entry.step.region.batch_index.tolist() == [0, 1]
    assert entry.step.region.positions.tolist() == [5, 5]
    # The next step: same shapes, new positions and decode steps, rows swapped in the batch.
    second = builder.build(decode_batch(["b", "a"], [5, 3], [7, 7]))
    assert signature(second, False) == signature(first, False)
    graphs.begin_step(second, needs_keys=False)
    assert graphs.current is entry and len(graphs.cache) == 1
    assert graphs.batch_index.tolist() == [0, 1]
    for static, fresh in zip(entry.tensors, step_tensors(second)):
        assert torch.equal(static, fresh) and static.data_ptr() != fresh.data_ptr()
    assert entry.step.region.pool_rows.tolist() == [5, 3]
    # The group's segment: its static tensors are views of one buffer,
    # refilled by one copy from the bytes the step shipped its group in.
    ((group, gentry),) = graphs.step_groups
    assert group.packed is not None and gentry.arena.numel() == group.packed.numel()
    third = builder.build(decode_batch(["a", "b"], [3, 5], [9, 8]))
    graphs.begin_step(third, needs_keys=False)
    ((group, same),) = graphs.step_groups
    assert same is gentry and group.step.tolist() == [3, 2]
    for static, fresh in zip(group_tensors(gentry.group), group_tensors(group)):
        assert torch.equal(static, fresh) and static.data_ptr() != fresh.data_ptr()
        assert gentry.arena.data_ptr() <= static.data_ptr() < gentry.arena.data_ptr() + gentry.arena.numel()


@pytest.mark.parametrize("env, first_sight", [(None, True), ("1", True), ("0", False)])
def test_new_shapes_are_captured_at_first_sight_where_asked(builder, monkeypatch, env, first_sight):
    """KVSIEVE_CAPTURE_FIRST_SIGHT (default 1): a step of new shapes gets its
    attention and group entries at once (captured in that step) instead of
    running eagerly until the shapes come back."""
    if env is None:
        monkeypatch.delenv("KVSIEVE_CAPTURE_FIRST_SIGHT", raising=False)
    else:
        monkeypatch.setenv("KVSIEVE_CAPTURE_FIRST_SIGHT", env)
    assert first_sight_enabled() is first_sight
    admit("a", {"name": "h2o", "budget": 8}, prompt_len=5, row=3).prefix_len = 5
    admit("b", EVERY_STEP_STREAMING, prompt_len=5, row=5).prefix_len = 5
    graphs = RegionGraphs()
    graphs.first_sight = first_sight_enabled()
    step = builder.build(decode_batch(["a", "b"], [3, 5], [8, 6]))
    graphs.begin_step(step, needs_keys=False)
    entries = [entry for _, entry in graphs.step_groups]
    if first_sight:
        assert graphs.current is not None and len(graphs.cache) == 1
        assert len(entries) == 2 and all(e is not None for e in entries) and len(graphs.groups) == 2
    else:
        assert graphs.current is None and not graphs.cache and not graphs.groups and entries == []
    # The old rule: the attention entry at the second step, the groups
    # (looked at only in steps with one) at the third; first sight reuses its entries.
    for seq, groups in ((9, 2 if first_sight else 0), (10, 2)):
        graphs.begin_step(builder.build(decode_batch(["a", "b"], [3, 5], [seq, seq - 2])), needs_keys=False)
        assert graphs.current is not None and len(graphs.cache) == 1 and len(graphs.groups) == groups
    if first_sight:
        assert [entry for _, entry in graphs.step_groups] == entries


def test_a_bad_first_sight_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("KVSIEVE_CAPTURE_FIRST_SIGHT", "yes")
    with pytest.raises(ValueError, match="KVSIEVE_CAPTURE_FIRST_SIGHT"):
        first_sight_enabled()


def test_new_shapes_make_a_new_entry_and_an_unsafe_policy_runs_eagerly_between_segments(builder, monkeypatch):
    admit("a", {"name": "h2o", "budget": 8}, prompt_len=5, row=3).prefix_len = 5
    admit("b", EVERY_STEP_STREAMING, prompt_len=5, row=5).prefix_len = 5
    graphs = RegionGraphs()
    for fb in (decode_batch(["a"], [3], [6]), decode_batch(["a"], [3], [7]),
               decode_batch(["a", "b"], [3, 5], [8, 6]), decode_batch(["a", "b"], [3, 5], [9, 7])):
        graphs.begin_step(builder.build(fb), needs_keys=False)
    assert len(graphs.cache) == 2  # one row, then two
    # Groups are looked at in steps whose attention entry exists: h2o's
    # (one row) in the 2nd and 4th (an entry), streaming's in the 4th only.
    assert len(graphs.groups) == 1
    monkeypatch.setattr(get_policy("streaming"), "graph_safe", False)
    step = builder.build(decode_batch(["a", "b"], [3, 5], [8, 7]))
    # The attention segment and h2o's group replay; streaming's group runs eagerly between them.
    assert signature(step, False) is not None
    assert [group_signature(g) is None for g in step.region.groups] == [False, True]
    graphs.begin_step(step, needs_keys=False)
    assert graphs.current is not None
    assert [entry is None for _, entry in graphs.step_groups] == [False, True]
    assert graphs.static_step() is None  # so the decoder stack is not replayed whole
    # A step with rows being aborted runs eagerly as a whole.
    step.zero_batch_index = torch.tensor([0])
    assert signature(step, False) is None
    graphs.begin_step(step, needs_keys=False)
    assert graphs.current is None
    assert graphs.run(None, SimpleNamespace(layer_id=0), None, None, None, None) is False


def test_a_new_page_table_width_drops_every_graph_and_its_pool(builder):
    # Graphs of the old width are not replayed again, and a pool kept across
    # widths holds a segment per width: a new width starts afresh.
    admit("a", {"name": "h2o", "budget": 8}, prompt_len=5, row=3).prefix_len = 5
    graphs = RegionGraphs()
    dropped = []
    graphs.on_reset.append(lambda: dropped.append(True))
    for seq in (6, 7, 8):
        graphs.begin_step(builder.build(decode_batch(["a"], [3], [seq])), needs_keys=False)
    assert graphs.cache and graphs.groups and graphs.resets == 0
    graphs.pool = "the old pool"
    wide = builder.build(decode_batch(["a"], [3], [9]))
    wide.region.tables = torch.cat([wide.region.tables, wide.region.tables], dim=3)  # one more page column
    graphs.begin_step(wide, needs_keys=False)
    assert not graphs.cache and not graphs.groups and graphs.current is None
    assert graphs.resets == 1 and dropped == [True] and graphs.pool is None


def test_a_group_segment_reads_the_observations_of_the_step_it_replays_in():
    """A policy group's graph records the observation views it was given,
    [rows, H, slots] where rows follows the step's row count; a later step
    with more rows keeps the group's shapes, so the group replays, with its
    rows past the recorded view (the rate-12 crash on an H200: a device-side
    "index out of bounds"; here the rerun replay raised IndexError). Graphs
    are kept per view shape (region_graphs.observation_shape)."""
    graphs = RegionGraphs(rerun=True)
    seen, expected = replay_past_recorded_rows(graphs, "cpu")
    assert len(seen) == len(expected) == 2
    for got, want in zip(seen, expected):
        assert torch.equal(got, want)
    assert graphs.group_captures == 4  # 2 layers, recorded once per view rows (192 and 256)
