"""CrystalCache's keep table applied to a batch of slots (one index set for
every head), checked slot by slot by hand."""

import torch

from kvsieve.policies.crystalcache.select import evict_outside, keep_table, keep_width
from kvsieve.policies.observations import SlotView


def _view(position):
    position = torch.tensor(position)
    return SlotView(valid=position >= 0, position=position, score=torch.zeros(position.shape),
                    last_hit=torch.zeros(position.shape, dtype=torch.int32))


def test_keep_table_marks_kept_and_unjudged_positions():
    # Row 0 judged up to 4, keeps 0, 2: [T F T F | T T]; row 1 judged up to 6 keeps 5.
    table = keep_table([[0, 2], [5]], [4, 6], 6)
    assert table.tolist() == [[True, False, True, False, True, True],
                              [False, False, False, False, False, True]]


def test_evict_outside_applies_one_set_to_every_head_and_keeps_newer_positions():
    table = keep_table([[0, 2], [5]], [4, 6], 6)
    # Row 0, two heads, slots unordered, -1 free; row 1 holds position 7 (past
    # the table: kept) and 3 (not kept).
    view = _view([[[2, 1, -1, 3], [3, 0, 4, -1]],
                  [[7, 3, 5, -1], [-1, 5, 1, 7]]])
    mask = evict_outside(table, view)
    assert mask.tolist() == [[[False, True, False, True], [True, False, False, False]],
                             [[False, True, False, False], [False, False, True, False]]]


def test_keep_widths_come_in_buckets_that_hold_every_position():
    # The keep step's graph is keyed by the table's shape: cycles ~64
    # positions apart share a width, and a width always covers the positions.
    widths = [keep_width(n) for n in range(1, 20000, 7)]
    assert all(w >= n for w, n in zip(widths, range(1, 20000, 7)))
    assert all(w <= max(n + 255, 1.25 * n) for w, n in zip(widths, range(1, 20000, 7)))
    assert len(set(widths)) <= 24
    assert keep_width(300) == keep_width(300 + 64) == 512
