"""`h2o` (Heavy-Hitter Oracle): accumulated attention mass per slot; keep the
top half of the budget by mass plus the most recent half."""

from __future__ import annotations

from .base import Policy, PolicyParams
from .observations import Need, keep_top_k, rank_by_position
from .registry import register_policy


@register_policy
class H2OPolicy(Policy):
    name = "h2o"
    Params = PolicyParams
    needs = Need.ATTENTION
    keeps_slot_state = True
    description = "Heavy hitters by accumulated attention plus recent tokens."

    def _evict(self, view, budget):
        recent_n = budget // 2
        recent = view.valid & (rank_by_position(view, newest_first=True) < recent_n.unsqueeze(1))
        heavy = keep_top_k(view.score, view.valid & ~recent, budget - recent_n)
        return view.valid & ~(recent | heavy)

    def on_prefill_end(self, layer, view, obs, budget):
        view.score.add_(obs.attention)
        return self._evict(view, budget)

    def on_decode_step(self, step, layer, view, obs, budget):
        # Free slots carry no mass; a reused slot starts from zero (the region
        # resets score when it stores a token).
        view.score.add_(obs.attention * view.valid)
        return self._evict(view, budget)
