"""crystal_kv's per-request knobs of issue #30: lambda at its endpoints (0 is
LRU, 1 is LFU, crystal-kv.txt §5.2), `answer_tokens: null` (never evict
after the end-of-think marker) and adaptive budgets with a budget_ratio."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsieve.policies import KVPolicyError, Observations, parse_kv_policy
from kvsieve.policies.base import ModelInfo, StepRow
from kvsieve.policies.crystal_kv.budgets import reallocate_budgets
from kvsieve.policies.crystal_kv.policy import NEVER_AFTER_MARKER, CrystalKVPolicy

from test_policy_algorithms import H, S, apply, batch_of, empty_view, held_positions, store


def one_hit_per_step(view, t, g):
    """Attention [1, H, S] with one clear winner per head (top_p 0.01 hits
    exactly it): a random held slot, the same for every head."""
    held = view.valid[0, 0].nonzero().flatten()
    winner = held[torch.randint(len(held), (1,), generator=g)].item()
    attention = torch.full((1, H, S), 1e-3) * view.valid
    attention[0, :, winner] = 1.0
    return attention


def run(decay, budget, steps, seed, inputs=None, **params):
    """Steps 0..steps-1 of one row, every head fed the same attention; after
    each step (t, view, hit counts so far by position, this step's hit)."""
    g = torch.Generator().manual_seed(seed)
    view = empty_view(1)
    hits: dict[int, int] = {}
    for t in range(steps):
        policy, batch = batch_of("crystal_kv", [{"decay": decay, "top_p": 0.01, "think_end": "",
                                                 "evict_interval": 1, **params}], [budget], step=t)
        if inputs is not None:
            batch.inputs = inputs(t)
        store(view, t)
        attention = one_hit_per_step(view, t, g)
        winner = view.position[0, 0][attention[0, 0].argmax()].item()
        hits[winner] = hits.get(winner, 0) + 1
        apply(view, policy.select_decode(batch, view, Observations(attention=attention)))
        yield t, view, dict(hits), winner


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 6), st.integers(0, 2**16))
def test_decay_zero_is_lru_every_kept_slot_was_used_more_recently_than_every_evicted_one(budget, seed):
    # A use is a hit (attention, §5.2); a slot never hit ranks below all.
    last_use: dict[int, int] = {}  # position -> step of its last hit, -1 before any
    gone: set[int] = set()
    for t, view, _, winner in run(0.0, budget, 20, seed):
        last_use[t] = -1
        last_use[winner] = t
        held = held_positions(view, 0, 0)
        assert t in held and len(held) <= budget
        evicted = set(range(t + 1)) - held - gone
        if evicted:  # (the newest is kept whatever its rank)
            assert max(last_use[p] for p in evicted) <= min(last_use[p] for p in held - {t}), (t, last_use)
        gone |= evicted


def test_decay_zero_agrees_with_a_tiny_decay_before_it_underflows():
    # lambda -> 0 tends to LRU: with lambda 1e-3, CRF ~ 1e-3^(steps since
    # the last hit), ordered by recency while it stays above float32's range
    # (one hit per step: the last hits differ).
    for seed in range(5):
        lru = [held_positions(v, 0, 0) for _, v, _, _ in run(0.0, 3, 9, seed)]
        tiny = [held_positions(v, 0, 0) for _, v, _, _ in run(1e-3, 3, 9, seed)]
        assert lru == tiny


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 6), st.integers(0, 2**16))
def test_decay_one_is_lfu_crf_counts_hits_and_the_kept_were_hit_at_least_as_often(budget, seed):
    for t, view, hits, _ in run(1.0, budget, 20, seed):
        held = held_positions(view, 0, 0)
        crf = {int(p): float(c) for p, c in zip(view.position[0, 0].tolist(), view.score[0, 0].tolist()) if p >= 0}
        for p in held:
            assert crf[p] == hits.get(p, 0)  # 1^(t - tau) = 1: no decay, a plain count
        assert t in held and len(held) <= budget


def test_decay_bounds_are_zero_and_one_inclusive():
    for decay in (0, 0.0, 1, 1.0):
        assert parse_kv_policy({"name": "crystal_kv", "params": {"decay": decay}}).params["decay"] == decay
    for decay in (-0.01, 1.01):
        with pytest.raises(KVPolicyError) as err:
            parse_kv_policy({"name": "crystal_kv", "params": {"decay": decay}})
        assert err.value.field == "kv_policy.params.decay"


