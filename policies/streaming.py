"""`streaming` (StreamingLLM): the first `sinks` private tokens and the most recent rest."""

from __future__ import annotations

import torch
from pydantic import Field

from .base import Policy, PolicyParams
from .observations import rank_by_position
from .registry import register_policy


class StreamingParams(PolicyParams):
    sinks: int = Field(default=4, ge=0)


@register_policy
class StreamingPolicy(Policy):
    name = "streaming"
    Params = StreamingParams
    description = "Attention sinks plus a sliding window of recent tokens."
    graph_safe = True

    def _evict(self, batch, view):
        budget = batch.budget.unsqueeze(-1)  # [R, H, 1]
        sinks = torch.minimum(batch.param("sinks").view(-1, 1, 1), budget)
        keep = (rank_by_position(view, newest_first=False) < sinks) | \
               (rank_by_position(view, newest_first=True) < budget - sinks)
        return view.valid & ~keep

    def select_prefill(self, batch, view, obs):
        return self._evict(batch, view)

    def select_decode(self, batch, view, obs):
        return self._evict(batch, view)
