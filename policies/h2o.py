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
    graph_safe = True
    decides_layers_apart = True  # nothing per layer but its slots and observations

    @classmethod
    def observation_window(cls, params, private_prompt):
        # H2O accumulates the attention of every prompt query, not a window.
        return max(private_prompt, 1)

    def _evict(self, batch, view):
        recent_n = (batch.budget // 2).clamp(min=1)  # [R, H]; at least the newest token
        recent = view.valid & (rank_by_position(view, newest_first=True) < recent_n.unsqueeze(-1))
        heavy = keep_top_k(view.score, view.valid & ~recent, batch.budget - recent_n)
        return view.valid & ~(recent | heavy)

    def select_prefill(self, batch, view, obs):
        view.score.add_(obs.attention * view.valid)
        return self._evict(batch, view)

    def select_decode(self, batch, view, obs):
        # Free slots carry no mass; a reused slot starts from zero (the region
        # resets score when it stores a token).
        view.score.add_(obs.attention * view.valid)
        return self._evict(batch, view)
