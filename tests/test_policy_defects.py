"""Defects found in the first policies and the kv_policy parser, each
pinned by a hand-worked case. Every case here
failed before its fix."""

import pytest
import torch

from kvsieve.policies import KVPolicyError, Observations, parse_kv_policy
from kvsieve.radix_ext.step_meta import StepBuilder  # noqa: F401  (the engine side reads observation_window)
from kvsieve.policies import get_policy

from test_policy_algorithms import H, apply, batch_of, empty_view, held_positions, per_slot, store


def run_decode(name, params, budget, steps, obs=lambda view, t: Observations()):
    """One row generating `steps` tokens under `name`; the positions held after each step."""
    policy, batch = batch_of(name, [params], [budget])
    view = empty_view(1)
    held = []
    for t in range(steps):
        store(view, t)
        batch.step = torch.tensor([t])
        apply(view, policy.select_decode(batch, view, obs(view, t)))
        held.append(held_positions(view, 0, 0))
    return held


def test_streaming_at_a_budget_at_or_below_sinks_still_keeps_the_newest_token():
    # budget 2, sinks 4: before the fix the first 2 tokens froze the cache and
    # every new token was evicted. Now: sinks shrink to budget - 1 = 1.
    held = run_decode("streaming", {"sinks": 4, "buffer": 1}, budget=2, steps=6)
    assert held[-1] == {0, 5}
    assert all(t in h for t, h in enumerate(held))


def test_h2o_at_budget_one_keeps_the_newest_token():
    # Token 0 gets all the attention; at budget 1 the newest token stays anyway.
    mass = lambda view, t: Observations(attention=per_slot(view, torch.tensor([[[10.0] + [0.0] * 47] * H])))  # noqa
    held = run_decode("h2o", {}, budget=1, steps=4, obs=mass)
    assert held == [{0}, {1}, {2}, {3}]


def test_longflow_never_evicts_the_newest_token_when_protect_recent_covers_the_budget():
    # budget 2, protect_recent 5 (given to the policy directly: the parser now
    # refuses it): before, argmin over all-infinite scores evicted slot 0.
    scores = torch.tensor([[[5.0, 4.0, 3.0, 2.0, 1.0, 0.0] + [0.0] * 42] * H])
    pv = lambda view, t: Observations(pv_norm=per_slot(view, scores), attention=per_slot(view, scores))  # noqa
    held = run_decode("longflow", {"protect_recent": 5}, budget=2, steps=5, obs=pv)
    assert all(t in h for t, h in enumerate(held))
    assert all(len(h) <= 2 for h in held)


def test_snapkv_does_not_pool_window_attention_onto_the_tokens_before_the_window():
    # 8 prompt tokens, window 2 (positions 6, 7), kernel 3, budget 2. The
    # window holds all the attention (9.0 each); outside it: pos 1 gets 0.5,
    # pos 3 gets 0.4, the rest 0. Pooling inside the window would give
    # position 5 (next to 6) a score of 9 and keep it; pooled outside only,
    # the scores are 0.5 at 0, 1, 2 and 0.4 at 2, 3, 4 (max per position),
    # so the top 2 are positions 0 and 1 (ties: lower slot).
    policy, batch = batch_of("snapkv", [{"window": 2, "kernel": 3}], [2])
    view = empty_view(1)
    for t in range(8):
        store(view, t)
    attention = torch.tensor([[[0.0, 0.5, 0.0, 0.4, 0.0, 0.0, 9.0, 9.0] + [0.0] * 40] * H])
    apply(view, policy.select_prefill(batch, view, Observations(attention=per_slot(view, attention))))
    assert held_positions(view, 0, 0) == {0, 1, 6, 7}


def test_h2o_scores_its_prompt_with_every_prompt_query():
    cls = get_policy("h2o")
    assert cls.observation_window(cls.Params(), private_prompt=500) == 500
    snap = get_policy("snapkv")
    assert snap.observation_window(snap.Params(window=8), private_prompt=500) == 8


