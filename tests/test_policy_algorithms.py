"""Each wired policy, step by step on random observations, retains exactly
the tokens its plain-Python reference (tests/policy_reference.py) retains.
Every test runs several rows with different budgets and parameters through
one batched call, as the engine does, and checks each row on its own."""

import pytest
import torch

import policy_reference as ref
from kvsieve.policies import Observations, PolicyBatch, SlotView, get_policy

H, S = 3, 48  # kv heads, slots per head


def empty_view(rows):
    return SlotView(
        valid=torch.zeros(rows, H, S, dtype=torch.bool),
        position=torch.full((rows, H, S), -1, dtype=torch.int64),
        score=torch.zeros(rows, H, S),
        last_hit=torch.zeros(rows, H, S, dtype=torch.int32),
    )


def store(view, pos):
    """Store token `pos` in each (row, head)'s first free slot (as the region does)."""
    slot = (~view.valid).int().argmax(dim=-1, keepdim=True)
    view.valid.scatter_(-1, slot, True)
    view.position.scatter_(-1, slot, pos)
    view.score.scatter_(-1, slot, 0.0)


def per_slot(view, table):
    """Observation [R, H, S] from values per (row, head, position)."""
    pos = view.position.clamp(min=0)
    return torch.where(view.valid, table.gather(-1, pos), torch.zeros(()))


def held_positions(view, r, h):
    return set(view.position[r, h][view.valid[r, h]].tolist())


def apply(view, evict):
    if evict is not None:
        view.valid &= ~evict
        view.position[~view.valid] = -1


def batch_of(name, params, budgets, step=0):
    cls = get_policy(name)
    rows = [cls.Params(**p) for p in params]
    tensors, maxima = cls.batch_params(rows)
    budget = torch.tensor(budgets).unsqueeze(1).expand(-1, H)
    return cls(), PolicyBatch(layer=0, budget=budget, step=torch.full((len(rows),), step), params=tensors,
                              maxima=maxima)


def test_streaming_matches_reference_per_row():
    # (budget, sinks, buffer) of each row: the paper's roll every step, the
    # default cadence of 16, and one that does not divide the steps.
    cases = [(8, 4, 1), (5, 2, 16), (16, 0, 3), (6, 1, 4)]
    policy, batch = batch_of("streaming", [{"sinks": s, "buffer": k} for _, s, k in cases], [b for b, _, _ in cases])
    view = empty_view(len(cases))
    expected = [set() for _ in cases]
    for step in range(40):
        store(view, step)
        batch.step = torch.full((len(cases),), step)
        apply(view, policy.select_decode(batch, view, Observations()))
        for r, (budget, sinks, buffer) in enumerate(cases):
            expected[r] = ref.streaming_step(expected[r], step, step, budget, sinks, buffer)
            assert len(expected[r]) <= policy.max_private_tokens(policy.Params(buffer=buffer), 0, 100, budget)
            for h in range(H):
                assert held_positions(view, r, h) == expected[r], (step, r, h)
    assert policy.deciding_rows([]) == []


def test_streaming_names_the_rows_due_and_padded_rows_evict_nothing():
    from kvsieve.policies.base import StepRow

    policy, batch = batch_of("streaming", [{"buffer": 4}, {"buffer": 1}], [4, 4])
    rows = [StepRow(policy.begin_request(policy.Params(buffer=k), 1, H), step=s, pool_row=0, budget=4, prefill=False)
            for k, s in ((4, 3), (4, 5), (1, 5))]
    assert policy.deciding_rows(rows) == [True, False, True]
    # Row 0 runs select_decode at a step it is not due (padded into the
    # deciding group): nothing is evicted though it holds past its budget.
    view = empty_view(2)
    for pos in range(7):
        store(view, pos)
    batch.step = torch.tensor([5, 5])
    evict = policy.select_decode(batch, view, Observations())
    assert not evict[0].any()
    assert evict[1].sum(dim=-1).tolist() == [3] * H


