"""CrystalCache prefill S1-S6 (crystalcache.txt §3.2-3.7) on small cases
worked by hand (values in the comments), and properties of branch
dissolution (hypothesis)."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsieve.policies.crystalcache.prefill import (
    branch_dissolve, build_trunks, crystallization, encoding_impact, prefill_budget, prefill_keep,
    saliency_and_edges, sentences, trunk_graph, trunk_impact)


def test_s1_saliency_and_edges_on_a_three_token_prompt_in_chunks_of_two():
    h0 = [[1, 0, 0], [0.5, 0.5, 0], [0.2, 0.3, 0.5]]
    h1 = [[1, 0, 0], [0.9, 0.1, 0], [0.6, 0.2, 0.2]]
    sal, edges = saliency_and_edges(torch.tensor([h0, h1]), chunk=2)
    # Chunk {0, 1}: column sums h0 [1.5, .5], h1 [1.9, .1] -> 3.4, 0.6.
    # Chunk {2}: .5 + .2 = .7.
    assert torch.allclose(sal, torch.tensor([3.4, 0.6, 0.7], dtype=torch.float64))
    # Intra: head-mean rows [1, 0], [.7, .3] -> cos = .7 / sqrt(.58) = .91915.
    # Cross from query 2: head-mean [.4, .25], both > .02.
    assert edges.keys() == {(0, 1), (0, 2), (1, 2)}
    assert math.isclose(edges[(0, 1)], 0.9191450, rel_tol=1e-6)
    assert math.isclose(edges[(0, 2)], 0.4, rel_tol=1e-6) and math.isclose(edges[(1, 2)], 0.25, rel_tol=1e-6)


def test_s1_saliency_is_clipped_to_the_m_range():
    # One head, one token: it receives 1.0 -> stays; a 0-mass key clips to .1.
    sal, _ = saliency_and_edges(torch.tensor([[[1.0, 0.0], [1.0, 0.0]]]), chunk=4)
    assert sal.tolist() == [2.0, 0.1]


# Ten tokens, "." = id 0: sentences [0 1 2] [3 4] [5 6 7 8] [9].
IDS = [1, 2, 0, 3, 0, 4, 5, 6, 0, 7]
EDGES = {(2, 3): 0.5, (1, 4): 0.9, (1, 5): 0.25, (2, 6): 0.25, (0, 9): 0.2, (8, 9): 0.2}


def test_s2_sentences_merge_by_interface_strength():
    sents = sentences(IDS, frozenset({0}))
    assert sents == [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9]]
    # [0 1 2] + [3 4]: edges .5, .9 -> CAS .7 > .3 -> merged (size 5).
    # [0..4] + [5..8]: edges .25, .25 -> .25, no merge. [5..8] + [9]: .2, no.
    assert build_trunks(sents, EDGES) == [[0, 1, 2, 3, 4], [5, 6, 7, 8], [9]]
    # The size cap refuses the merge: 3 + 2 > 4.
    assert build_trunks(sents, EDGES, t_max=4) == [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9]]


def test_s2_splits_a_long_trunk_into_equal_pieces():
    # 7 tokens, cap 3 -> 3 pieces at round(7/3)=2, round(14/3)=5.
    assert build_trunks([list(range(7))], {}, t_max=3) == [[0, 1], [2, 3, 4], [5, 6]]


def test_s3_encoding_impact_with_rarity():
    # ids 5 (twice), 7, 9: U(2) = 1/(1+ln 3) = .476505, U(1) = 1/(1+ln 2) = .590616.
    # M = 20 (S/40 + U/2) = S/2 + 10 U.
    m = encoding_impact(torch.tensor([1.0, 2.0, 0.1, 20.0]), [5, 7, 5, 9])
    expected = [0.5 + 4.765054, 1.0 + 5.906161, 0.05 + 4.765054, 10.0 + 5.906161]
    assert torch.allclose(m, torch.tensor(expected, dtype=torch.float64), atol=1e-5)
    # Top-3 mean of the trunk {0, 1, 3}: (5.265054 + 6.906161 + 15.906161) / 3.
    assert math.isclose(trunk_impact(m, [0, 1, 3]), 28.077376 / 3, rel_tol=1e-6)
    # Clip at M_MAX: S 20 and a unique token -> 10 + 5.9 stays; nothing reaches 20 here.


def test_s4_trunk_graph_and_crystallization():
    trunks = [[0, 1, 2, 3, 4], [5, 6, 7, 8], [9]]
    graph = trunk_graph(trunks, EDGES)
    # A-B: mean .25 * sqrt(2 / 20) = .0790569; A-C: .2 * sqrt(1/5) = .0894427;
    # B-C: .2 * sqrt(1/4) = .1 (all > .05).
    assert graph.keys() == {(0, 1), (0, 2), (1, 2)}
    assert math.isclose(graph[(0, 1)], 0.0790569, rel_tol=1e-5)
    assert math.isclose(graph[(0, 2)], 0.0894427, rel_tol=1e-5)
    assert math.isclose(graph[(1, 2)], 0.1, rel_tol=1e-9)
    # deg = .1684997, .1790569, .1894427; mean .1789998, std .0085501 ->
    # z = -1.2281, .0067, 1.2214 -> logistic(5 z) = .0021495, .508357, .997778.
    d = crystallization(3, graph)
    assert [round(x, 5) for x in d] == [0.00215, 0.50836, 0.99778]


def test_s4_weak_edges_are_pruned_and_flat_degrees_give_one_half():
    # .1 * sqrt(1 / (5 * 4)) = .02236 < .05 -> pruned; all degrees 0 -> sigma
    # falls back to 1, z = 0, D = .5.
    graph = trunk_graph([[0, 1, 2, 3, 4], [5, 6, 7, 8]], {(0, 5): 0.1})
    assert graph == {}
    assert crystallization(2, graph) == [0.5, 0.5]


# Dissolution case: T0 [0 1] (sink, protected), T1 [2..5], T2 [6 7 8],
# T3 [9..13], T4 [14] (recent, protected); n = 15, n_sink = w_recent = 1.
TRUNKS = [[0, 1], [2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13], [14]]
D = [0.9, 0.2, 0.7, 0.1, 0.5]
MBAR = [0.0, 3.0, 1.0, 7.0, 0.0]
# log(1 + M̄): T1 ln 4, T2 ln 2, T3 ln 8 -> minmax .5, 0, 1.
# score = max(D, M~): T1 .5, T2 .7, T3 1.0 -> order T1, T2, T3.
IMPACT = torch.tensor([1.0, 1.0, 4.0, 1.0, 5.0, 3.0] + [1.0] * 9)


def _dissolve(budget):
    return branch_dissolve(TRUNKS, IMPACT, MBAR, D, budget, 15, n_sink=1, w_recent=1)


def test_s6_whole_trunks_then_the_degenerate_partial_overshoots():
    # Budget 10: protected 3, available 7, alive 12 -> cut 5. T1 (4) goes,
    # cut 1; T2 would keep 2 < 3 -> dropped whole (overshoot by 2).
    out = _dissolve(10)
    assert out.kept == [0, 1, 9, 10, 11, 12, 13, 14]
    assert out.ratio == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert out.crystal == [0.9, 0.0, 0.0, 0.1, 0.5]
    # Budget 12: cut 3; T1 would keep 1 -> dropped; nothing else goes.
    assert _dissolve(12).kept == [0, 1] + list(range(6, 15))


def test_s6_partial_trunk_keeps_its_top_m_tokens_and_scales_d():
    # Budget 14: cut 1; T1 keeps 3 of 4 (r = .75): M of 2..5 = 4, 1, 5, 3 ->
    # keeps 2, 4, 5; D(T1) = .75 * .2 = .15.
    out = _dissolve(14)
    assert out.kept == [0, 1, 2, 4, 5] + list(range(6, 15))
    assert out.ratio[1] == 0.75
    assert math.isclose(out.crystal[1], 0.15)
    # Budget 15 covers everything: no eviction.
    assert _dissolve(15).kept == list(range(15))


def test_prefill_budget_floor():
    assert prefill_budget(100, 0.5) == 132  # max(4 + 128, 50)
    assert prefill_budget(1001, 0.3) == 301  # ceil(300.3)


@st.composite
def _cases(draw):
    sizes = draw(st.lists(st.integers(1, 12), min_size=1, max_size=12))
    trunks, pos = [], 0
    for s in sizes:
        trunks.append(list(range(pos, pos + s)))
        pos += s
    n = pos
    impact = torch.tensor(draw(st.lists(st.floats(0.1, 20.0), min_size=n, max_size=n)), dtype=torch.float64)
    mbar = [trunk_impact(impact, g) for g in trunks]
    d = draw(st.lists(st.floats(0.0, 1.0), min_size=len(trunks), max_size=len(trunks)))
    n_sink, w_recent = draw(st.integers(0, 3)), draw(st.integers(0, 5))
    protected = sum(len(g) for g in trunks if any(p < n_sink or p >= n - w_recent for p in g))
    budget = draw(st.integers(protected, n + 3))
    return trunks, impact, mbar, d, budget, n, n_sink, w_recent


@settings(max_examples=200, deadline=None)
@given(_cases())
def test_dissolution_properties(case):
    trunks, impact, mbar, d, budget, n, n_sink, w_recent = case
    out = branch_dissolve(trunks, impact, mbar, d, budget, n, n_sink=n_sink, w_recent=w_recent)
    assert len(out.kept) <= budget  # never above budget
    if n > 0:
        assert n - 1 in out.kept or w_recent == 0  # the newest token stays while protected
    for g, prot in zip(trunks, out.protected):
        if prot:
            assert set(g) <= set(out.kept)
    # Overshoot is bounded by N_MIN - 1 per the degenerate-partial rule.
    assert len(out.kept) >= min(budget, n) - 2
    again = branch_dissolve(trunks, impact, mbar, d, budget, n, n_sink=n_sink, w_recent=w_recent)
    assert again == out  # deterministic


def test_prefill_end_to_end_keeps_sink_recent_and_the_rare_trunk():
    # 300 tokens, one head of uniform causal attention (row q = 1/(q+1) on
    # 0..q): cos of rows i < j is sqrt((i+1)/(j+1)), high for neighbours, so
    # each sentence merges with the next (CAS > .3) while the trunk stays
    # <= 32: sentences of 10 -> trunks of 30. Positions 40..48 carry unique
    # ids (rarity .59 vs ~.15) -> trunk 1 has M~ = 1, the top score.
    # beta .8 -> B = 240. Protected: trunk 0 (sink) and trunks touching
    # [172, 300): 150..299 -> 30 + 150 = 180; room 60 of the 120 alive
    # tokens -> the two lowest-score trunks among 2, 3, 4 go whole.
    n = 300
    attn = torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1).unsqueeze(1)
    ids = [1] * n
    for s in range(30):
        ids[s * 10 + 9] = 0
    for p in range(40, 49):
        ids[p] = 100 + p
    out = prefill_keep(attn.unsqueeze(0), ids, frozenset({0}), prefill_budget(n, 0.8))
    assert out.trunks == [list(range(30 * k, 30 * k + 30)) for k in range(10)]
    kept = set(out.dissolution.kept)
    assert len(kept) == 240
    assert set(range(60)) | set(range(150, 300)) <= kept
    assert sum(1 for k in (2, 3, 4) if 30 * k in kept) == 1


def test_prefill_protected_trunks_can_exceed_the_budget():
    # Same text, 140 tokens: trunks of 30 and the recent window [12, 140)
    # touches every trunk -> all 140 protected although B = 132 (the paper's
    # floor covers 4 + 128 tokens, not the trunks around them: the ceiling
    # the engine reserves must allow up to 2 * (32 - 1) more).
    n = 140
    attn = torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1).unsqueeze(1)
    ids = [1] * n
    for s in range(14):
        ids[s * 10 + 9] = 0
    out = prefill_keep(attn.unsqueeze(0), ids, frozenset({0}), prefill_budget(n, 0.5))
    assert out.dissolution.kept == list(range(n))
