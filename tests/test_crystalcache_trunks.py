"""CrystalCache's trunk table through the decode phase: a decoded sentence
becomes a trunk with M_i from received attention and rarity, D decays, and
the breath cycle re-evicts keeping the sink and the unfinished sentence
(worked by hand)."""

import math

import torch

from kvsieve.policies.crystalcache.prefill import Dissolution, PrefillResult, encoding_impact
from kvsieve.policies.crystalcache.trunks import CrystalTrunks, token_impact


def _table():
    # Prompt "a b c d e f ." (ids 1..6, 0): trunks [0..3] and [4 5 6], all kept.
    prefill = PrefillResult(Dissolution([0, 1, 2, 3, 4, 5, 6], [1.0, 1.0], [0.9, 0.2], [True, False]),
                            [[0, 1, 2, 3], [4, 5, 6]], torch.full((7,), 2.0), [2.0, 2.0], {})
    return CrystalTrunks(prefill, [1, 2, 3, 4, 5, 6, 0], frozenset({0}))


def test_a_decoded_sentence_becomes_a_trunk():
    t = _table()
    t.add_token(7, 9)
    t.receive({7: 3.0})
    t.add_token(8, 0)
    # S = [3.0, clip(0) = .1]; counts: 9 once, "." twice -> U .590616, .476505.
    # M = S/2 + 10 U = 7.406161, 4.815054; M̄ = mean of both = 6.110608; D .5.
    assert t.trunks[-1] == [7, 8] and t.pending == []
    assert math.isclose(t.impact[7], 7.406161, rel_tol=1e-6)
    assert math.isclose(t.impact[8], 4.815054, rel_tol=1e-6)
    assert math.isclose(t.trunk_m[-1], 6.110608, rel_tol=1e-6)
    assert t.crystal[-1] == 0.5
    # One step: D0 = .9 - .05 exp(-.9 * 2 / 2) .9 = .9 - .0182957 = .8817043.
    assert t.step() is False
    assert math.isclose(t.crystal[0], 0.8817043, rel_tol=1e-6)


def test_breath_re_evicts_and_keeps_sink_and_unfinished_sentence():
    t = _table()
    t.add_token(7, 9)
    t.receive({7: 3.0})
    t.add_token(8, 0)
    t.step()
    t.add_token(9, 5)  # unfinished sentence: kept, takes one of the budget
    # Budget 8 -> room 7; trunk 0 protected (sink, 4); alive [4 5 6] and
    # [7 8] (5) -> cut 2. M~: ln 3 vs ln 7.11 -> 0, 1; scores D1 ~ .19 < 1.
    # [4 5 6] would keep 1 < 3 -> dropped whole.
    assert t.breath({}, 8) == [0, 1, 2, 3, 7, 8, 9]
    assert t.trunks[1] == [] and t.crystal[1] == 0.0


def test_a_long_unfinished_sentence_closes_at_t_max():
    t = _table()
    for p in range(7, 7 + 32):
        t.add_token(p, 42)
    assert t.pending == [] and t.trunks[-1] == list(range(7, 39))


def test_a_decoded_token_is_scored_like_a_prompt_token():
    # The decode phase's per-token M_i (plain floats) is the prefill's S3
    # (tensors, fed S_i clipped as S1 clips it) for the same attention and id count.
    ids = [5, 5, 5, 8, 9, 9]
    saliency = torch.tensor([0.0, 0.05, 3.0, 25.0, 7.5, 19.0], dtype=torch.float64)
    expected = encoding_impact(saliency.clamp(0.1, 20.0), ids).tolist()
    counts = [ids.count(t) for t in ids]
    got = [token_impact(float(s), c) for s, c in zip(saliency, counts)]
    assert all(math.isclose(g, e, rel_tol=1e-12) for g, e in zip(got, expected)), (got, expected)
