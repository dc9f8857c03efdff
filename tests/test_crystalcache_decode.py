"""CrystalCache decode phase (crystalcache.txt §3.8): D decay, activation,
resonance, Hebbian update and re-eviction on cases worked by hand."""

import math

import torch

from kvsieve.policies.crystalcache.decode import active_trunks, breath_cycle, decay_crystal, hebbian, resonate


def test_d_decay_is_slower_for_high_m():
    # D .5, M̄ 4: rho = .05 exp(-.5 * 4 / 2) = .05 / e = .0183940 -> D = .5 - .0091970.
    # D .5, M̄ 0: rho = .05 -> .475. D 0 stays 0.
    out = decay_crystal([0.5, 0.5, 0.0], [4.0, 0.0, 9.0])
    assert math.isclose(out[0], 0.4908030, rel_tol=1e-6)
    assert math.isclose(out[1], 0.475) and out[2] == 0.0
    # Two steps of M̄ 0: .5 * .95 * .95 = .45125.
    assert math.isclose(decay_crystal([0.5], [0.0], steps=2)[0], 0.45125)


def test_activation_counts_only_cached_tokens():
    # eta = v / 1.0. Trunk 0: 1, .2, .5 -> 2 of 3 above .3 -> active.
    # Trunk 1 (4 evicted): .1, .4 -> 1 of 2, not more than half -> inactive.
    # Trunk 2: nothing cached -> inactive.
    norms = {0: 1.0, 1: 0.2, 2: 0.5, 3: 0.1, 5: 0.4}
    assert active_trunks(norms, [[0, 1, 2], [3, 4, 5], [6]]) == [True, False, False]


def test_resonance_two_hops_with_diminishing_returns():
    # From trunk 0: hop 1 to 1 with pulse .4 * .5 = .2 -> D1 = .5 + .15 * .2 * .5 = .515;
    # hop 2 to 2 with .2 * .5 * .5 = .05 -> D2 = 0 + .15 * .05 = .0075; trunk 3 is 3 hops away.
    graph = {(0, 1): 0.4, (1, 2): 0.5, (2, 3): 0.9}
    out = resonate([0.2, 0.5, 0.0, 0.1], graph, [True, False, False, False])
    assert [round(x, 6) for x in out] == [0.2, 0.515, 0.0075, 0.1]


def test_resonance_stops_below_the_pulse_threshold():
    # .03 * .5 = .015 reaches trunk 1; .015 * .5 * .5 = .00375 < .01 stops.
    out = resonate([0.0, 0.0, 0.0], {(0, 1): 0.03, (1, 2): 0.5}, [True, False, False])
    assert [round(x, 6) for x in out] == [0.0, 0.00225, 0.0]


def test_hebbian_reinforces_co_active_edges_and_prunes_faded_ones():
    # Active 0, 1: (0, 1) .4 -> .45; (1, 2) .5 -> .495; (2, 3) .9 -> .891;
    # (3, 4) .0505 -> .049995 < .05 pruned; (0, 1) capped at 1 from .98.
    graph = {(0, 1): 0.4, (1, 2): 0.5, (2, 3): 0.9, (3, 4): 0.0505}
    out = hebbian(graph, [True, True, False, False, False])
    assert out.keys() == {(0, 1), (1, 2), (2, 3)}
    assert [round(out[k], 6) for k in [(0, 1), (1, 2), (2, 3)]] == [0.45, 0.495, 0.891]
    assert hebbian({(0, 1): 0.98}, [True, True]) == {(0, 1): 1.0}


def test_breath_cycle_re_evicts_the_lowest_d_trunk_keeping_the_sink():
    # Trunks [0..3] (sink, protected), [4 5 6], [7 8 9]; no activity, no graph.
    # Equal M̄ -> M~ = 0 for both, score = D: .1 < .9. Budget 7: protected 4,
    # room 3, alive 6 -> cut 3 = the whole of trunk 1.
    trunks = [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    out, graph = breath_cycle(trunks, torch.ones(10), [2.0, 2.0, 2.0], [0.5, 0.1, 0.9], {}, {}, 7)
    assert out.kept == [0, 1, 2, 3, 7, 8, 9]
    assert out.crystal == [0.5, 0.0, 0.9] and graph == {}
