"""How CrystalCache's per-request keep-set reaches the batched decisions:
the host builds, per request, a [width] keep table over token positions
(True: keep) once per prefill end / breath cycle; step_inputs ships it as
an [R, width] tensor; every layer's decision gathers it by view.position on
the device (one index set for all layers and heads, no sync).

Positions the host has not judged yet (at or past `judged` of the row: the
unfinished sentence, the current token) are kept, so the newest token can
never be evicted by a stale table.
"""

from __future__ import annotations

import torch

from ..observations import SlotView


def keep_table(kept: list[list[int]], judged: list[int], width: int) -> torch.Tensor:
    """[R, width] bool on the host: True at kept positions and at every
    position >= judged[r] (not judged yet)."""
    table = torch.zeros(len(kept), width, dtype=torch.bool)
    for r, (positions, upto) in enumerate(zip(kept, judged)):
        table[r, torch.tensor(positions, dtype=torch.int64)] = True
        table[r, upto:] = True
    return table


def keep_width(positions: int) -> int:
    """A keep table's width for `positions` judged positions and the one
    after them: multiples of 256 up to 1,024, then four per doubling (1,280,
    1,536, 1,792, 2,048, 2,560, ...: at most a quarter more). The keep
    step's graph is keyed by the table's shape; every breath cycle judges
    ~`breath` positions more, and an exact width made each cycle a new
    capture. Positions past `judged` are kept, so the padding changes nothing."""
    if positions <= 1024:
        return max(256, -(-positions // 256) * 256)
    step = 1 << ((positions - 1).bit_length() - 3)
    return -(-positions // step) * step


def evict_outside(table: torch.Tensor, view: SlotView) -> torch.Tensor:
    """Eviction mask [R, H, S]: valid slots whose position the table does not
    keep; positions past the table's width are kept."""
    rows, heads, slots = view.position.shape
    width = table.shape[1]
    pos = view.position.clamp(min=0, max=width - 1).reshape(rows, heads * slots)
    kept = table.gather(1, pos).view(rows, heads, slots) | (view.position >= width)
    return view.valid & ~kept
