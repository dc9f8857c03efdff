"""`streaming` (StreamingLLM): the first `sinks` private tokens and the most recent rest."""

from __future__ import annotations

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

    def _evict(self, view, budget):
        sinks = min(self.params.sinks, int(budget.min()))
        oldest_rank = rank_by_position(view, newest_first=False)
        newest_rank = rank_by_position(view, newest_first=True)
        keep = (oldest_rank < sinks) | (newest_rank < (budget - sinks).unsqueeze(1))
        return view.valid & ~keep

    def on_prefill_end(self, layer, view, obs, budget):
        return self._evict(view, budget)

    def on_decode_step(self, step, layer, view, obs, budget):
        return self._evict(view, budget)
