"""S1-S6 for many requests at once on tensors (prefill_batched.py) against
the per-request specification (prefill.py): on random first-layer probes
of prompts of different lengths, delimiter densities, budgets and
protected ends, the same trunks, kept positions, M_i, M̄, D and graph."""

import math
from types import SimpleNamespace

import pytest
import torch

from kvsieve.policies.crystalcache.policy import prompt_edges
from kvsieve.policies.crystalcache.prefill import (
    M_MAX, M_MIN, branch_dissolve, build_trunks, crystallization, encoding_impact, sentences, trunk_graph,
    trunk_impact)
from kvsieve.policies.crystalcache.prefill_batched import prefill_rows
from kvsieve.radix_ext import layer0_probe

H, HQ, D = 2, 4, 8
DELIM = 0


def _probe(n, seed, chunk, sharp):
    g = torch.Generator().manual_seed(seed)
    probe = layer0_probe.ProbeState(n, "cpu", chunk=chunk)
    layer0_probe.observe(probe, torch.randn(n, HQ, D, generator=g) * sharp, torch.randn(H, n, D, generator=g),
                         torch.zeros(0, H, D), 1 / math.sqrt(D))
    return probe


def _reference(pa, ids, budget, sinks, recent):
    n = len(ids)
    saliency = pa.saliency.double().clamp(M_MIN, M_MAX)
    edges = prompt_edges(pa)
    impact = encoding_impact(saliency, ids)
    trunks = build_trunks(sentences(ids, frozenset({DELIM})), edges)
    trunk_m = [trunk_impact(impact, t) for t in trunks]
    graph = trunk_graph(trunks, edges)
    crystal = crystallization(len(trunks), graph)
    return trunks, impact, trunk_m, graph, branch_dissolve(trunks, impact, trunk_m, crystal, budget, n, sinks, recent)


CASES = [  # (lengths, delimiter every ~k tokens, budgets, sinks, recent, chunk, sharpness)
    ([150, 40, 300, 7], 6, [66, 80, 132, 66], 4, 8, 64, 2.0),
    ([300, 299, 64], 3, [66, 200, 100], 4, 8, 64, 0.5),
    ([200, 1, 2, 33], 40, [66, 66, 66, 66], 0, 0, 32, 3.0),
    ([260, 120], 12, [132, 70], 4, 128, 64, 1.0),
    ([90, 90, 90], 2, [66, 66, 300], 2, 4, 16, 4.0),
    # Every prompt shorter than the interface (5): a band lookback past the
    # row's start once crashed the scheduler (issue #28).
    ([3, 2], 2, [1, 1], 0, 0, 16, 1.0),
    ([4], 3, [1], 0, 0, 16, 1.0),
    ([2], 2, [1], 0, 0, 16, 1.0),
    ([5, 1, 4], 2, [1, 1, 1], 0, 0, 16, 2.0),
]


@pytest.mark.parametrize("lengths,every,budgets,sinks,recent,chunk,sharp", CASES)
def test_batched_s1_s6_equals_the_per_request_specification(lengths, every, budgets, sinks, recent, chunk, sharp):
    g = torch.Generator().manual_seed(sum(lengths))
    rows, ids = [], []
    for r, n in enumerate(lengths):
        tok = torch.randint(1, 40, (n,), generator=g)
        tok = torch.where(torch.rand(n, generator=g) < 1 / every, DELIM, tok).tolist()
        probe = _probe(n, r + len(lengths), chunk, sharp)
        holder = SimpleNamespace(**{layer0_probe.ATTRIBUTE: probe})
        rows.append(layer0_probe.collect([(holder, tok, 0, budgets[r])])[0])
        ids.append(tok)
    E, N = len(lengths), max(lengths)

    def pad(get, k=None, fill=0):
        shape = (E, N) if k is None else (E, N, k)
        out = torch.full(shape, fill, dtype=get(rows[0]).dtype)
        for r, pa in enumerate(rows):
            out[r, :lengths[r]] = get(pa)
        return out

    got = prefill_rows(pad(lambda p: p.saliency), pad(lambda p: p.intra_index, 8, -1), pad(lambda p: p.intra_weight, 8),
                       pad(lambda p: p.cross_index, 4, -1), pad(lambda p: p.cross_weight, 4),
                       pad(lambda p: torch.tensor(ids[rows.index(p)])), torch.tensor(lengths),
                       torch.tensor([DELIM]), torch.tensor(budgets), torch.full((E,), sinks),
                       torch.full((E,), recent))
    cuts = 0
    for r, (pa, n) in enumerate(zip(rows, lengths)):
        trunks, impact, trunk_m, graph, diss = _reference(pa, ids[r], budgets[r], sinks, recent)
        T = len(trunks)
        assert int(got.trunks[r]) == T
        assert [[p for p in range(n) if int(got.trunk[r, p]) == t] for t in range(T)] == trunks
        assert torch.allclose(got.impact[r, :n], impact, rtol=1e-12, atol=0)
        assert torch.allclose(got.trunk_m[r, :T], torch.tensor(trunk_m, dtype=torch.float64), rtol=1e-12, atol=0)
        edges = {(int(a), int(b)): w for a, b, w in got.graph[r].tolist() if w > 0}
        assert edges.keys() == graph.keys()
        assert all(math.isclose(edges[k], graph[k], rel_tol=1e-12) for k in graph)
        assert got.keep[r, :n].nonzero().flatten().tolist() == diss.kept
        assert not got.keep[r, n:].any()
        assert torch.allclose(got.crystal[r, :T], torch.tensor(diss.crystal, dtype=torch.float64), rtol=1e-9,
                              atol=1e-15)
        cuts += len(diss.kept) < n
    assert cuts >= 1  # the budgets cut somewhere
