"""The compressed decode pass outside SGLang, on CPU (tests/helpers/
region_pass.py: the real page manager, step builder and backend pass), for
every policy marked `graph_safe`:

* the pass holds each policy's ceiling of private tokens per (layer, head);
* the captured-graph path of radix_ext/region_graphs.py (metadata copied
  into an entry's static tensors, q/k/v rows in, output rows out) equals the
  eager pass bit for bit in every layer's output and the region's final
  state; skipkv also with redundant sentences, so that whole sentences go.

Recording a CUDA graph needs a GPU: here a replay runs the same pass again
on the entry's static tensors, which is what a replay executes. On a GPU,
tests_gpu/test_region_pass_cuda.py checks real capture and replay, and that
the pass makes no host sync (its README gives the command)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvsieve.policies import get_policy, policy_names
from kvsieve.radix_ext.region_graphs import RegionGraphs

from helpers.region_pass import TINY, random_qkv, redundant_sentences, region_pass, run_steps

GRAPH_SAFE = [n for n in policy_names() if get_policy(n).compresses and get_policy(n).graph_safe]
# rkv and skipkv decide every 16 steps: 48 steps hold three decisions.
ROWS, PROMPT, STEPS, BUDGET = 3, 8, 48, 8


class RerunGraphs(RegionGraphs):
    """RegionGraphs whose "graph" replays by running the captured pass again
    on the entry's static tensors (the one part, CUDA recording, that needs a GPU)."""

    def capture(self, static_pass):
        return SimpleNamespace(replay=static_pass)


@pytest.mark.parametrize("policy", GRAPH_SAFE)
def test_the_pass_holds_the_policy_ceiling(policy):
    steps, budget = 16, 8
    run = region_pass(policy, rows=3, prompt=8, steps=steps, shapes=TINY, budget=budget, device="cpu",
                      dtype=torch.float32)
    try:
        gen = torch.Generator().manual_seed(0)
        for s in range(steps):
            out = run.step(s, *random_qkv(3, TINY, gen, "cpu", torch.float32))
            assert out.shape == (TINY.layers, 3, TINY.q_heads, TINY.head_dim)
            assert torch.isfinite(out).all()
        held = run.held_tokens_per_head()
        if policy == "snapkv":  # selects at prefill only: every generated token stays
            assert held == [steps] * 3
        else:  # at most the policy's ceiling per (layer, kv head): the budget, its slack and the new token
            cls = get_policy(policy)
            ceiling = cls().max_private_tokens(cls.Params(), 0, steps, budget)
            assert all(n <= ceiling for n in held) and max(held) > 0
    finally:
        run.close()