def test_h2o_matches_reference_per_row():
    budgets = [6, 9, 16]
    gen = torch.Generator().manual_seed(1)
    policy, batch = batch_of("h2o", [{}] * len(budgets), budgets)
    view = empty_view(len(budgets))
    scores = [[dict() for _ in range(H)] for _ in budgets]
    for step in range(40):
        store(view, step)
        table = torch.rand(len(budgets), H, 64, generator=gen)
        for r in range(len(budgets)):
            for h in range(H):
                scores[r][h][step] = 0.0
                for p in scores[r][h]:
                    scores[r][h][p] += float(table[r, h, p])
        apply(view, policy.select_decode(batch, view, Observations(attention=per_slot(view, table))))
        for r, budget in enumerate(budgets):
            for h in range(H):
                keep = ref.h2o_keep(scores[r][h], budget)
                scores[r][h] = {p: s for p, s in scores[r][h].items() if p in keep}
                assert held_positions(view, r, h) == keep, (step, r, h)


def test_snapkv_matches_reference_per_row():
    cases = [(8, 4, 7), (10, 32, 3), (3, 2, 1)]  # (budget, window, kernel) of each row
    gen = torch.Generator().manual_seed(2)
    policy, batch = batch_of("snapkv", [{"window": w, "kernel": k} for _, w, k in cases], [b for b, _, _ in cases])
    view = empty_view(len(cases))
    for p in range(40):
        store(view, p)
    table = torch.rand(len(cases), H, 64, generator=gen)
    apply(view, policy.select_prefill(batch, view, Observations(attention=per_slot(view, table))))
    for r, (budget, window, kernel) in enumerate(cases):
        for h in range(H):
            attention = {p: float(table[r, h, p]) for p in range(40)}
            assert held_positions(view, r, h) == ref.snapkv_keep(attention, budget, window, kernel)
    # No eviction while decoding.
    assert policy.select_decode(batch, view, Observations()) is None


def test_longflow_matches_reference_per_row():
    budgets = [4, 11]
    gen = torch.Generator().manual_seed(3)
    policy, batch = batch_of("longflow", [{}] * len(budgets), budgets)
    view = empty_view(len(budgets))
    held = [set() for _ in budgets]
    for step in range(40):
        store(view, step)
        table = torch.rand(len(budgets), H, 64, generator=gen)
        evict = policy.select_decode(batch, view, Observations(pv_norm=per_slot(view, table)))
        # Layer-wide: the same slot in every head, and at most one per step.
        assert all(evict[r].sum(dim=-1).tolist() in ([0] * H, [1] * H) for r in range(len(budgets)))
        assert (evict == evict[:, :1]).all()
        apply(view, evict)
        for r, budget in enumerate(budgets):
            held[r].add(step)
            victim = ref.longflow_evict({p: float(table[r, :, p].sum()) for p in held[r]}, budget, newest=step)
            if victim is not None:
                held[r].discard(victim)
            for h in range(H):
                assert held_positions(view, r, h) == held[r]
    assert [len(h) for h in held] == budgets


def test_longflow_prefill_cuts_to_the_budget_layer_wide():
    budgets = [6, 20, 36]
    gen = torch.Generator().manual_seed(4)
    policy, batch = batch_of("longflow", [{}] * len(budgets), budgets)
    view = empty_view(len(budgets))
    for p in range(40):
        store(view, p)
    table = torch.rand(len(budgets), H, 64, generator=gen)
    apply(view, policy.select_prefill(batch, view, Observations(attention=per_slot(view, table))))
    for r, budget in enumerate(budgets):
        window = min(32, budget)  # snapkv's default window, counted inside the budget
        summed = {p: float(table[r, :, p].sum()) for p in range(40)}
        expected = ref.snapkv_keep(summed, budget - window, window, 7)
        assert len(expected) == budget
        for h in range(H):
            assert held_positions(view, r, h) == expected
    assert (view.position == view.position[:, :1]).all()  # the same token in the same slot of every head


def test_rows_of_a_batch_do_not_see_each_other():
    # The same row alone and beside others gets the same decision.
    gen = torch.Generator().manual_seed(5)
    policy, batch = batch_of("h2o", [{}] * 4, [5, 7, 5, 9])
    view = empty_view(4)
    for p in range(12):
        store(view, p)
    attention = per_slot(view, torch.rand(4, H, 64, generator=gen))
    together = policy.select_decode(batch, SlotView(view.valid.clone(), view.position.clone(), view.score.clone(),
                                                    view.last_hit.clone()), Observations(attention=attention))
    _, solo_batch = batch_of("h2o", [{}], [5])
    solo_view = SlotView(view.valid[2:3].clone(), view.position[2:3].clone(), view.score[2:3].clone(),
                         view.last_hit[2:3].clone())
    solo = policy.select_decode(solo_batch, solo_view, Observations(attention=attention[2:3]))
    assert torch.equal(together[2:3], solo)


