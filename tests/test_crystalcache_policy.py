"""crystalcache's engine-facing flow without the engine: the probe summary at
the prompt's end, then decode steps as the backend runs them (store the
token in a free slot, step_inputs, select_decode per layer, on_tokens),
checking the admission ceiling, the breath cadence and the cut to B."""

import math

import pytest
import torch

from kvsieve.policies import parse_kv_policy
from kvsieve.policies.base import ModelInfo, StepRow
from kvsieve.policies.crystalcache.policy import CrystalCachePolicy, CrystalCacheParams, budget_floor
from kvsieve.policies.observations import Observations, PolicyBatch, SlotView
from kvsieve.radix_ext import layer0_probe

DELIM = 99
H, HQ, D, L = 2, 4, 8, 2


def run(n_prompt, budget, params, steps, seed=0, base=0):
    """Held tokens per (layer 0, head 0) after each step: [after prefill, step 0, ...]."""
    g = torch.Generator().manual_seed(seed)
    policy = CrystalCachePolicy()
    policy.bind_model(ModelInfo(name="t", num_layers=L, num_kv_heads=H, num_q_heads=HQ, head_dim=D,
                                delimiter_ids=frozenset({DELIM})))
    p = CrystalCacheParams(**params)
    state = policy.begin_request(p, L, H)
    S = n_prompt + steps + 1
    valid = torch.zeros(L, 1, H, S, dtype=torch.bool)
    position = torch.full((L, 1, H, S), -1, dtype=torch.int64)
    score = torch.zeros(L, 1, H, S)
    keys = torch.randn(L, 1, H, S, D, generator=g)
    tensors, maxima = CrystalCachePolicy.batch_params([p])
    ids = [DELIM if i % 9 == 8 else 10 + (i * 7) % 50 for i in range(n_prompt + steps)]
    held = []

    def view(layer):
        return SlotView(valid=valid[layer].clone(), position=position[layer].clone(), score=score[layer].clone(),
                        last_hit=torch.zeros(1, H, S, dtype=torch.int32), keys=keys[layer])

    def apply(layer, v, evict):
        score[layer] = v.score
        if evict is not None:
            valid[layer] &= ~evict
            position[layer][evict] = -1

    if n_prompt:
        valid[:, :, :, :n_prompt] = True
        position[:, :, :, :n_prompt] = torch.arange(base, base + n_prompt)
        probe = layer0_probe.ProbeState(n_prompt, "cpu", chunk=64)
        layer0_probe.observe(probe, torch.randn(n_prompt, HQ, D, generator=g) * 2, keys[0, 0, :, :n_prompt],
                             torch.zeros(0, H, D), 1 / math.sqrt(D))
        setattr(state, layer0_probe.ATTRIBUTE, probe)
        assert policy.step_inputs([StepRow(state=state, step=0, pool_row=0, budget=budget, prefill=True)], "cpu") == {}
        pa = layer0_probe.collect([(state, ids[:n_prompt], base, budget)])[0]
        inputs = policy.prompt_attention_inputs([pa], "cpu")
        for layer in range(L):
            v = view(layer)
            batch = PolicyBatch(layer=layer, budget=torch.full((1, H), budget), step=torch.tensor([0]),
                                params=tensors, maxima=maxima, inputs=inputs)
            apply(layer, v, policy.select_prefill(batch, v, Observations()))
    held.append(int(valid[0, 0, 0].sum()))
    for s in range(steps):
        inputs = policy.step_inputs([StepRow(state=state, step=s, pool_row=0, budget=budget, prefill=False)], "cpu")
        for layer in range(L):
            slot = int((~valid[layer, 0, 0]).nonzero()[0])
            valid[layer, 0, :, slot] = True
            position[layer, 0, :, slot] = base + n_prompt + s
            score[layer, 0, :, slot] = 0
            v = view(layer)
            batch = PolicyBatch(layer=layer, budget=torch.full((1, H), budget), step=torch.tensor([s]),
                                params=tensors, maxima=maxima, inputs=inputs)
            attention = torch.rand(1, H, S, generator=g) * v.valid
            apply(layer, v, policy.select_decode(batch, v, Observations(attention=attention)))
        assert torch.equal(valid[0], valid[1])  # one index set for every layer and head
        policy.on_tokens(state, torch.tensor([base + n_prompt + s]), torch.tensor([ids[n_prompt + s]]), None)
        held.append(int(valid[0, 0, 0].sum()))
    return held, policy, p


@pytest.mark.parametrize("n_prompt,budget,params,base", [
    (300, 132, {}, 0),  # prompt cut at prefill, then breath cycles
    (300, 140, {"breath": 16}, 7),  # frequent cycles, a shared prefix of 7
    (0, 66, {"sinks": 4, "recent": 8}, 20),  # prompt kept in the radix cache: generated trunks only
    (20, 66, {"sinks": 4, "recent": 8}, 0),
])
def test_held_tokens_stay_under_the_ceiling_and_cycles_cut_to_the_budget(n_prompt, budget, params, base):
    steps = 200
    held, policy, p = run(n_prompt, budget, params, steps, base=base)
    B = max(budget_floor(p), budget)
    ceiling = policy.max_private_tokens(p, n_prompt, steps, budget)
    assert max(held) <= ceiling
    kept = policy.kept_after_prefill(p, n_prompt, budget)
    assert held[0] <= kept
    # what admission keeps after the prefill (RUNTIME.after_prefill) bounds the decode phase
    assert max(held[1:]) <= policy.max_private_tokens(p, kept, steps, budget)
    # The snapshot at step s - 1 (s = k * breath), its keep table two of the
    # request's forwards later, at step s + 1: B plus the two tokens the
    # snapshot had not seen (steps s and s + 1).
    for s in range(p.breath, steps - 1, p.breath):
        assert held[s + 2] <= B + 2
    for s in range(steps):  # nothing is evicted between cycles
        if s % p.breath != 1 or s == 1:
            assert held[s + 1] == held[s] + 1
    assert min(held[p.breath + 2:]) < max(held)


def test_a_budget_covering_everything_never_evicts():
    held, _, _ = run(100, 1024, {}, 150)
    assert held == list(range(100, 251))


def test_decode_off_keeps_every_generated_token():
    held, policy, p = run(300, 132, {"decode": False}, 100)
    assert held[1:] == [held[0] + s + 1 for s in range(100)]
    assert max(held) <= policy.max_private_tokens(p, 300, 100, 132)


def test_budget_checks_name_the_field():
    with pytest.raises(Exception) as err:
        parse_kv_policy({"name": "crystalcache", "budget": 131})
    assert err.value.field == "kv_policy.budget"
    assert parse_kv_policy({"name": "crystalcache", "budget": 70, "params": {"sinks": 4, "recent": 8}}).budget == 70
    with pytest.raises(Exception) as err:
        parse_kv_policy({"name": "crystalcache", "budget": 65, "params": {"sinks": 4, "recent": 8}})
    assert err.value.field == "kv_policy.budget"
    assert parse_kv_policy({"name": "crystalcache", "budget_ratio": 0.01}).budget_ratio == 0.01
