"""crystalcache's batched host work against its per-request form: D's decay
for many requests at once equals decay_crystal per request; the edge set
built with tensor ops equals the per-pair one; and a batch of requests
driven as the engine drives it (deciding_rows splitting the rows that take
a snapshot or apply a keep table from those that only observe, tokens
handed over once per forward) keeps, row for row, what each request keeps
alone."""

import math
import random
from types import SimpleNamespace

import torch

from kvsieve.policies.base import ModelInfo, StepRow
from kvsieve.policies.crystalcache.decode import decay_crystal, decay_rows
from kvsieve.policies.crystalcache.policy import CrystalCacheParams, CrystalCachePolicy, prompt_edges
from kvsieve.policies.observations import Observations, PolicyBatch, SlotView
from kvsieve.radix_ext import layer0_probe

DELIM = 99
H, HQ, D, L = 2, 4, 8, 2


def test_decay_of_many_requests_equals_decay_per_request():
    rng = random.Random(0)
    crystals = [[rng.random() for _ in range(rng.randint(0, 9))] for _ in range(6)]
    mbars = [[rng.uniform(0.1, 20) for _ in c] for c in crystals]
    steps = [rng.randint(0, 70) for _ in crystals]
    for got, c, m, s in zip(decay_rows(crystals, mbars, steps), crystals, mbars, steps):
        want = decay_crystal(c, m, s)
        assert len(got) == len(want) and all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)
                                             for a, b in zip(got, want))


def _edges_per_pair(pa):
    edges = {}
    for index, weight, tau in ((pa.intra_index, pa.intra_weight, 0.3), (pa.cross_index, pa.cross_weight, 0.02)):
        for i in range(index.shape[0]):
            for j, w in zip(index[i].tolist(), weight[i].tolist()):
                if j >= 0 and w > tau:
                    key = (min(i, j), max(i, j))
                    edges[key] = max(w, edges.get(key, w))
    return edges


def test_edges_from_the_probe_equal_the_per_pair_rule():
    g = torch.Generator().manual_seed(3)
    n = 150
    probe = layer0_probe.ProbeState(n, "cpu", chunk=64)
    layer0_probe.observe(probe, torch.randn(n, HQ, D, generator=g) * 2, torch.randn(H, n, D, generator=g),
                         torch.zeros(0, H, D), 1 / math.sqrt(D))
    state = SimpleNamespace(**{layer0_probe.ATTRIBUTE: probe})
    pa = layer0_probe.collect([(state, list(range(n)), 0, 132)])[0]
    assert prompt_edges(pa) == _edges_per_pair(pa)


def _drive(prompts, budget, params, steps, seeds, S):
    """Requests of the given prompt lengths decoding together; each row's
    layer-0 valid mask after every step, and the steps each row decided."""
    policy = CrystalCachePolicy()
    policy.bind_model(ModelInfo(name="t", num_layers=L, num_kv_heads=H, num_q_heads=HQ, head_dim=D,
                                delimiter_ids=frozenset({DELIM})))
    p = CrystalCacheParams(**params)
    R = len(prompts)
    states = [policy.begin_request(p, L, H) for _ in range(R)]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    valid = torch.zeros(L, R, H, S, dtype=torch.bool)
    position = torch.full((L, R, H, S), -1, dtype=torch.int64)
    score = torch.zeros(L, R, H, S)
    keys = torch.stack([torch.randn(L, H, S, D, generator=g) for g in gens], dim=1)
    ids = [[DELIM if (i + seeds[r]) % 9 == 8 else 10 + (i * 7 + seeds[r]) % 50 for i in range(S)] for r in range(R)]
    tensors, maxima = CrystalCachePolicy.batch_params([p] * R)
    summaries = []
    for r, n in enumerate(prompts):
        if not n:
            continue
        valid[:, r, :, :n] = True
        position[:, r, :, :n] = torch.arange(n)
        probe = layer0_probe.ProbeState(n, "cpu", chunk=64)
        layer0_probe.observe(probe, torch.randn(n, HQ, D, generator=gens[r]) * 2, keys[0, r, :, :n],
                             torch.zeros(0, H, D), 1 / math.sqrt(D))
        setattr(states[r], layer0_probe.ATTRIBUTE, probe)
        summaries.append((states[r], ids[r][:n], 0, budget))
    policy.step_inputs([StepRow(state=st, step=0, pool_row=r, budget=budget, prefill=True)
                        for r, st in enumerate(states)], "cpu")
    ending = torch.tensor([r for r, n in enumerate(prompts) if n], dtype=torch.int64)
    if summaries:
        inputs = policy.prompt_attention_inputs(layer0_probe.collect(summaries), "cpu")
        for layer in range(L):
            v = SlotView(valid=valid[layer][ending], position=position[layer][ending],
                         score=score[layer][ending], last_hit=None, keys=None)
            batch = PolicyBatch(layer=layer, budget=torch.full((len(ending), H), budget),
                                step=torch.zeros(len(ending), dtype=torch.int64),
                                params={k: t[ending] for k, t in tensors.items()}, maxima=maxima, inputs=inputs)
            evict = policy.select_prefill(batch, v, Observations())
            if evict is not None:
                valid[layer][ending] = v.valid & ~evict
                position[layer][ending] = torch.where(valid[layer][ending], v.position, -1)
    history, decided = [], []
    for s in range(steps):
        rows = [StepRow(state=st, step=s, pool_row=r, budget=budget, prefill=False)
                for r, st in enumerate(states)]
        inputs = policy.step_inputs(rows, "cpu")
        due = policy.deciding_rows(rows)
        decided.append(due)
        attention = torch.stack([torch.rand(H, S, generator=g) for g in gens])
        for layer in range(L):
            free = (~valid[layer, :, 0]).int().argmax(-1)
            for r in range(R):
                valid[layer, r, :, free[r]] = True
                position[layer, r, :, free[r]] = prompts[r] + s
                score[layer, r, :, free[r]] = 0
            for members, action in (([r for r in range(R) if due[r]], "decide"),
                                    ([r for r in range(R) if not due[r]], "observe")):
                if not members:
                    continue
                g = torch.tensor(members)
                v = SlotView(valid=valid[layer][g], position=position[layer][g], score=score[layer][g],
                             last_hit=torch.zeros(len(members), H, S, dtype=torch.int32), keys=keys[layer][g])
                batch = PolicyBatch(layer=layer, budget=torch.full((len(members), H), budget),
                                    step=torch.full((len(members),), s), params={k: t[g] for k, t in tensors.items()},
                                    maxima=maxima, inputs={k: t[g] for k, t in inputs.items()})
                obs = Observations(attention=attention[g] * v.valid)
                decide = policy.select_decode if action == "decide" else policy.observe_decode
                evict = decide(batch, v, obs)
                score[layer][g] = v.score
                if evict is not None:
                    valid[layer][g] = v.valid & ~evict
                    position[layer][g] = torch.where(valid[layer][g], v.position, -1)
        policy.on_forward_tokens([(st, r, 1) for r, st in enumerate(states)],
                                 torch.tensor([n + s for n in prompts]), torch.tensor([ids[r][n + s] for r, n in
                                                                                       enumerate(prompts)]), None)
        history.append(valid[0].clone())
    return history, decided