@pytest.mark.parametrize("name, private, new, budget, peak", [
    ("h2o", 10, 100, 32, 33),        # decode fills to budget, +1 before each eviction
    ("h2o", 50, 100, 32, 50),        # the whole prompt is held until prefill ends
    ("h2o", 10, 5, 32, 15),          # never more than the request's length
    ("streaming", 10, 100, 8, 24),   # evicts every 16 steps (buffer): budget + 16
    ("streaming", 30, 100, 8, 30),
    ("longflow", 10, 100, 32, 33),
    ("snapkv", 100, 50, 16, 100),    # keeps 16 + window 32 of the prompt, then only adds
    ("snapkv", 100, 80, 16, 128),
])
def test_compressed_ceiling_bounds_what_a_head_can_hold(name, private, new, budget, peak):
    cls = get_policy(name)
    assert cls().max_private_tokens(cls.Params(), private, new, budget) == peak


def test_policy_params_are_validated():
    from kvsieve.policies import KVPolicyError, parse_kv_policy

    with pytest.raises(KVPolicyError) as info:
        parse_kv_policy({"name": "snapkv", "budget": 64, "params": {"kernel": 4}})
    assert info.value.field == "kv_policy.params.kernel"
    with pytest.raises(KVPolicyError) as info:
        parse_kv_policy({"name": "streaming", "budget": 64, "params": {"sinks": -1}})
    assert info.value.field == "kv_policy.params.sinks"
    spec = parse_kv_policy({"name": "h2o", "budget": 64})
    assert spec.to_custom_params() == {"name": "h2o", "budget": 64, "params": {}}
    with pytest.raises(KVPolicyError) as info:
        parse_kv_policy({"name": "full", "compress_prompt": True})
    assert info.value.field == "kv_policy.compress_prompt"


def test_compress_prompt_defaults_per_policy():
    from kvsieve.policies import parse_kv_policy

    assert parse_kv_policy({"name": "snapkv"}).prompt_compressed
    assert parse_kv_policy({"name": "longflow"}).prompt_compressed
    assert not parse_kv_policy({"name": "h2o"}).prompt_compressed
    assert not parse_kv_policy({"name": "streaming"}).prompt_compressed
    assert parse_kv_policy({"name": "h2o", "compress_prompt": True}).prompt_compressed


def test_streaming_decode_after_a_prompt_cut_matches_reference():
    # The decode step reads ranks off the held extremes (sinks + an unbroken
    # window); a prompt cut at prefill must leave exactly that shape.
    cases = [(8, 4, 1), (6, 1, 16), (12, 0, 4)]
    policy, batch = batch_of("streaming", [{"sinks": s, "buffer": k} for _, s, k in cases], [b for b, _, _ in cases])
    view = empty_view(len(cases))
    for pos in range(30):
        store(view, pos)
    apply(view, policy.select_prefill(batch, view, Observations()))
    expected = [ref.streaming_keep(list(range(30)), budget, sinks) for budget, sinks, _ in cases]
    for step, pos in enumerate(range(30, 45)):
        store(view, pos)
        batch.step = torch.full((len(cases),), step)
        apply(view, policy.select_decode(batch, view, Observations()))
        for r, (budget, sinks, buffer) in enumerate(cases):
            expected[r] = ref.streaming_step(expected[r], pos, step, budget, sinks, buffer)
            for h in range(H):
                assert held_positions(view, r, h) == expected[r], (pos, r, h)


@pytest.mark.parametrize("k_max", [0, 1, 3, 40, 100])
def test_newest_mask_equals_ranking_every_slot(k_max):
    from kvsieve.policies.observations import newest_mask, rank_by_position

    gen = torch.Generator().manual_seed(k_max)
    rows, slots = 5, 48
    valid = torch.rand(rows, H, slots, generator=gen) < 0.6
    position = torch.stack([torch.randperm(500, generator=gen)[:slots] for _ in range(rows * H)]).view(rows, H, slots)
    position = torch.where(valid, position, -1)
    k = torch.randint(0, k_max + 1, (rows, H), generator=gen)
    view = SlotView(valid=valid, position=position, score=torch.zeros(rows, H, slots),
                    last_hit=torch.zeros(rows, H, slots, dtype=torch.int32))
    expected = valid & (rank_by_position(view, newest_first=True) < k.unsqueeze(-1))
    assert torch.equal(newest_mask(valid, position, k, k_max), expected)
