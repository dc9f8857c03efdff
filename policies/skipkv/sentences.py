"""skipkv's sentence-level decisions: the redundant set from sentence vectors
(the mean of the last layer's hidden states over a sentence's tokens; the
vectors are kept by policies.skipkv.book), and the redundant sentences as
position spans for the per-layer eviction."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


def redundant_sentences(vectors: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sentence i is redundant when some later sentence j has cos(v_i, v_j) > tau.
    vectors [K, D] in sentence order. Returns (redundant [K] bool, penalty [K]
    float32: the largest similarity to a later sentence for a redundant one,
    0 otherwise)."""
    K = vectors.shape[0]
    if K == 0:
        return torch.zeros(0, dtype=torch.bool, device=vectors.device), vectors.new_zeros(0, dtype=torch.float32)
    unit = vectors.float()
    unit = unit / unit.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    sim = unit @ unit.T
    later = torch.ones(K, K, dtype=torch.bool, device=vectors.device).triu(diagonal=1)
    best = sim.masked_fill(~later, float("-inf")).amax(dim=1)  # the last sentence has no later one: -inf
    redundant = best > tau
    return redundant, torch.where(redundant, best, torch.zeros_like(best))


@dataclass(frozen=True)
class RedundantSpans:
    """The request's redundant sentences as position spans (host tensors),
    sorted by start: first and last position of each, its penalty, and its
    eviction rank (0 first: highest penalty, ties oldest first)."""

    starts: torch.Tensor  # [Kr] int64
    ends: torch.Tensor  # [Kr] int64
    penalty: torch.Tensor  # [Kr] float32
    rank: torch.Tensor  # [Kr] int64

    @cached_property
    def lists(self) -> tuple[list, list, list, list]:
        """The four as Python lists (made once; step_inputs pads them every step)."""
        return self.starts.tolist(), self.ends.tolist(), self.penalty.tolist(), self.rank.tolist()

    @staticmethod
    def empty() -> "RedundantSpans":
        """The one empty instance (immutable, its lists made once): every
        row without sentences shares it, so a step builds nothing per row."""
        return _EMPTY

    @staticmethod
    def of(starts: torch.Tensor, ends: torch.Tensor, redundant: torch.Tensor, penalty: torch.Tensor) -> "RedundantSpans":
        starts, ends, penalty = starts[redundant], ends[redundant], penalty[redundant].float()
        # Most similar first; stable sort keeps the older of equal penalties first.
        order = torch.sort(-penalty, stable=True).indices
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel())
        return RedundantSpans(starts.long(), ends.long(), penalty, rank)


_EMPTY = RedundantSpans(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), torch.zeros(0),
                        torch.zeros(0, dtype=torch.int64))
