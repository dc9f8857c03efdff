"""crystal_kv (Crystal-KV Lite): a hand-worked LRFU hit/miss sequence with
its CRF values and evictions, the end-of-think stop, and properties
(hypothesis) of the batched decision."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsieve.policies import Observations, parse_kv_policy
from kvsieve.policies.crystal_kv.policy import hits_of

import pytest
from test_policy_algorithms import H, S, apply, batch_of, empty_view, held_positions, store


def attention_by_position(view, table: dict):
    """Observation [1, H, S]: the attention of each held position."""
    values = torch.zeros(1, H, S)
    for pos, mass in table.items():
        values[view.position == pos] = mass
    return values


def step(view, params, budget, t, table, inputs=None):
    # Algorithm 1 evicts every step: these tests fix evict_interval 1 unless they set it.
    policy, batch = batch_of("crystal_kv", [{"evict_interval": 1} | params], [budget], step=t)
    if inputs is not None:
        batch.inputs = inputs
    store(view, t)
    apply(view, policy.select_decode(batch, view, Observations(attention=attention_by_position(view, table))))


def crf_of(view, pos):
    return view.score[0, 0][view.position[0, 0] == pos].item()


def test_a_hand_worked_lrfu_sequence():
    # lambda 0.5, top_p 0.5 (a step's hits: the slots ranked above 0.5 of
    # the mass, the first always), budget 2. Worked by hand:
    # t0: {0} 1.0 -> hit: CRF0 = 1, tau0 = 0.
    # t1: 0: .2, 1: .8 -> hit 1: CRF1 = 1. Held {0, 1}.
    # t2: 0: .6 -> hit 0: CRF0 = 1 * .5^2 + 1 = 1.25; over budget: rank
    #     0: 1.25, 1: 1 * .5^1 = .5, 2 newest -> evict 1.
    # t3: 2: .7 -> hit 2: CRF2 = 0 + 1 = 1; rank 0: 1.25 * .5 = .625 < 1 -> evict 0.
    # t4: 4: .4, 3: .3, 2: .3 (slot order breaks the tie: 3 sits in slot 1,
    #     2 in slot 2) -> hits 4 and 3 (.4 < .5 before 3); 2 decays to .5 ->
    #     evict 2. CRF3 = 1, CRF4 = 1.
    params = {"decay": 0.5, "top_p": 0.5, "think_end": ""}
    view = empty_view(1)
    trace = [{0: 1.0}, {0: 0.2, 1: 0.8}, {0: 0.6, 1: 0.1, 2: 0.3}, {0: 0.1, 2: 0.7, 3: 0.2},
             {2: 0.3, 3: 0.3, 4: 0.4}]
    held = []
    for t, table in enumerate(trace):
        step(view, params, budget=2, t=t, table=table)
        held.append(held_positions(view, 0, 0))
        if t == 2:
            assert crf_of(view, 0) == pytest.approx(1.25)
    assert held == [{0}, {0, 1}, {0, 2}, {2, 3}, {3, 4}]
    assert crf_of(view, 3) == pytest.approx(1.0) and crf_of(view, 4) == pytest.approx(1.0)
    assert view.last_hit[0, 0][view.position[0, 0] == 3].item() == 4


def test_eviction_stops_after_the_end_of_think_marker():
    params = {"decay": 0.5, "top_p": 0.9, "think_end": "", "answer_tokens": 3}
    view = empty_view(1)
    for t in range(8):
        step(view, params, budget=2, t=t, table={t: 1.0}, inputs={"thinking": torch.tensor([t < 3])})
    # Thinking until t2 (2 held), then 3 answer tokens of room, then the LRFU again.
    assert len(held_positions(view, 0, 0)) <= 2 + 3 + 1
    assert {3, 4, 5, 6, 7} >= held_positions(view, 0, 0) - {0, 1, 2}


def test_top_p_hits_are_the_smallest_prefix_reaching_the_mass():
    attention = torch.tensor([[[0.1, 0.5, 0.3, 0.1]]])
    valid = torch.tensor([[[True, True, True, False]]])
    # Normalized over valid slots: .111, .556, .333 -> .556 + .333 >= .8.
    assert hits_of(attention, valid, torch.tensor([0.8])).tolist() == [[[False, True, True, False]]]


def test_adaptive_budgets_take_a_budget_ratio():
    # Issue #30: each reallocation shares the ratio's budget of that step
    # (tests/test_crystal_kv_knobs.py checks the totals).
    spec = parse_kv_policy({"name": "crystal_kv", "budget_ratio": 0.5, "params": {"adaptive": True}})
    assert spec.budget_ratio == 0.5 and spec.params["adaptive"] is True


def test_adaptive_realloc_reads_the_crf_sums_and_feeds_per_head_budgets():
    # Two layers, one kv head each (H=1 here), budget 8 per head, floor 1.
    # CRF sums written for pool row 3: layer 0 -> 6, layer 1 -> 2 (the
    # buffer select_decode fills). Algorithm 2: eta 6/8 = .75, 2/8 = .25 ->
    # shares .75, .25 of 16 after floors of 1: 14 * .75 = 10.5, 3.5 -> 10 + 1,
    # 3 + 1, one left to the tie's first (layer 0) -> [[12], [4]].
    from kvsieve.policies.base import ModelInfo, StepRow
    from kvsieve.policies.crystal_kv.policy import CrystalKVPolicy

    policy = CrystalKVPolicy()  # its own instance: the buffer and model stay out of other tests
    policy.bind_model(ModelInfo(name="t", num_layers=2, num_kv_heads=1, num_q_heads=1, head_dim=4,
                                delimiter_ids=frozenset(), encode=None))
    spec = parse_kv_policy({"name": "crystal_kv", "budget": 8,
                            "params": {"adaptive": True, "realloc_interval": 4, "min_head_budget": 1}})
    state = policy.begin_request(CrystalKVPolicy.Params(**spec.params), 2, 1)
    policy._crf_sums = torch.zeros(8, 2, 1)
    policy._crf_sums[3, :, 0] = torch.tensor([6.0, 2.0])
    assert policy.realloc_head_budgets(state, 3, 3, 8) is None  # not a realloc step
    new = policy.realloc_head_budgets(state, 4, 3, 8)
    assert new.tolist() == [[12], [4]]
    policy.accept_head_budgets(state, new)
    inputs = policy.step_inputs([StepRow(state=state, step=5, pool_row=3, budget=8, prefill=False,
                                         private_tokens=20)], "cpu")
    assert inputs["budget"].tolist() == [[[12], [4]]] and inputs["realloc"].tolist() == [True]
    again = policy.step_inputs([StepRow(state=state, step=6, pool_row=3, budget=8, prefill=False,
                                        private_tokens=21)], "cpu")
    assert again["realloc"].tolist() == [False]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.floats(0.05, 0.95), st.floats(0.1, 1.0), st.integers(0, 2**16))
def test_properties_budget_newest_determinism(budget, decay, top_p, seed):
    g = torch.Generator().manual_seed(seed)
    params = {"decay": decay, "top_p": top_p, "think_end": ""}
    views = [empty_view(1), empty_view(1)]
    for t in range(12):
        table = {p: float(torch.rand(1, generator=g)) for p in range(t + 1)}
        for view in views:
            step(view, params, budget=budget, t=t, table=table)
            held = held_positions(view, 0, 0)
            assert t in held and len(held) <= budget
    assert torch.equal(views[0].valid, views[1].valid) and torch.equal(views[0].score, views[1].score)


def test_served_end_to_end_equal_to_full_under_a_covering_budget_and_within_a_small_one(llama_server):
    from test_compressed import complete

    prompt = [41, 300, 12, 44, 150, 23, 9, 81]
    covered = complete(llama_server, prompt, {"name": "crystal_kv", "budget": 256, "compress_prompt": True})
    full = complete(llama_server, prompt, "full")
    assert covered["choices"][0]["token_ids"] == full["choices"][0]["token_ids"]
    assert covered["kv_usage"]["evicted_tokens"] == 0
    small = complete(llama_server, [42, 31, 32, 33, 34],
                     {"name": "crystal_kv", "budget": 8, "params": {"evict_interval": 1}}, max_tokens=40)
    kv = small["kv_usage"]
    # the prompt kept in the radix cache (less any part an earlier request left there), 8 generated in the region
    assert kv["retained_tokens"] == 5 - kv["prefix_cache_hit_tokens"] + 8
    assert kv["evicted_tokens"] == 40 - 8 and kv["eviction_events"] > 0


def test_adaptive_budgets_served_end_to_end_within_the_request_total(llama_server):
    # Budget 32 per head, reallocated every 8 steps over 64 generated tokens
    # (7 reallocations, pages moved between heads a step after each): the
    # request ends normally (a head short of a slot would abort it with an
    # overflow error) and holds at most its total: 32 per head on average.
    from test_compressed import complete

    policy = {"name": "crystal_kv", "budget": 32,
              "params": {"adaptive": True, "realloc_interval": 8, "min_head_budget": 4, "think_end": "",
                         "evict_interval": 1}}
    out = complete(llama_server, [42, 31, 32, 33, 34], policy, max_tokens=64)
    assert len(out["choices"][0]["token_ids"]) == 64 and out["choices"][0]["finish_reason"] == "length"
    kv = out["kv_usage"]
    assert kv["retained_tokens"] <= 5 + 32 and kv["evicted_tokens"] >= 64 - 32 - 1


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=H, max_size=H), st.integers(2, 4), st.integers(0, 2**16))
def test_per_head_budgets_hold_after_a_realloc_step_with_any_interval(head_budgets, interval, seed):
    # Adaptive budgets differ per head; at a realloc step (inputs["realloc"])
    # every head evicts down to its own budget even off its evict_interval,
    # and never the newest token.
    g = torch.Generator().manual_seed(seed)
    params = {"decay": 0.6, "top_p": 0.9, "think_end": "", "evict_interval": interval}
    view = empty_view(1)
    budget = torch.tensor([head_budgets])
    for t in range(10):
        policy, batch = batch_of("crystal_kv", [params], [1], step=t)
        batch.budget = budget
        realloc = t in (5, 9)
        batch.inputs = {"thinking": torch.tensor([True]), "realloc": torch.tensor([realloc])}
        store(view, t)
        obs = Observations(attention=torch.rand(1, H, S, generator=g) * view.valid)
        apply(view, policy.select_decode(batch, view, obs))
        for h in range(H):
            held = held_positions(view, 0, h)
            assert t in held and len(held) <= head_budgets[h] + (0 if realloc else interval - 1)


def test_the_end_of_think_marker_is_watched_for_every_request_of_a_forward():
    # "</think>" encodes to [7, 8] here. One forward hands over three requests'
    # tokens at once; the marker is split across two forwards for one of them.
    # A forward's ids are matched once a later forward has run (on a GPU the
    # newest may still be running): eviction stops a step after the marker.
    from kvsieve.policies.base import ModelInfo, StepRow
    from kvsieve.policies.crystal_kv.policy import CrystalKVPolicy

    policy = CrystalKVPolicy()
    policy.bind_model(ModelInfo(name="t", num_layers=1, num_kv_heads=1, num_q_heads=1, head_dim=4,
                                delimiter_ids=frozenset(), encode=lambda text: [7, 8] if text == "</think>" else [1]))
    params = CrystalKVPolicy.Params()
    states = [policy.begin_request(params, 1, 1) for _ in range(3)]
    rows = [StepRow(s, step=1, pool_row=r, budget=4, prefill=False) for r, s in enumerate(states)]

    def forward(ids: list[int], lengths: list[int]) -> None:
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        t = torch.tensor(ids)
        policy.on_forward_tokens([(s, a, n) for s, a, n in zip(states, starts, lengths)], t - 1, t, None)

    def thinking() -> list[bool]:
        return policy.step_inputs(rows, "cpu")["thinking"].tolist()

    forward([5, 7, 7, 8, 6], [2, 2, 1])  # request 0: [5, 7]; 1: [7, 8]; 2: [6]
    assert thinking() == [True, True, True]  # that forward may still be running
    forward([8, 7, 8], [1, 1, 1])  # request 0 ends its marker
    assert thinking() == [True, False, True]
    forward([1, 2, 3], [1, 1, 1])
    assert thinking() == [False, False, True]
    assert states[1].recent == [7, 8] and states[2].recent == [6, 8] and not states[1].watch  # [3]: the newest forward


def test_a_host_copy_owns_its_values():
    from kvsieve.policies.host_reads import HostCopy

    value = torch.tensor([1, 2])
    copy = HostCopy(value)
    value.fill_(9)  # the producer reuses its buffer
    assert copy.landed and copy.values() == [1, 2]