def test_a_batch_keeps_what_each_request_keeps_alone():
    prompts, seeds, budget, steps = [300, 40, 0, 170], [1, 2, 3, 4], 70, 140
    params = {"sinks": 4, "recent": 8, "breath": 32}
    S = max(prompts) + steps + 1
    together, decided = _drive(prompts, budget, params, steps, seeds, S)
    for r, (n, seed) in enumerate(zip(prompts, seeds)):
        alone, _ = _drive([n], budget, params, steps, [seed], S)
        for s in range(steps):
            assert torch.equal(together[s][r], alone[s][0]), (r, s)
    # Decisions on the snapshot step and two steps after it (its keep table) only.
    for s, due in enumerate(decided):
        assert all(due) == (s % 32 in (1, 31) and s > 1) and any(due) == all(due)
    # The cycles cut: each request holds at most B + 2 right after one.
    for s in range(33, steps, 32):
        assert int(together[s][:, 0].sum(-1).max()) <= max(66, budget) + 2


class _CopyInFlight:
    """A prompt's trunk table still on its way to the host (a GPU copy not
    landed yet; on the CPU every copy has landed at once)."""

    def __init__(self, copy):
        self.copy, self.landed = copy, False

    def tensor(self):
        return self.copy.tensor()


def test_a_breath_cycle_waits_only_for_its_own_requests_trunk_tables():
    policy = CrystalCachePolicy()
    policy.bind_model(ModelInfo(name="t", num_layers=L, num_kv_heads=H, num_q_heads=HQ, head_dim=D,
                                delimiter_ids=frozenset({DELIM})))
    p = CrystalCacheParams()
    g = torch.Generator().manual_seed(5)
    states = []
    for n in (80, 90):  # two prompts ending in two steps: two packed copies
        st = policy.begin_request(p, L, H)
        probe = layer0_probe.ProbeState(n, "cpu", chunk=64)
        layer0_probe.observe(probe, torch.randn(n, HQ, D, generator=g) * 2, torch.randn(H, n, D, generator=g),
                             torch.zeros(0, H, D), 1 / math.sqrt(D))
        setattr(st, layer0_probe.ATTRIBUTE, probe)
        policy.step_inputs([StepRow(state=st, step=0, pool_row=0, budget=132, prefill=True)], "cpu")
        ids = [DELIM if i % 9 == 8 else 10 + i % 50 for i in range(n)]
        policy.prompt_attention_inputs(layer0_probe.collect([(st, ids, 0, 132)]), "cpu")
        members, shape, copy = policy._prefills[-1]
        policy._prefills[-1] = (members, shape, _CopyInFlight(copy))
        states.append(st)
    first, second = states
    policy._adopt_prefills()  # nothing landed: nothing adopted
    assert first.trunks is None and second.trunks is None
    policy._adopt_prefills(needed={id(second)})  # the second request cycles: only its table is read
    assert first.trunks is None and second.trunks is not None and len(policy._prefills) == 1
    policy._prefills[0][2].landed = True
    policy._adopt_prefills()
    assert first.trunks is not None and policy._prefills == []
