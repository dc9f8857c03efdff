"""crystalcache's per-task knobs of issue #30 (crystalcache.txt §8 L6, Table 2):
T_max (S2, §3.3), tau_merge (S2, §3.3) and alpha (S5, §3.6) as per-request
params: bounds surface as a 400 naming `kv_policy.params.<field>`, each knob
changes the selection in small hand-checked cases (the batched prefill, the
per-request specification and the decode trunk table alike), and a batch
mixing rows with different knobs equals each row run alone."""

import math

import httpx
import pytest
import torch

from kvsieve.policies import KVPolicyError, parse_kv_policy
from kvsieve.policies.base import ModelInfo, StepRow
from kvsieve.policies.crystalcache.policy import CrystalCacheParams, CrystalCachePolicy, budget_floor, prompt_edges
from kvsieve.policies.crystalcache.prefill import (
    M_MAX, M_MIN, Dissolution, PrefillResult, branch_dissolve, build_trunks, crystallization, encoding_impact,
    sentences, trunk_graph, trunk_impact)
from kvsieve.policies.crystalcache.prefill_batched import prefill_rows
from kvsieve.policies.crystalcache.trunks import CrystalTrunks
from kvsieve.radix_ext import layer0_probe

from test_compressed import complete
from test_crystalcache_policy import run as run_policy

DELIM = 0
H, HQ, D = 2, 4, 8


# ----- bounds ---------------------------------------------------------------------
@pytest.mark.parametrize("params,field", [
    ({"t_max": 0}, "t_max"), ({"t_max": 257}, "t_max"), ({"t_max": 8.5}, "t_max"), ({"t_max": True}, "t_max"),
    ({"tau_merge": -0.01}, "tau_merge"), ({"tau_merge": 1.01}, "tau_merge"), ({"tau_merge": math.nan}, "tau_merge"),
    ({"tau_merge": "0.3"}, "tau_merge"),
    ({"alpha": -0.5}, "alpha"), ({"alpha": 16.5}, "alpha"), ({"alpha": math.inf}, "alpha"),
])
def test_out_of_bounds_knobs_are_refused_naming_the_field(params, field):
    with pytest.raises(KVPolicyError) as err:
        parse_kv_policy({"name": "crystalcache", "params": params})
    assert err.value.field == f"kv_policy.params.{field}"


def test_defaults_are_table_2_and_the_bounds_are_inclusive():
    assert parse_kv_policy({"name": "crystalcache"}).params == {
        "sinks": 4, "recent": 128, "breath": 64, "decode": True, "t_max": 32, "tau_merge": 0.3, "alpha": 1.0}
    for t_max, tau, alpha in ((1, 0, 0), (256, 1, 16), (48, 0.5, 2.0)):
        got = parse_kv_policy({"name": "crystalcache", "budget": 1024,
                               "params": {"t_max": t_max, "tau_merge": tau, "alpha": alpha}}).params
        assert (got["t_max"], got["tau_merge"], got["alpha"]) == (t_max, tau, alpha)


def test_the_budget_floor_follows_t_max():
    # floor = max(sinks + recent, sinks + 2 (t_max - 1))
    assert budget_floor(CrystalCacheParams(sinks=4, recent=8)) == 66
    assert budget_floor(CrystalCacheParams(sinks=4, recent=8, t_max=8)) == 18
    assert budget_floor(CrystalCacheParams(sinks=4, recent=8, t_max=64)) == 130
    params = {"sinks": 4, "recent": 8, "t_max": 8}
    assert parse_kv_policy({"name": "crystalcache", "budget": 18, "params": params}).budget == 18
    with pytest.raises(KVPolicyError) as err:
        parse_kv_policy({"name": "crystalcache", "budget": 66, "params": {**params, "t_max": 64}})
    assert err.value.field == "kv_policy.budget" and "sinks + 126" in str(err.value)


