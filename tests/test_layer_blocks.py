"""A policy group's pass over a block of layers as one call (radix_ext/
layer_blocks.py): the block's size from the plan's bounds, the stacked
rows, and on the real pass (tests/helpers/region_pass.py, groups after the
stack, "graphs" that replay by running again) the same outputs and region
state, bit for bit, as the one-layer passes with fewer policy calls; an
out-of-memory stacked pass falls back to one layer at a time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvsieve.policies import get_policy, policy_names
from kvsieve.radix_ext import layer_blocks
from kvsieve.radix_ext.backend import KvsieveAttnBackend
from kvsieve.radix_ext.step_meta import PolicyGroup

from helpers.region_pass import Shapes, run_steps
from test_region_pass import RerunGraphs

FOUR_LAYERS = Shapes(layers=4, q_heads=4, kv_heads=2, head_dim=16)
STACKING = [n for n in policy_names() if get_policy(n).compresses and get_policy(n).graph_safe
            and get_policy(n).decides_layers_apart]
GRAPH_SAFE = [n for n in policy_names() if get_policy(n).compresses and get_policy(n).graph_safe]


def test_every_graph_safe_decode_policy_stacks_but_crystalcache():
    # crystal_kv and thinkv index their per-(row, layer) buffers with
    # batch.row_layers(); crystalcache reads the first layer only and decides
    # whole groups (its breath-cycle snapshot).
    assert set(STACKING) == {"streaming", "h2o", "snapkv", "longflow", "rkv", "skipkv", "crystal_kv", "thinkv"}
    for name in ("crystalcache", "full"):
        assert not get_policy(name).decides_layers_apart


def test_the_block_keeps_within_the_planned_slots_and_key_rows(monkeypatch):
    monkeypatch.delenv(layer_blocks.BLOCK_ENV, raising=False)
    # Unplanned (CPU), no keys: every layer at once.
    assert layer_blocks.block_size(8, 4, 256, 28, None, None) == 28
    # A block's slots (k x rows x heads x slots) stay within the plan's.
    assert layer_blocks.block_size(8, 4, 256, 28, 8 * 4 * 256 * 5, None) == 5
    # A group as large as the plan allows: one layer a pass, as before.
    assert layer_blocks.block_size(640, 4, 256, 28, 640 * 4 * 256, None) == 1
    assert layer_blocks.block_size(640, 4, 256, 28, 100, None) == 1
    # Key readers: the block's rows within what one decision may gather keys for.
    assert layer_blocks.block_size(8, 4, 256, 28, None, 48) == 6
    monkeypatch.setenv(layer_blocks.BLOCK_ENV, "3")
    assert layer_blocks.block_size(8, 4, 256, 28, None, None) == 3
    monkeypatch.setenv(layer_blocks.BLOCK_ENV, "0")
    with pytest.raises(ValueError, match=layer_blocks.BLOCK_ENV):
        layer_blocks.block_size(8, 4, 256, 28, None, None)
    monkeypatch.setenv(layer_blocks.BLOCK_ENV, "all")
    with pytest.raises(ValueError, match=layer_blocks.BLOCK_ENV):
        layer_blocks.max_block(28)


def test_blocks_are_runs_of_consecutive_layers():
    layers = [SimpleNamespace(layer_id=i) for i in (0, 1, 2, 3, 4, 6, 7)]
    ids = [[layer.layer_id for layer in run] for run in layer_blocks.blocks(layers, 3)]
    assert ids == [[0, 1, 2], [3, 4], [6, 7]]
    assert [[x.layer_id for x in run] for run in layer_blocks.blocks(layers, 1)] == [[i] for i in (0, 1, 2, 3, 4, 6, 7)]


def test_the_stacked_table_is_each_layers_rows_in_turn():
    table = torch.arange(5 * 4 * 2 * 6).view(5, 4, 2, 6)  # [rows, layers, heads, columns]
    pool_rows = torch.tensor([3, 1])
    stacked = layer_blocks.stacked_table(table, pool_rows, 1, 3, 4)
    expected = torch.cat([table[pool_rows, layer, :, :4] for layer in (1, 2, 3)])
    assert torch.equal(stacked, expected)


def test_a_group_over_layers_repeats_its_rows_and_takes_each_layers_budget():
    per_layer = torch.arange(2 * 4 * 3).view(2, 4, 3)  # crystal_kv's budgets [rows, layers, heads]
    group = PolicyGroup(policy=get_policy("h2o")(), rows=torch.tensor([5, 2]), budget=torch.tensor([8, 9]),
                        step=torch.tensor([10, 11]), params={"sinks": torch.tensor([1, 2])}, maxima={"sinks": 2},
                        inputs={"budget": per_layer}, pool_rows=torch.tensor([7, 3]), max_rows=9, members=[0, 1],
                        requests=["a", "b"], width=4)
    stacked = group.over_layers([1, 2])
    assert stacked.rows.tolist() == [5, 2, 5, 2] and stacked.pool_rows.tolist() == [7, 3, 7, 3]
    assert stacked.step.tolist() == [10, 11, 10, 11] and stacked.params["sinks"].tolist() == [1, 2, 1, 2]
    assert stacked.requests == ["a", "b"] and stacked.layer_ids == [1, 2] and stacked.width == 4
    budget = stacked.batch(1, 3).budget
    assert torch.equal(budget, torch.cat([per_layer[:, 1], per_layer[:, 2]]))
    # Without per-layer budgets, each row's own for every head.
    group.inputs = {}
    assert group.over_layers([0, 1]).batch(0, 3).budget.tolist() == [[8] * 3, [9] * 3] * 2


def _deferred(policy: str, rows: int, steps: int = 32, **kw) -> dict:
    graphs = RerunGraphs()
    graphs.defer_groups = True
    return run_steps(policy, rows=rows, prompt=8, steps=steps, shapes=FOUR_LAYERS, budget=8, device="cpu",
                     dtype=torch.float32, graphs=graphs, **kw)


def _assert_same(a: dict, b: dict) -> None:
    assert torch.equal(a["outputs"], b["outputs"])
    for x, y in zip(a["state"], b["state"]):
        assert torch.equal(x, y)


def test_a_mixed_batch_stacked_over_layers_equals_one_layer_at_a_time(monkeypatch):
    mixed = "+".join(GRAPH_SAFE)
    rows = 2 * len(GRAPH_SAFE)
    monkeypatch.setenv(layer_blocks.BLOCK_ENV, "1")
    one = _deferred(mixed, rows)
    monkeypatch.setenv(layer_blocks.BLOCK_ENV, "2")
    two = _deferred(mixed, rows)
    monkeypatch.delenv(layer_blocks.BLOCK_ENV)
    every = _deferred(mixed, rows)
    _assert_same(one, two)
    _assert_same(one, every)
    # The stacking policies' calls fall by the block size; the others' stay.
    assert every["policy_calls"] < two["policy_calls"] < one["policy_calls"]
    eager = run_steps(mixed, rows=rows, prompt=8, steps=32, shapes=FOUR_LAYERS, budget=8, device="cpu",
                      dtype=torch.float32)
    _assert_same(eager, every)
    assert any(int(x) > 0 for x in every["state"][3][:, 0])  # the batch evicted


def test_the_plan_bounds_the_block(monkeypatch):
    # A plan with room for one layer of these groups: no stacking, the same calls as block 1.
    monkeypatch.setenv(layer_blocks.BLOCK_ENV, "1")
    one = _deferred("h2o+streaming", 4)
    monkeypatch.delenv(layer_blocks.BLOCK_ENV)
    tight = _deferred("h2o+streaming", 4, pass_slots=1)
    roomy = _deferred("h2o+streaming", 4, pass_slots=2**30)
    _assert_same(one, tight)
    _assert_same(one, roomy)
    assert tight["policy_calls"] == one["policy_calls"] > roomy["policy_calls"]


def test_a_stacked_pass_out_of_memory_runs_its_layers_one_at_a_time(monkeypatch):
    monkeypatch.setenv(layer_blocks.BLOCK_ENV, "1")
    one = _deferred("h2o+rkv", 4)
    monkeypatch.delenv(layer_blocks.BLOCK_ENV)
    real = KvsieveAttnBackend._call_policy
    refused = []

    def short_of_memory(self, group, layer, table, obs, prefill):
        if group.layer_ids is not None:
            refused.append(group.policy.name)
            raise torch.OutOfMemoryError("stacked pass refused (test)")
        return real(self, group, layer, table, obs, prefill)

    monkeypatch.setattr(KvsieveAttnBackend, "_call_policy", short_of_memory)
    fallback = _deferred("h2o+rkv", 4)
    assert set(refused) == {"h2o", "rkv"}
    _assert_same(one, fallback)


def test_a_fault_in_a_stacked_pass_ends_that_groups_requests_only(monkeypatch):
    from kvsieve.radix_ext import faults

    ended = []
    monkeypatch.setattr(faults, "fail_requests", lambda requests, name, stage, exc: ended.append((name, stage)))
    real = KvsieveAttnBackend._call_policy

    def broken_streaming(self, group, layer, table, obs, prefill):
        if group.layer_ids is not None and group.policy.name == "streaming":
            raise RuntimeError("policy bug (test)")
        return real(self, group, layer, table, obs, prefill)

    monkeypatch.setattr(KvsieveAttnBackend, "_call_policy", broken_streaming)
    out = _deferred("h2o+streaming", 4, steps=16)  # streaming decides every 16th step (its buffer)
    assert ended and {name for name, _ in ended} == {"streaming"}
    assert torch.isfinite(out["outputs"]).all()


def test_a_stacked_group_reads_each_layers_query_ring():
    from kvsieve.radix_ext.query_ring import QueryRing

    ring = QueryRing(rows=6, layers=4, q_heads=2, head_dim=3, dtype=torch.float32, device="cpu")
    ring.queries.copy_(torch.randn_like(ring.queries))
    ring.position.copy_(torch.arange(ring.position.numel()).view_as(ring.position))
    backend = object.__new__(KvsieveAttnBackend)
    backend.query_ring = ring
    pool_rows = torch.tensor([4, 1, 2])
    group = SimpleNamespace(layer_ids=[1, 2, 3], pool_rows=layer_blocks.repeat_rows(pool_rows, 3))
    queries, positions = backend._recent_queries(group, SimpleNamespace(layer_id=1))
    assert torch.equal(queries, torch.cat([ring.queries[pool_rows, lid] for lid in (1, 2, 3)]))
    assert torch.equal(positions, torch.cat([ring.position[pool_rows, lid] for lid in (1, 2, 3)]))
    one = SimpleNamespace(layer_ids=None, pool_rows=pool_rows)
    assert torch.equal(backend._recent_queries(one, SimpleNamespace(layer_id=2))[0], ring.queries[pool_rows, 2])


def test_crystal_kv_and_thinkv_record_their_per_layer_state_the_same_stacked(monkeypatch):
    # crystal_kv's CRF sums and thinkv's sparsity are per (row, layer)
    # buffers: a stacked pass writes each row at its own layer.
    from kvsieve.radix_ext.runtime import policy_instance

    crystal, thinkv = policy_instance("crystal_kv"), policy_instance("thinkv")
    monkeypatch.setattr(crystal, "model", SimpleNamespace(num_layers=FOUR_LAYERS.layers, encode=None),
                        raising=False)

    def state(policy: str, block: str, **kw) -> tuple:
        monkeypatch.setenv(layer_blocks.BLOCK_ENV, block)
        crystal._crf_sums, thinkv._sparsity = None, None
        out = _deferred(policy, 4, steps=20, **kw)
        crf = crystal._crf_sums.clone() if crystal._crf_sums is not None else None
        return out, crf, thinkv._sparsity.clone() if thinkv._sparsity is not None else None

    def assert_same_sparsity(a, b):
        # Unbound to a model, the buffer is as wide as the layers seen so far:
        # the one-layer pass has seen fewer when it first records.
        w = min(a.shape[1], b.shape[1])
        assert torch.equal(a[:, :w].isnan(), b[:, :w].isnan()) and torch.equal(a[:, :w].nan_to_num(),
                                                                              b[:, :w].nan_to_num())
        assert a[:, w:].isnan().all() and b[:, w:].isnan().all()

    (one, crf_one, _), (stacked, crf_stacked, _) = state("crystal_kv", "1"), state("crystal_kv", "4")
    _assert_same(one, stacked)
    assert stacked["policy_calls"] < one["policy_calls"]
    assert torch.equal(crf_one, crf_stacked) and crf_one[1:5].abs().sum() > 0
    # thinkv records a layer's sparsity at the first step of each `refresh`
    # steps. The uncalibrated layer set ({0} for this model): only layer 0.
    (one, _, sparsity_one), (stacked, _, sparsity_stacked) = \
        state("thinkv", "1", params={"refresh": 4}), state("thinkv", "4", params={"refresh": 4})
    _assert_same(one, stacked)
    assert_same_sparsity(sparsity_one, sparsity_stacked)
    recorded = ~sparsity_stacked[1:5].isnan()
    assert recorded[:, 0].all() and not recorded[:, 1:].any()
    # A request's own layers (params.layers): each row records those.
    mine = {"refresh": 4, "layers": [1, 3]}
    (one, _, sparsity_one), (stacked, _, sparsity_stacked) = \
        state("thinkv", "1", params=mine), state("thinkv", "4", params=mine)
    _assert_same(one, stacked)
    assert_same_sparsity(sparsity_one, sparsity_stacked)
    recorded = ~sparsity_stacked[1:5].isnan()
    assert recorded[:, [1, 3]].all() and not recorded[:, [0, 2]].any()


def test_a_block_of_layers_observations_is_gathered_in_one_index():
    # The deferred observations of every layer are blocks of one buffer
    # (ObservationBuffers with num_layers): a stacked pass's rows of k
    # layers are one gather of that buffer, equal to a gather a layer and a cat.
    from kvsieve.policies import Observations
    from kvsieve.radix_ext.backend import observed_rows
    from kvsieve.radix_ext.region_graphs import ObservationBuffers

    gen = torch.Generator().manual_seed(0)
    buffers = ObservationBuffers(num_layers=6)
    obs = [buffers.store(Observations(attention=torch.rand(20, 2, 48, generator=gen),
                                      pv_norm=torch.rand(20, 2, 48, generator=gen),
                                      sparsity=torch.rand(20, 2, generator=gen)), layer, slots=40)
           for layer in range(6)]
    assert buffers.generation == 3  # one buffer a kind, not one a kind and layer
    block = obs[1:5]
    assert layer_blocks.layer_run([o.attention for o in block]) is not None
    assert layer_blocks.layer_run([obs[0].attention, obs[2].attention]) is None  # not consecutive
    rows = torch.tensor([7, 0, 19, 3])
    for name in ("h2o", "rkv", "thinkv", "crystal_kv", "longflow"):
        policy = get_policy(name)
        got = layer_blocks.observed_block(policy, block, rows, 32)
        per_layer = [observed_rows(policy, o, rows, 32) for o in block]
        for kind in ("attention", "pv_norm", "sparsity"):
            want = [getattr(p, kind) for p in per_layer]
            want = None if want[0] is None else torch.cat(want)
            have = getattr(got, kind)
            assert (have is None) == (want is None), (name, kind)
            if want is not None:
                assert torch.equal(have, want), (name, kind)
    # Views that are not blocks of one buffer take the per-layer gathers.
    loose = [Observations(attention=o.attention.clone(), pv_norm=None, sparsity=None) for o in block]
    got = layer_blocks.observed_block(get_policy("h2o"), loose, rows, 32)
    assert torch.equal(got.attention, torch.cat([o.attention[rows, :, :32] for o in loose]))
