"""Each wired policy, step by step on random observations, retains exactly
the tokens its plain-Python reference (tests/policy_reference.py) retains."""

import pytest
import torch

import policy_reference as ref
from kvsieve.policies import LayerObservations, LayerView, get_policy

H, S = 3, 48  # kv heads, slots per head


def empty_view():
    return LayerView(
        valid=torch.zeros(H, S, dtype=torch.bool),
        position=torch.full((H, S), -1, dtype=torch.int64),
        score=torch.zeros(H, S),
        last_hit=torch.zeros(H, S, dtype=torch.int32),
    )


def store(view, pos):
    """Store token `pos` in each head's first free slot (as the region does)."""
    slot = (~view.valid).int().argmax(dim=1)
    rows = torch.arange(H)
    view.valid[rows, slot] = True
    view.position[rows, slot] = pos
    view.score[rows, slot] = 0.0


def per_slot(view, table):
    """Observation [H, S] from values per (head, position)."""
    pos = view.position.clamp(min=0)
    return torch.where(view.valid, table.gather(1, pos), torch.zeros(()))


def held_positions(view, h):
    return set(view.position[h][view.valid[h]].tolist())


def apply(view, evict):
    if evict is not None:
        view.valid &= ~evict
        view.position[~view.valid] = -1


@pytest.mark.parametrize("budget, sinks", [(8, 4), (5, 2), (16, 0)])
def test_streaming_matches_reference(budget, sinks):
    policy = get_policy("streaming")(get_policy("streaming").Params(sinks=sinks))
    view = empty_view()
    b = torch.full((H,), budget)
    for step in range(40):
        store(view, step)
        apply(view, policy.on_decode_step(step, 0, view, LayerObservations(), b))
        expected = ref.streaming_keep(list(range(step + 1)), budget, sinks)
        for h in range(H):
            assert held_positions(view, h) == expected


@pytest.mark.parametrize("budget", [6, 9, 16])
def test_h2o_matches_reference(budget):
    gen = torch.Generator().manual_seed(budget)
    policy = get_policy("h2o")()
    view = empty_view()
    b = torch.full((H,), budget)
    scores = [dict() for _ in range(H)]
    for step in range(40):
        store(view, step)
        table = torch.rand(H, 64, generator=gen)
        for h in range(H):
            scores[h][step] = 0.0
            for p in scores[h]:
                scores[h][p] += float(table[h, p])
        apply(view, policy.on_decode_step(step, 0, view, LayerObservations(attention=per_slot(view, table)), b))
        for h in range(H):
            keep = ref.h2o_keep(scores[h], budget)
            scores[h] = {p: s for p, s in scores[h].items() if p in keep}
            assert held_positions(view, h) == keep, (step, h)


@pytest.mark.parametrize("budget, window, kernel", [(8, 4, 7), (10, 32, 3), (3, 2, 1)])
def test_snapkv_matches_reference(budget, window, kernel):
    gen = torch.Generator().manual_seed(window)
    cls = get_policy("snapkv")
    policy = cls(cls.Params(window=window, kernel=kernel))
    view = empty_view()
    for p in range(40):
        store(view, p)
    table = torch.rand(H, 64, generator=gen)
    evict = policy.on_prefill_end(0, view, LayerObservations(attention=per_slot(view, table)), torch.full((H,), budget))
    apply(view, evict)
    for h in range(H):
        attention = {p: float(table[h, p]) for p in range(40)}
        assert held_positions(view, h) == ref.snapkv_keep(attention, budget, window, kernel)
    # No eviction while decoding.
    assert policy.on_decode_step(40, 0, view, LayerObservations(), torch.full((H,), budget)) is None


@pytest.mark.parametrize("budget", [4, 11])
def test_longflow_matches_reference(budget):
    gen = torch.Generator().manual_seed(budget)
    policy = get_policy("longflow")()
    policy.on_request_begin(1, H)
    view = empty_view()
    b = torch.full((H,), budget)
    held = set()
    for step in range(40):
        store(view, step)
        held.add(step)
        table = torch.rand(H, 64, generator=gen)
        evict = policy.on_decode_step(step, 0, view, LayerObservations(pv_norm=per_slot(view, table)), b)
        # Layer-wide: the same slot in every head, and at most one per step.
        assert evict.sum(dim=1).tolist() in ([0] * H, [1] * H)
        assert (evict == evict[0]).all()
        apply(view, evict)
        victim = ref.longflow_evict({p: float(table[:, p].sum()) for p in held}, budget, newest=step)
        if victim is not None:
            held.discard(victim)
        for h in range(H):
            assert held_positions(view, h) == held
    assert len(held) == budget


@pytest.mark.parametrize("budget", [6, 20, 36])
def test_longflow_prefill_cuts_to_the_budget_layer_wide(budget):
    gen = torch.Generator().manual_seed(budget)
    policy = get_policy("longflow")()
    policy.on_request_begin(1, H)
    view = empty_view()
    for p in range(40):
        store(view, p)
    table = torch.rand(H, 64, generator=gen)
    apply(view, policy.on_prefill_end(0, view, LayerObservations(attention=per_slot(view, table)),
                                      torch.full((H,), budget)))
    window = min(32, budget)  # snapkv's default window, counted inside the budget
    summed = {p: float(table[:, p].sum()) for p in range(40)}
    expected = ref.snapkv_keep(summed, budget - window, window, 7)
    assert len(expected) == budget
    for h in range(H):
        assert held_positions(view, h) == expected
    assert (view.position == view.position[0]).all()  # the same token in the same slot of every head


@pytest.mark.parametrize("name, private, new, budget, peak", [
    ("h2o", 10, 100, 32, 33),        # decode fills to budget, +1 before each eviction
    ("h2o", 50, 100, 32, 50),        # the whole prompt is held until prefill ends
    ("h2o", 10, 5, 32, 15),          # never more than the request's length
    ("streaming", 10, 100, 8, 10),
    ("longflow", 10, 100, 32, 33),
    ("snapkv", 100, 50, 16, 100),    # keeps 16 + window 32 of the prompt, then only adds
    ("snapkv", 100, 80, 16, 128),
])
def test_compressed_ceiling_bounds_what_a_head_can_hold(name, private, new, budget, peak):
    assert get_policy(name)().max_private_tokens(private, new, budget) == peak


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