def test_bad_knobs_are_a_400_naming_the_field(llama_server):
    for params, field in (({"t_max": 0}, "t_max"), ({"tau_merge": 2.0}, "tau_merge"), ({"alpha": -1}, "alpha")):
        body = {"prompt": [1, 2], "max_tokens": 2, "kv_policy": {"name": "crystalcache", "params": params}}
        r = httpx.post(f"{llama_server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and f"kv_policy.params.{field}" in r.text, r.text


def test_a_request_with_other_knobs_runs_and_cuts(llama_server):
    params = {"sinks": 4, "recent": 8, "t_max": 8, "tau_merge": 0.5, "alpha": 0.5}
    prompt = [407] + [30 + (13 * i) % 70 for i in range(59)]
    out = complete(llama_server, prompt, {"name": "crystalcache", "budget": 20, "params": params}, max_tokens=8)
    kv = out["kv_usage"]
    assert kv["policy"] == "crystalcache" and kv["evicted_tokens"] > 0
    assert kv["retained_tokens"] < kv["private_tokens"]


# ----- hand-checked cases ----------------------------------------------------------
def hand_rows(ids, saliency, edges, budget, sinks=0, recent=0):
    """prefill_rows inputs of one prompt with the given intra edges {(i, j): w}."""
    n = len(ids)
    intra_index = torch.full((n, 8), -1, dtype=torch.int64)
    intra_weight = torch.zeros(n, 8, dtype=torch.float64)
    for k, ((i, j), w) in enumerate(edges.items()):
        intra_index[i, k], intra_weight[i, k] = j, w
    return dict(saliency=torch.tensor(saliency, dtype=torch.float64), intra_index=intra_index,
                intra_weight=intra_weight, cross_index=torch.full((n, 4), -1, dtype=torch.int64),
                cross_weight=torch.zeros(n, 4, dtype=torch.float64), ids=torch.tensor(ids), budget=budget,
                sinks=sinks, recent=recent)


def batched(rows, knobs):
    """prefill_rows over `rows` (hand_rows dicts) with knobs [(t_max, tau_merge, alpha)] per row."""
    pad = torch.nn.utils.rnn.pad_sequence
    lengths = [len(r["ids"]) for r in rows]
    N = max(lengths)
    ids = torch.full((len(rows), N), -1, dtype=torch.int64)
    for e, r in enumerate(rows):
        ids[e, :lengths[e]] = r["ids"]
    return prefill_rows(
        pad([r["saliency"] for r in rows], batch_first=True),
        pad([r["intra_index"] for r in rows], batch_first=True, padding_value=-1),
        pad([r["intra_weight"] for r in rows], batch_first=True),
        pad([r["cross_index"] for r in rows], batch_first=True, padding_value=-1),
        pad([r["cross_weight"] for r in rows], batch_first=True), ids, torch.tensor(lengths),
        torch.tensor([DELIM]), torch.tensor([r["budget"] for r in rows]), torch.tensor([r["sinks"] for r in rows]),
        torch.tensor([r["recent"] for r in rows]), t_max=torch.tensor([k[0] for k in knobs]),
        tau_merge=torch.tensor([k[1] for k in knobs], dtype=torch.float64),
        alpha=torch.tensor([k[2] for k in knobs], dtype=torch.float64), max_t_max=max(k[0] for k in knobs))


def trunks_of(out, r, n):
    return [[p for p in range(n) if int(out.trunk[r, p]) == t] for t in range(int(out.trunks[r]))]


# Two sentences of 4 tokens ([0..3], [4..7]) whose interface (last 5 x
# first 5 tokens) holds one edge, (3, 4) of weight 0.5: CAS = 0.5.
MERGE_IDS = [5, 6, 7, DELIM, 8, 9, 10, DELIM]
MERGE_CASES = [  # (t_max, tau_merge, trunks)
    (32, 0.3, [[0, 1, 2, 3, 4, 5, 6, 7]]),  # defaults: 0.5 > 0.3 and 8 <= 32 tokens: one trunk
    (32, 0.5, [[0, 1, 2, 3], [4, 5, 6, 7]]),  # CAS must exceed tau_merge strictly
    (32, 0.6, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (8, 0.3, [[0, 1, 2, 3, 4, 5, 6, 7]]),  # 8 tokens fit T_max 8
    (7, 0.3, [[0, 1, 2, 3], [4, 5, 6, 7]]),  # ... not 7
    (3, 0.3, [[0, 1], [2, 3], [4, 5], [6, 7]]),  # each 4-token sentence split in 2 near-equal trunks
    (1, 0.0, [[p] for p in range(8)]),
]


@pytest.mark.parametrize("t_max,tau_merge,expected", MERGE_CASES)
def test_t_max_and_tau_merge_decide_the_trunks(t_max, tau_merge, expected):
    row = hand_rows(MERGE_IDS, [1.0] * 8, {(3, 4): 0.5}, budget=100)
    assert build_trunks(sentences(MERGE_IDS, frozenset({DELIM})), {(3, 4): 0.5}, t_max, tau_merge) == expected
    out = batched([row], [(t_max, tau_merge, 1.0)])
    assert trunks_of(out, 0, 8) == expected
    assert out.keep.all()  # the budget covers the prompt


# Two sentences, no edges: both trunks get D = logistic(0) = 0.5; trunk 0's
# tokens are salient (M̄ ~ 10.9), trunk 1's are not (M̄ ~ 6.0). Budget 4 of
# 8: one trunk goes whole. alpha 1: trunk 0 scores ~1 > 0.5, trunk 1 goes.
# alpha 0.4 (or 0): both score 0.5, the tie drops the earlier trunk 0.
ALPHA_IDS = [1, 2, 3, DELIM, 4, 5, 6, DELIM]
ALPHA_SALIENCY = [10.0] * 4 + [0.1] * 4
ALPHA_CASES = [(1.0, [0, 1, 2, 3]), (0.6, [0, 1, 2, 3]), (0.4, [4, 5, 6, 7]), (0.0, [4, 5, 6, 7])]


@pytest.mark.parametrize("alpha,kept", ALPHA_CASES)
def test_alpha_decides_which_trunk_survives(alpha, kept):
    row = hand_rows(ALPHA_IDS, ALPHA_SALIENCY, {}, budget=4)
    out = batched([row], [(32, 0.3, alpha)])
    assert trunks_of(out, 0, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert out.trunk_m[0, 0] > out.trunk_m[0, 1]
    assert out.keep[0].nonzero().flatten().tolist() == kept
    # the specification agrees
    impact = encoding_impact(torch.tensor(ALPHA_SALIENCY, dtype=torch.float64), ALPHA_IDS)
    trunks = [[0, 1, 2, 3], [4, 5, 6, 7]]
    trunk_m = [trunk_impact(impact, g) for g in trunks]
    assert branch_dissolve(trunks, impact, trunk_m, [0.5, 0.5], 4, 8, 0, 0, alpha=alpha).kept == kept


def test_alpha_reaches_the_decode_re_eviction():
    # Trunk 0: D 0.9, M̄ 1; trunk 1: D 0.2, M̄ 10. Room for one trunk, no
    # active trunk (no resonance), no graph. alpha 1: trunk 1 scores ~1 >
    # 0.9, trunk 0 goes; alpha 0.5: trunk 1 scores 0.5 < 0.9, it goes.
    def kept(alpha):
        result = PrefillResult(Dissolution(list(range(6)), [1.0, 1.0], [0.9, 0.2]), [[0, 1, 2], [3, 4, 5]],
                               torch.ones(6, dtype=torch.float64), [1.0, 10.0], {})
        return CrystalTrunks(result, [7] * 6, frozenset({DELIM}), alpha=alpha).breath({}, 3, n_sink=0)
    assert kept(1.0) == [3, 4, 5]
    assert kept(0.5) == [0, 1, 2]


def test_t_max_bounds_the_unfinished_decoded_sentence():
    for t_max, closed in ((32, []), (4, [[100, 101, 102, 103]]), (3, [[100, 101, 102]])):
        result = PrefillResult(Dissolution([], [], []), [], torch.zeros(0, dtype=torch.float64), [], {})
        trunks = CrystalTrunks(result, [], frozenset({DELIM}), t_max=t_max)
        for p in range(100, 105):
            trunks.add_token(p, 9)
        assert trunks.trunks == closed
        assert len(trunks.pending) == 5 - sum(map(len, closed))


@pytest.mark.parametrize("params,budget", [({"sinks": 4, "recent": 8, "t_max": 8}, 18),
                                           ({"sinks": 4, "recent": 8, "t_max": 4, "tau_merge": 0.0,
                                             "alpha": 0.25, "breath": 16}, 30)])
def test_small_t_max_holds_the_ceiling_and_cuts_to_its_lower_floor(params, budget):
    steps = 100
    held, policy, p = run_policy(120, budget, params, steps)
    B = max(budget_floor(p), budget)
    assert B == budget
    assert max(held) <= policy.max_private_tokens(p, 120, steps, budget)
    assert held[0] <= policy.kept_after_prefill(p, 120, budget)
    for s in range(p.breath, steps - 1, p.breath):  # the keep table at step s + 1
        assert held[s + 2] <= B + 2


# ----- mixed batches ---------------------------------------------------------------
def _probe(n, seed, chunk=32, sharp=2.0):
    g = torch.Generator().manual_seed(seed)
    probe = layer0_probe.ProbeState(n, "cpu", chunk=chunk)
    layer0_probe.observe(probe, torch.randn(n, HQ, D, generator=g) * sharp, torch.randn(H, n, D, generator=g),
                         torch.zeros(0, H, D), 1 / math.sqrt(D))
    return probe


def _ids(n, seed, every):
    g = torch.Generator().manual_seed(1000 + seed)
    tok = torch.randint(1, 40, (n,), generator=g)
    return torch.where(torch.rand(n, generator=g) < 1 / every, DELIM, tok).tolist()


KNOBS = [(32, 0.3, 1.0), (8, 0.05, 0.3), (3, 0.6, 4.0), (48, 0.0, 0.0), (16, 0.3, 1.0)]
LENGTHS = [150, 90, 200, 61, 120]
BUDGETS = [40, 30, 50, 20, 60]


def _states(policy, knobs, lengths, budgets, every=5):
    out = []
    for r, ((t_max, tau, alpha), n, budget) in enumerate(zip(knobs, lengths, budgets)):
        params = CrystalCacheParams(sinks=4, recent=8, t_max=t_max, tau_merge=tau, alpha=alpha)
        state = policy.begin_request(params, 2, H)
        setattr(state, layer0_probe.ATTRIBUTE, _probe(n, r))
        out.append((state, _ids(n, r, every), 3 * r, budget))
    return out


def _policy():
    policy = CrystalCachePolicy()
    policy.bind_model(ModelInfo(name="t", num_layers=2, num_kv_heads=H, num_q_heads=HQ, head_dim=D,
                                delimiter_ids=frozenset({DELIM})))
    return policy


def _select(policy, requests):
    """prompt_attention_inputs over the requests at once, then the trunk
    tables adopted at the next step: (keep table, [(trunks, crystal, t_max, alpha)])."""
    rows = layer0_probe.collect(requests)
    table = policy.prompt_attention_inputs(rows, "cpu")["keep"]
    policy.step_inputs([StepRow(state=s, step=0, pool_row=i, budget=b, prefill=False)
                        for i, (s, _, _, b) in enumerate(requests)], "cpu")
    tables = [(s.trunks.trunks, s.trunks.crystal, s.trunks.t_max, s.trunks.alpha) for s, _, _, _ in requests]
    return table, tables


def test_a_mixed_batch_equals_each_row_alone():
    policy = _policy()
    mixed, mixed_tables = _select(policy, _states(policy, KNOBS, LENGTHS, BUDGETS))
    for r in range(len(KNOBS)):
        policy = _policy()
        one = _states(policy, KNOBS, LENGTHS, BUDGETS)[r]
        alone, alone_tables = _select(policy, [one])
        width = alone.shape[1]
        assert torch.equal(mixed[r, :width], alone[0]), r
        assert mixed[r, width:].all()  # past the row's prompt: not judged, kept
        assert mixed_tables[r] == alone_tables[0], r
        assert alone_tables[0][2:] == KNOBS[r][0:1] + KNOBS[r][2:]
    # the knobs matter here: the same prompts under the defaults select otherwise
    policy = _policy()
    default, _ = _select(policy, _states(policy, [(32, 0.3, 1.0)] * len(KNOBS), LENGTHS, BUDGETS))
    differs = [not torch.equal(default[r], mixed[r]) for r in range(len(KNOBS))]
    assert not differs[0] and sum(differs[1:]) >= 3, differs  # row 0's knobs are the defaults


def _reference(pa, ids, budget, sinks, recent, t_max, tau_merge, alpha):
    n = len(ids)
    edges = prompt_edges(pa)
    impact = encoding_impact(pa.saliency.double().clamp(M_MIN, M_MAX), ids)
    trunks = build_trunks(sentences(ids, frozenset({DELIM})), edges, t_max, tau_merge)
    trunk_m = [trunk_impact(impact, t) for t in trunks]
    crystal = crystallization(len(trunks), trunk_graph(trunks, edges))
    return trunks, branch_dissolve(trunks, impact, trunk_m, crystal, budget, n, sinks, recent, alpha=alpha)


@pytest.mark.parametrize("every", [3, 8])
def test_batched_knobs_equal_the_per_request_specification(every):
    policy = _policy()
    requests = _states(policy, KNOBS, LENGTHS, BUDGETS, every)
    rows = layer0_probe.collect(requests)
    out = batched([dict(saliency=pa.saliency, intra_index=pa.intra_index, intra_weight=pa.intra_weight,
                        cross_index=pa.cross_index, cross_weight=pa.cross_weight, ids=torch.tensor(ids),
                        budget=budget, sinks=4, recent=8) for pa, (_, ids, _, budget) in zip(rows, requests)], KNOBS)
    for r, (pa, (_, ids, _, budget), (t_max, tau, alpha)) in enumerate(zip(rows, requests, KNOBS)):
        trunks, diss = _reference(pa, ids, budget, 4, 8, t_max, tau, alpha)
        assert trunks_of(out, r, len(ids)) == trunks, r
        assert max(map(len, trunks)) <= t_max
        assert out.keep[r, :len(ids)].nonzero().flatten().tolist() == diss.kept, r
        assert torch.allclose(out.crystal[r, :len(trunks)], torch.tensor(diss.crystal, dtype=torch.float64),
                              rtol=1e-9, atol=1e-15)
