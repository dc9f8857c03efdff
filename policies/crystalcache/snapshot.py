"""The breath cycle's view of the first layer, read from its snapshots.

A snapshot is one request's [4, H, S] host tensor (slot positions, the
layer-0 attention the slots received since the last cycle, valid, key
norms) over every head. The cycle wants it per position: the attention
mass a position received (summed over heads) and its inverse key norm
(heads holding it / the sum of their key norms). Every request cycling in a
step is reduced in one pass: a few tensor ops for the batch instead of a
few per request, and one list per quantity for the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PositionTable:
    present: list[int]  # cached positions, ascending
    mass: dict[int, float]  # position -> layer-0 attention received (all heads)
    inv_key_norm: dict[int, float]  # position -> 1 / mean key norm over the heads holding it


def position_tables(snapshots: list[torch.Tensor]) -> list[PositionTable]:
    """One table per snapshot; a snapshot without a valid slot gets an empty one."""
    if not snapshots:
        return []
    width_s = max(s.shape[-1] for s in snapshots)
    stacked = torch.stack([torch.nn.functional.pad(s, (0, width_s - s.shape[-1])) for s in snapshots])
    positions, scores, valid, norms = stacked.unbind(1)  # each [R, H, S]
    valid = valid.bool()
    rows = len(snapshots)
    if not bool(valid.any()):
        return [PositionTable([], {}, {}) for _ in snapshots]
    width = int(positions[valid].max()) + 1
    # One flat index per (request, position): rows never share an entry.
    key = (torch.arange(rows).view(-1, 1, 1) * width + positions.long())[valid]
    mass = torch.zeros(rows * width, dtype=torch.float64).index_add_(0, key, scores[valid])
    norm = torch.zeros(rows * width, dtype=torch.float64).index_add_(0, key, norms[valid])
    count = torch.zeros(rows * width, dtype=torch.float64).index_add_(0, key, torch.ones_like(key, dtype=torch.float64))
    here = (count > 0).nonzero().flatten()
    inv = torch.where(norm > 0, count / norm, 0.0)[here]
    sizes = torch.bincount(here // width, minlength=rows).tolist()
    at_l, mass_l, inv_l = (here % width).tolist(), mass[here].tolist(), inv.tolist()
    out, at = [], 0
    for n in sizes:
        present = at_l[at:at + n]
        out.append(PositionTable(present, dict(zip(present, mass_l[at:at + n])),
                                 dict(zip(present, inv_l[at:at + n]))))
        at += n
    return out
