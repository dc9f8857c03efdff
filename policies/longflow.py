"""`longflow` (LongFlow): per layer, one token per step. Slot score is
sum over the layer's query heads of ||p_{h,s} v_s||_1 from the current query;
when the layer holds more than its budget the argmin slot is evicted from
every head (the new token never). A prompt longer than the budget is first
cut to the budget with snapkv's selection, layer-wide."""

from __future__ import annotations

import torch
from pydantic import Field

from .base import Policy, PolicyParams
from .observations import Need, newest_mask
from .registry import register_policy
from .snapkv import SnapKVParams, snapkv_keep


class LongFlowParams(PolicyParams):
    protect_recent: int = Field(default=0, ge=0)


@register_policy
class LongFlowPolicy(Policy):
    name = "longflow"
    Params = LongFlowParams
    needs = Need.PV_NORM | Need.ATTENTION
    compress_prompt = True
    description = "Static cache: each step the new token overwrites the lowest |p*v| slot of the layer."
    graph_safe = True
    crosses_heads = True  # its decode pass reduces over every rank's heads

    def select_prefill(self, batch, view, obs):
        # Cut the prompt to exactly the budget (window included), layer-wide:
        # prompt slots line up across heads, so scoring with the attention
        # summed over heads keeps the same tokens in the same slots of every
        # head, which the per-layer decode eviction relies on.
        budget = batch.budget.amin(dim=1)  # [R]
        snap = SnapKVParams()
        window = budget.clamp(max=snap.window)
        summed = batch.heads.sum(obs.attention.sum(dim=1, keepdim=True)).expand_as(obs.attention)
        kernel = torch.full_like(budget, snap.kernel)
        top_k = (budget - window).unsqueeze(1).expand_as(batch.budget)
        keep = snapkv_keep(view, summed, window, kernel, snap.kernel, top_k)
        return view.valid & ~keep

    @classmethod
    def check_budget(cls, params, budget, budget_ratio):
        if budget is not None and params.protect_recent >= budget:
            return "params.protect_recent", (f"must be below the budget ({budget}): no slot would be left to "
                                             "evict")
        return None

    def select_decode(self, batch, view, obs):
        # Slots line up across heads (evictions are always layer-wide), so a
        # slot is one token of the layer; its score sums over all heads.
        held = view.valid[:, 0].sum(dim=-1)  # [R]
        over = held > batch.budget.amin(dim=1)
        # The newest token is always protected; never all held tokens (at
        # least one candidate whenever the layer is over its budget).
        protect = torch.minimum(batch.param("protect_recent").clamp(min=1), batch.budget.amin(dim=1)).view(-1, 1)
        protected = newest_mask(view.valid[:, 0], view.position[:, 0], protect.view(-1),
                                max(1, batch.max_param("protect_recent")))  # [R, S]
        score = batch.heads.sum(obs.pv_norm.sum(dim=1))  # [R, S], over every rank's heads
        candidates = view.valid[:, 0] & ~protected
        victim = torch.where(candidates, score, torch.full_like(score, float("inf"))).argmin(dim=-1)  # [R]
        slots = torch.arange(score.shape[-1], device=score.device)
        evict = (slots == victim.unsqueeze(-1)) & over.unsqueeze(-1)  # [R, S]
        return evict.unsqueeze(1) & view.valid
