"""What a policy sees: one request's private KV of one layer, and the
observations the attention pass produced for it.

Shapes: H = kv heads of the layer, S = slots of the request's pages in that
layer (pages x page_size, the same for every head), Hq = query heads.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch


class Need(enum.Flag):
    """Observations a policy asks the attention pass to produce."""

    NONE = 0
    ATTENTION = enum.auto()  # probability mass per slot, summed over the kv head's query group
    PV_NORM = enum.auto()  # ||p * v||_1 per slot, summed over the query group (LongFlow)
    SPARSITY = enum.auto()  # per query head: share of probabilities < 1% of the row max
    HIDDEN_STATES = enum.auto()  # last layer's hidden state of the new token
    TOKEN_IDS = enum.auto()


@dataclass
class LayerView:
    """A request's slots in one layer. `score` and `last_hit` are per-slot
    policy state kept by the region between steps; a policy may update them
    in place. Free slots have valid False and position -1."""

    valid: torch.Tensor  # [H, S] bool
    position: torch.Tensor  # [H, S] int64, token position (-1: free)
    score: torch.Tensor  # [H, S] float32
    last_hit: torch.Tensor  # [H, S] int32

    @property
    def held(self) -> torch.Tensor:
        """Retained tokens per head, [H]."""
        return self.valid.sum(dim=1)


@dataclass
class LayerObservations:
    """Produced in the same pass as attention, only where a policy asked."""

    attention: Optional[torch.Tensor] = None  # [H, S] float32
    pv_norm: Optional[torch.Tensor] = None  # [H, S] float32
    sparsity: Optional[torch.Tensor] = None  # [Hq] float32


def rank_by_position(view: LayerView, newest_first: bool) -> torch.Tensor:
    """Rank of each valid slot among its head's valid slots by position (0 =
    oldest, or newest with newest_first); invalid slots rank last. [H, S]."""
    big = torch.iinfo(torch.int64).max // 4
    key = view.position.clone()
    if newest_first:
        key = -key
    key = torch.where(view.valid, key, torch.full_like(key, big))
    order = key.argsort(dim=1, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    return ranks


def keep_top_k(values: torch.Tensor, eligible: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per row, the k[row] eligible entries of highest value (ties: lower slot). [H, S] bool."""
    masked = torch.where(eligible, values.float(), torch.full_like(values, float("-inf"), dtype=torch.float32))
    order = masked.argsort(dim=1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    return eligible & (ranks < k.unsqueeze(1))