def test_answer_tokens_null_never_evicts_after_the_marker():
    thinking = lambda t: {"thinking": torch.tensor([t < 4])}  # noqa: E731  the marker at step 3
    held = [len(held_positions(v, 0, 0)) for _, v, _, _ in run(0.6, 2, 16, 0, inputs=thinking, answer_tokens=None)]
    assert held[3] <= 2  # thinking: held to the budget
    assert held[4:] == list(range(held[3] + 1, held[3] + 13))  # then every token stays


def test_answer_tokens_null_reaches_the_decision_as_a_room_no_head_reaches():
    cls = CrystalKVPolicy
    params, maxima = cls.batch_params([cls.Params(answer_tokens=None), cls.Params(answer_tokens=7)])
    assert params["answer_tokens"].tolist() == [NEVER_AFTER_MARKER, 7] and maxima["answer_tokens"] == NEVER_AFTER_MARKER
    never = cls.Params(answer_tokens=None, evict_interval=4)
    policy = cls()
    # Admission reserves the whole generation; the adaptive pages' room is the cadence's.
    assert policy.max_private_tokens(never, 0, 500, 64) == 500
    assert policy.max_private_tokens(cls.Params(answer_tokens=None, think_end=""), 0, 500, 64) == 64 + 16
    assert policy.head_room(never) == 4
    with pytest.raises(KVPolicyError) as err:
        parse_kv_policy({"name": "crystal_kv", "params": {"answer_tokens": -1}})
    assert err.value.field == "kv_policy.params.answer_tokens"


def adaptive_policy(num_layers=2):
    policy = CrystalKVPolicy()
    policy.bind_model(ModelInfo(name="t", num_layers=num_layers, num_kv_heads=1, num_q_heads=1, head_dim=4,
                                delimiter_ids=frozenset(), encode=None))
    policy._crf_sums = torch.zeros(8, num_layers, 1)
    policy._crf_sums[3, :, 0] = torch.tensor([6.0, 2.0])
    return policy


def test_adaptive_with_a_budget_ratio_shares_the_ratios_budget_of_each_reallocation():
    policy = adaptive_policy()
    spec = parse_kv_policy({"name": "crystal_kv", "budget_ratio": 0.5,
                            "params": {"adaptive": True, "realloc_interval": 4, "min_head_budget": 1}})
    state = policy.begin_request(CrystalKVPolicy.Params(**spec.params), 2, 1)
    first = policy.realloc_head_budgets(state, 4, 3, 8)  # the ratio's budget at step 4: 8 per head
    assert first.tolist() == [[12], [4]] and int(first.sum()) == 16
    policy.accept_head_budgets(state, first)
    # 20 per head by step 8: the total grows to 40. Same CRF sums over the
    # new budgets: eta 6/12 = 2/4, an even split.
    assert policy.realloc_head_budgets(state, 8, 3, 20).tolist() == [[20], [20]]


def test_adaptive_never_evicting_after_the_marker_changes_budgets_without_moving_pages():
    # Every head's pages hold its whole generation: the budgets are taken at
    # once and no page targets are returned (plan_head_pages moves none).
    policy = adaptive_policy()
    params = CrystalKVPolicy.Params(adaptive=True, realloc_interval=4, min_head_budget=1, answer_tokens=None)
    state = policy.begin_request(params, 2, 1)
    assert policy.realloc_head_budgets(state, 4, 3, 8) is None
    assert state.head_budgets.tolist() == [[12], [4]] and state.realloc_now
    inputs = policy.step_inputs([StepRow(state=state, step=5, pool_row=3, budget=8, prefill=False)], "cpu")
    assert inputs["budget"].tolist() == [[[12], [4]]]


def test_reallocate_budgets_to_another_total():
    crf = torch.tensor([[3.0, 1.0], [0.0, 0.0]])
    current = torch.full((2, 2), 10)
    assert int(reallocate_budgets(crf, current, 1).sum()) == 40  # the total of the current budgets
    grown = reallocate_budgets(crf, current, 1, total=64)
    assert int(grown.sum()) == 64 and (grown >= 1).all() and grown[0, 0] > grown[0, 1]
    # No CRF anywhere: the current shares, scaled to the new total.
    assert reallocate_budgets(torch.zeros(2, 2), current, 1, total=64).tolist() == [[16, 16], [16, 16]]