@pytest.mark.parametrize("value,field", [
    ({"name": "h2o", "budget": True}, "kv_policy.budget"),
    ({"name": "h2o", "budget": "64"}, "kv_policy.budget"),
    ({"name": "h2o", "budget": 10**30}, "kv_policy.budget"),
    ({"name": "h2o", "budget_ratio": "0.5"}, "kv_policy.budget_ratio"),
    ({"name": "snapkv", "compress_prompt": "yes"}, "kv_policy.compress_prompt"),
    ({"name": "streaming", "params": {"sinks": True}}, "kv_policy.params.sinks"),
    ({"name": "snapkv", "params": {"window": "32"}}, "kv_policy.params.window"),
    ({"name": "streaming", "budget": 4, "params": {"sinks": 4}}, "kv_policy.budget"),
    ({"name": "streaming", "budget": 3}, "kv_policy.budget"),  # default sinks 4
    ({"name": "streaming", "budget_ratio": 0.1, "params": {"sinks": 16}}, "kv_policy.params.sinks"),
    ({"name": "longflow", "budget": 8, "params": {"protect_recent": 8}}, "kv_policy.params.protect_recent"),
    ({"name": "h2o", "preset": "nope"}, "kv_policy.preset"),
])
def test_the_parser_refuses_loose_or_inconsistent_values_naming_the_field(value, field):
    with pytest.raises(KVPolicyError) as err:
        parse_kv_policy(value, presets={"fast": {"name": "h2o", "budget": 64}})
    assert err.value.field == field


def test_a_preset_key_starts_from_the_preset_and_the_other_keys_override_it():
    presets = {"fast": {"name": "streaming", "budget": 64, "params": {"sinks": 2}}}
    spec = parse_kv_policy({"preset": "fast", "budget_ratio": 0.25}, presets)
    assert (spec.name, spec.budget, spec.budget_ratio, spec.params, spec.preset) == \
        ("streaming", None, 0.25, {"sinks": 2, "buffer": 16}, "fast")
    # Engine side (no presets): the key is the label of where the spec came from.
    assert parse_kv_policy(spec.to_custom_params()).preset == "fast"


def test_numbers_stay_numbers():
    assert parse_kv_policy({"name": "streaming", "budget": 64, "params": {"sinks": 0}}).budget == 64
    assert parse_kv_policy({"name": "h2o", "budget_ratio": 1}).budget_ratio == 1.0  # an integer is a float


def test_params_strictness_lives_in_the_base_and_reaches_optional_and_boolean_fields():
    # A later policy's Params inherits it: Optional numbers and booleans too.
    from typing import Optional

    from pydantic import ValidationError

    from kvsieve.policies.base import PolicyParams

    class Later(PolicyParams):
        cap: Optional[int] = None
        rate: float = 0.5
        flag: bool = False

    for bad in ({"cap": True}, {"cap": "8"}, {"rate": "0.5"}, {"flag": "yes"}, {"flag": 1}):
        with pytest.raises(ValidationError):
            Later.model_validate(bad)
    assert Later.model_validate({"cap": 8, "rate": 1, "flag": True}) == Later(cap=8, rate=1.0, flag=True)


def test_a_rejected_preset_object_is_counted_under_its_presets_policy():
    from types import SimpleNamespace

    from kvsieve.service.app import OpenAIServer

    engine = SimpleNamespace(tokenizer=None, context_length=64)
    server = OpenAIServer(engine, "m", {"fast": {"name": "h2o", "budget": 64}})
    assert server.policy_label({"kv_policy": {"preset": "fast", "budget": True}}) == "h2o"
    assert server.policy_label({"kv_policy": {"preset": "nope"}}) == "invalid"
    # Shapes a fuzzer sends (schemathesis, 2026-12-02: a list here was a 500).
    for odd in ([{}, "m"], {"a": 1}, 3, None, True):
        assert server.policy_label({"kv_policy": {"preset": odd}}) == "invalid"
    assert server.policy_label({"kv_policy": {"name": ["h2o"]}}) == "invalid"
    assert server.policy_label({"kv_policy": [1, 2]}) == "invalid"


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["streaming", "h2o", "longflow"]), budget=st.integers(1, 6),
       knob=st.integers(0, 8), steps=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_the_newest_token_survives_every_decode_step_and_the_budget_holds(name, budget, knob, steps, seed):
    # Any budget, any sinks / protect_recent (even the ones the parser now
    # refuses), any observations: the token just stored is never evicted, and
    # a head never holds more than the budget after its step (streaming
    # rolling every step: its cadence is test_policy_algorithms').
    params = {"streaming": {"sinks": knob, "buffer": 1}, "h2o": {}, "longflow": {"protect_recent": knob}}[name]
    table = torch.rand(1, H, 48, generator=torch.Generator().manual_seed(seed))
    obs = lambda view, t: Observations(attention=per_slot(view, table), pv_norm=per_slot(view, table))  # noqa
    held = run_decode(name, params, budget, steps, obs)
    assert all(t in h and len(h) <= budget for t, h in enumerate(held))
