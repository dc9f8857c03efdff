"""Crystal-KV Algorithm 2 (adaptive layer/head budgets) on known CRF tables,
worked by hand, and properties (hypothesis) of the rounding."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsieve.policies.crystal_kv.budgets import largest_remainder, reallocate_budgets


def test_algorithm_2_on_a_known_crf_table_without_a_floor():
    # B = [[4, 12], [8, 8]] (total 32), CRF = [[4, 4], [2, 6]].
    # eta_0 = 8/16 = .5, eta_1 = 8/16 = .5 -> 16 tokens per layer.
    # Layer 0: eta = 4/4 = 1, 4/12 = 1/3 -> shares .75, .25 -> 12, 4.
    # Layer 1: eta = 2/8 = .25, 6/8 = .75 -> 4, 12.
    new = reallocate_budgets(torch.tensor([[4.0, 4.0], [2.0, 6.0]]), torch.tensor([[4, 12], [8, 8]]), 0)
    assert new.tolist() == [[12, 4], [4, 12]]


def test_algorithm_2_with_the_floor_and_largest_remainder():
    # B = 10 everywhere (total 40), CRF = [[6, 2], [1, 1]], floor 2.
    # eta_0 = 8/20 = .4, eta_1 = 2/20 = .1 -> layer shares .8, .2.
    # Heads: layer 0 .6/.2 -> .75, .25; layer 1 -> .5, .5.
    # Weights [[.6, .2], [.1, .1]]. Floors take 4 * 2 = 8; the other 32:
    # [[19.2, 6.4], [3.2, 3.2]] -> floors 19, 6, 3, 3 (31), one left to the
    # largest remainder (.4, head (0, 1)) -> [[19, 7], [3, 3]] + 2.
    new = reallocate_budgets(torch.tensor([[6.0, 2.0], [1.0, 1.0]]), torch.full((2, 2), 10), 2)
    assert new.tolist() == [[21, 9], [5, 5]]


def test_no_crf_keeps_the_budgets_and_a_silent_layer_gets_floors_only():
    budgets = torch.tensor([[3, 5], [7, 9]])
    assert reallocate_budgets(torch.zeros(2, 2), budgets, 1).tolist() == [[3, 5], [7, 9]]
    # Layer 1 has no CRF: floors of 1; layer 0 shares 24 - 4 = 20 as CRF 1:3
    # over equal budgets -> 5, 15 (+1 each).
    new = reallocate_budgets(torch.tensor([[1.0, 3.0], [0.0, 0.0]]), torch.full((2, 2), 6), 1)
    assert new.tolist() == [[6, 16], [1, 1]]


def test_largest_remainder_breaks_ties_by_flat_index():
    # 1/3 each of 2: floors 0, remainders equal -> the first two get one.
    assert largest_remainder(torch.tensor([2 / 3, 2 / 3, 2 / 3], dtype=torch.float64), 2).tolist() == [1, 1, 0]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 8), st.integers(0, 2**16))
def test_total_kept_floor_respected_and_deterministic(layers, heads, floor, seed):
    g = torch.Generator().manual_seed(seed)
    budgets = torch.randint(1, 40, (layers, heads), generator=g)
    crf = torch.rand(layers, heads, generator=g) * torch.randint(0, 2, (layers, heads), generator=g) * 50
    new = reallocate_budgets(crf, budgets, floor)
    assert int(new.sum()) == int(budgets.sum())
    if bool((crf > 0).any()):
        assert int(new.min()) >= min(floor, int(budgets.sum()) // budgets.numel())
    assert torch.equal(new, reallocate_budgets(crf.clone(), budgets.clone(), floor))
