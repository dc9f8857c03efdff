"""`streaming` (StreamingLLM): the first `sinks` private tokens and the most recent rest."""

from __future__ import annotations

import torch
from pydantic import Field

from .base import Policy, PolicyParams
from .observations import rank_by_position
from .registry import register_policy
from .spec import MIN_RATIO_BUDGET


class StreamingParams(PolicyParams):
    sinks: int = Field(default=4, ge=0)


@register_policy
class StreamingPolicy(Policy):
    name = "streaming"
    Params = StreamingParams
    description = "Attention sinks plus a sliding window of recent tokens."
    graph_safe = True
    decides_layers_apart = True  # nothing per layer but its slots and observations

    @classmethod
    def check_budget(cls, params, budget, budget_ratio):
        if budget is not None and budget <= params.sinks:
            return "budget", f"must exceed params.sinks ({params.sinks}): the window of recent tokens would be empty"
        if budget_ratio is not None and params.sinks >= MIN_RATIO_BUDGET:
            return "params.sinks", (f"must be below {MIN_RATIO_BUDGET}, the floor of a budget_ratio budget, "
                                    "or the window of recent tokens could be empty")
        return None

    def _evict(self, batch, view):
        budget = batch.budget.unsqueeze(-1)  # [R, H, 1]
        # At least one recent slot: the newest token is never the one evicted.
        sinks = torch.minimum(batch.param("sinks").view(-1, 1, 1), (budget - 1).clamp(min=0))
        keep = (rank_by_position(view, newest_first=False) < sinks) | \
               (rank_by_position(view, newest_first=True) < budget - sinks)
        return view.valid & ~keep

    def select_prefill(self, batch, view, obs):
        return self._evict(batch, view)

    def select_decode(self, batch, view, obs):
        # Between steps a streaming row holds its first `sinks` private
        # tokens and an unbroken window of the newest (it only ever evicts
        # the oldest token after the sinks), so a slot's rank by position is
        # its distance from the oldest or newest held position: two
        # reductions instead of two sorts over every slot per layer.
        budget = batch.budget  # [R, H]
        sinks = torch.minimum(batch.param("sinks").view(-1, 1), (budget - 1).clamp(min=0))
        far = torch.iinfo(torch.int64).max // 4
        oldest = torch.where(view.valid, view.position, torch.full_like(view.position, far)).amin(dim=-1)
        newest = torch.where(view.valid, view.position, torch.full_like(view.position, -1)).amax(dim=-1)
        keep = (view.position < (oldest + sinks).unsqueeze(-1)) | \
               (view.position > (newest - (budget - sinks)).unsqueeze(-1))
        return view.valid & ~keep
