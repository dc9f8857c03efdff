"""`longflow` (LongFlow): per layer, one token per step. Slot score is
sum over the layer's query heads of ||p_{h,s} v_s||_1 from the current query;
when the layer holds more than its budget the argmin slot is evicted from
every head (the new token never). A prompt longer than the budget is first
cut to the budget with snapkv's selection."""

from __future__ import annotations

import torch
from pydantic import Field

from .base import Policy, PolicyParams
from .observations import LayerObservations, Need, rank_by_position
from .registry import register_policy
from .snapkv import SnapKVParams, snapkv_keep


class LongFlowParams(PolicyParams):
    protect_recent: int = Field(default=0, ge=0)


@register_policy
class LongFlowPolicy(Policy):
    name = "longflow"
    Params = LongFlowParams
    needs = Need.PV_NORM | Need.ATTENTION
    description = "Static cache: each step the new token overwrites the lowest |p*v| slot of the layer."

    def on_prefill_end(self, layer, view, obs, budget):
        # Cut the prompt to exactly the budget (window included), layer-wide:
        # prompt slots line up across heads, so scoring with the attention
        # summed over heads keeps the same tokens in the same slots of every
        # head, which the per-layer decode eviction relies on.
        b = int(budget.min())
        snap = SnapKVParams()
        window = min(snap.window, b)
        layer_obs = LayerObservations(attention=obs.attention.sum(dim=0, keepdim=True).expand_as(obs.attention))
        keep = snapkv_keep(view, layer_obs, window, snap.kernel, torch.full_like(budget, b - window))
        return view.valid & ~keep

    def on_decode_step(self, step, layer, view, obs, budget):
        # Slots line up across heads (evictions are always layer-wide), so a
        # slot is one token of the layer; its score sums over all heads.
        held = int(view.valid[0].sum())
        evict = torch.zeros_like(view.valid)
        if held <= int(budget.min()):
            return evict
        protected = rank_by_position(view, newest_first=True) < max(1, self.params.protect_recent)
        score = obs.pv_norm.sum(dim=0)
        candidates = view.valid[0] & ~protected[0]
        victim = torch.where(candidates, score, torch.full_like(score, float("inf"))).argmin()
        evict[:, victim] = True
        return evict & view.valid
