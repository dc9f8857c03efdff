"""The breath cycle's per-position view of its snapshots (worked by hand):
attention summed over the heads holding a position, the inverse mean key
norm, every cycling request reduced together without mixing them up."""

import math

import torch

from kvsieve.policies.crystalcache.snapshot import position_tables


def _snapshot(slots: list[list[tuple[int, float, float]]], width: int) -> torch.Tensor:
    """[4, H, width] from each head's (position, attention, key norm) slots."""
    out = torch.zeros(4, len(slots), width, dtype=torch.float64)
    for h, head in enumerate(slots):
        for s, (p, a, k) in enumerate(head):
            out[:, h, s] = torch.tensor([p, a, 1.0, k], dtype=torch.float64)
    return out


def test_positions_sum_over_heads_and_requests_stay_apart():
    first = _snapshot([[(0, 0.5, 2.0), (3, 0.25, 4.0)], [(3, 0.125, 2.0), (7, 1.0, 1.0)]], width=3)
    second = _snapshot([[(3, 2.0, 8.0)], [(3, 2.0, 8.0)]], width=5)  # more slots than the first
    second[:, 0, 2] = torch.tensor([9.0, 5.0, 0.0, 1.0], dtype=torch.float64)  # an invalid slot counts nowhere
    empty = torch.zeros(4, 2, 3, dtype=torch.float64)
    a, b, c = position_tables([first, second, empty])
    assert a.present == [0, 3, 7]
    assert a.mass == {0: 0.5, 3: 0.375, 7: 1.0}
    # Position 3: two heads, norms 4 and 2 -> 2 / 6.
    assert a.inv_key_norm[0] == 0.5 and math.isclose(a.inv_key_norm[3], 1 / 3) and a.inv_key_norm[7] == 1.0
    assert b.present == [3] and b.mass == {3: 4.0} and b.inv_key_norm == {3: 0.125}
    assert c.present == [] and c.mass == {} and c.inv_key_norm == {}


def test_no_valid_slot_anywhere():
    tables = position_tables([torch.zeros(4, 2, 3, dtype=torch.float64)] * 2)
    assert [t.present for t in tables] == [[], []]
    assert position_tables([]) == []
