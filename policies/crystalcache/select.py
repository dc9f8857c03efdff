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


def evict_outside(table: torch.Tensor, view: SlotView) -> torch.Tensor:
    """Eviction mask [R, H, S]: valid slots whose position the table does not
    keep; positions past the table's width are kept."""
    rows, heads, slots = view.position.shape
    width = table.shape[1]
    pos = view.position.clamp(min=0, max=width - 1).reshape(rows, heads * slots)
    kept = table.gather(1, pos).view(rows, heads, slots) | (view.position >= width)
    return view.valid & ~kept