def _assert_static_entries_equal_the_eager_pass(policy: str) -> None:
    args = dict(rows=ROWS, prompt=PROMPT, steps=STEPS, shapes=TINY, budget=BUDGET, device="cpu",
                dtype=torch.float32)
    eager = run_steps(policy, **args)
    graphed = run_steps(policy, **args, graphs=RerunGraphs())
    captures, replays = graphed["captures_replays"]
    # Shapes change on the steps where a policy's deciding rows change;
    # most steps replay.
    assert captures >= TINY.layers and replays > TINY.layers * STEPS // 2
    assert torch.equal(eager["outputs"], graphed["outputs"])
    for a, b in zip(eager["state"], graphed["state"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("policy", GRAPH_SAFE)
def test_the_pass_on_captured_static_tensors_equals_the_eager_pass(policy):
    _assert_static_entries_equal_the_eager_pass(policy)


def test_crystalcache_replays_the_steps_between_its_breath_cycles_equal_to_the_eager_pass():
    # observe_graph_safe: the observing steps replay; of the two deciding
    # steps of each cycle the keep step is captured too (decide_graph_safe,
    # its table's width in buckets, so later cycles replay it) and the
    # snapshot step runs eagerly. Budget 62 (the floor with no sinks or
    # recent window) and breath 16: cycles at steps 64, 80 and 96 evict.
    args = dict(rows=ROWS, prompt=PROMPT, steps=100, shapes=TINY, budget=62, device="cpu", dtype=torch.float32,
                params={"sinks": 0, "recent": 0, "breath": 16}, token_ids=True)
    eager = run_steps("crystalcache", **args)
    graphs = RerunGraphs()
    graphed = run_steps("crystalcache", **args, graphs=graphs)
    actions = sorted(key[0][1] for key in graphs.groups)
    assert actions == ["decide", "observe"]  # one keep-step segment for every cycle
    captures, replays = graphed["captures_replays"]
    assert captures >= TINY.layers and replays > TINY.layers * 100 // 2
    assert torch.equal(eager["outputs"], graphed["outputs"])
    for a, b in zip(eager["state"], graphed["state"]):
        assert torch.equal(a, b)
    valid = eager["state"][0]
    assert 0 < int(valid.sum()) < ROWS * TINY.layers * TINY.kv_heads * 100  # the cycles evicted


def test_skipkv_on_captured_static_tensors_equals_the_eager_pass_with_redundant_sentences(monkeypatch):
    monkeypatch.setattr(get_policy("skipkv"), "step_inputs", redundant_sentences(PROMPT))
    _assert_static_entries_equal_the_eager_pass("skipkv")


def test_a_mixed_batch_replays_its_segments_equal_to_the_eager_pass():
    # Every graph-safe policy in one batch, two rows each: the groups that
    # decide change from step to step (rkv, skipkv and crystal_kv every 16
    # steps, the others every step), yet the attention segment and each
    # group's segment replay, and every output and the region's state equal
    # the eager pass bit for bit.
    mixed = "+".join(GRAPH_SAFE)
    args = dict(rows=2 * len(GRAPH_SAFE), prompt=PROMPT, steps=STEPS, shapes=TINY, budget=BUDGET, device="cpu",
                dtype=torch.float32)
    eager = run_steps(mixed, **args)
    graphs = RerunGraphs()
    graphed = run_steps(mixed, **args, graphs=graphs)
    assert torch.equal(eager["outputs"], graphed["outputs"])
    for a, b in zip(eager["state"], graphed["state"]):
        assert torch.equal(a, b)
    assert graphs.replays > TINY.layers * STEPS * 3 // 4
    assert graphs.group_replays > TINY.layers * STEPS * len(GRAPH_SAFE) // 2
    assert len(graphs.cache) <= 2 and len(graphs.groups) >= len(GRAPH_SAFE)


def test_a_mixed_batch_with_groups_after_the_stack_equals_the_eager_pass():
    # RegionGraphs.defer_groups (on where whole-stack graphs exist): each
    # layer runs its attention segment only; after the last layer each group
    # runs every layer's pass, replayed as one graph. Same outputs and final
    # region state as the eager per-layer pass, bit for bit.
    mixed = "+".join(GRAPH_SAFE)
    args = dict(rows=2 * len(GRAPH_SAFE), prompt=PROMPT, steps=STEPS, shapes=TINY, budget=BUDGET, device="cpu",
                dtype=torch.float32)
    eager = run_steps(mixed, **args)
    graphs = RerunGraphs()
    graphs.defer_groups = True
    graphed = run_steps(mixed, **args, graphs=graphs)
    assert torch.equal(eager["outputs"], graphed["outputs"])
    for a, b in zip(eager["state"], graphed["state"]):
        assert torch.equal(a, b)
    # Every group's layers run as one "graph": replays count layers, captures too.
    assert graphs.group_replays > TINY.layers * STEPS * len(GRAPH_SAFE) // 2
    assert all({layers for layers, _ in g.graphs} <= {"all"} for g in graphs.groups.values())
    assert graphs.composition == (graphs.composition[0],)  # the stack's key: the attention's shapes alone


def test_a_step_whose_observations_exceed_the_plan_keeps_its_groups_inside_the_layers():
    # memory_plan.deferred_obs_bytes bounds what deferred steps keep: a step
    # over it runs each group in its layer (never found short mid-run).
    args = dict(rows=3, prompt=PROMPT, steps=8, shapes=TINY, budget=BUDGET, device="cpu", dtype=torch.float32)
    eager = run_steps("h2o", **args)
    graphs = RerunGraphs()
    graphs.defer_groups = True
    graphs.plan_observations(budget=1, num_layers=TINY.layers, page_size=16)
    graphed = run_steps("h2o", **args, graphs=graphs)
    assert torch.equal(eager["outputs"], graphed["outputs"])
    assert not graphs.defer_step and graphs.group_replays > 0
    assert all("all" not in {layers for layers, _ in g.graphs} for g in graphs.groups.values())
    # With room for them, the same steps defer.
    graphs = RerunGraphs()
    graphs.defer_groups = True
    graphs.plan_observations(budget=2**30, num_layers=TINY.layers, page_size=16)
    graphed = run_steps("h2o", **args, graphs=graphs)
    assert torch.equal(eager["outputs"], graphed["outputs"])
    assert graphs.defer_step and any("all" in {layers for layers, _ in g.graphs} for g in graphs.groups.values())


def test_a_wide_row_no_group_observes_does_not_keep_the_groups_inside_the_layers():
    # snapkv keeps every generated token (no decode group): its row grows
    # past the h2o rows' budget and sets the step's width. The groups read
    # only their own columns, so only those slots of each row's
    # observations are kept (RegionRows.observed_slots): a plan sized for
    # the h2o rows' width lets the step defer however wide the snapkv row
    # grows. Same outputs and region as the eager pass.
    args = dict(rows=4, prompt=PROMPT, steps=STEPS, shapes=TINY, budget=BUDGET, device="cpu", dtype=torch.float32)
    eager = run_steps("h2o+snapkv", **args)
    graphs = RerunGraphs()
    graphs.defer_groups = True
    h2o_columns = -(-(PROMPT + BUDGET + 16) // 16)  # what an h2o row holds with its slack, rounded up to pages
    graphs.plan_observations(budget=64 * TINY.layers * TINY.kv_heads * h2o_columns * 16 * 4, num_layers=TINY.layers,
                             page_size=16)
    seen = []
    begin = graphs.begin_step

    def record(step, *a, **k):
        begin(step, *a, **k)
        seen.append((step.region.tables.shape[3], step.region.observed_slots, graphs.defer_step))
    graphs.begin_step = record
    graphed = run_steps("h2o+snapkv", **args, graphs=graphs)
    assert torch.equal(eager["outputs"], graphed["outputs"])
    for a, b in zip(eager["state"], graphed["state"]):
        assert torch.equal(a, b)
    width, observed, deferred = seen[-1]
    assert width * 16 > observed  # the snapkv row is wider than any group reads
    assert deferred and all(d for w, o, d in seen if o <= h2o_columns * 16)
