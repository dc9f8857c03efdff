"""`longflow` (LongFlow): per layer, one token per step. Slot score is
sum over the layer's query heads of ||p_{h,s} v_s||_1 from the current query;
when the layer holds more than its budget the argmin slot is evicted from
every head (the new token never). A prompt longer than the budget is first
cut to the budget with snapkv's selection, layer-wide (LongFlow §4.1), by
the attention of the prompt's last `window` queries max-pooled over
`kernel` positions: SnapKV's defaults, per request."""

from __future__ import annotations

import os

import torch
from pydantic import Field, field_validator

from .base import Policy, PolicyParams
from .observations import Need, newest_mask
from .registry import register_policy
from .snapkv import odd_kernel, snapkv_keep


class LongFlowParams(PolicyParams):
    protect_recent: int = Field(default=0, ge=0, le=1 << 22,
                                description="newest tokens never evicted while decoding (0: only the current one)")
    window: int = Field(default=32, ge=1, le=4096,
                        description="prefill: the prompt's last queries whose attention scores its tokens, and "
                                    "the newest prompt tokens always kept (SnapKV's window)")
    kernel: int = Field(default=7, ge=1, le=63, description="prefill: max-pooling width of those scores, by position")

    _odd_kernel = field_validator("kernel")(odd_kernel)


@register_policy
class LongFlowPolicy(Policy):
    name = "longflow"
    Params = LongFlowParams
    needs = Need.PV_NORM | Need.ATTENTION
    compress_prompt = True
    description = "Static cache: each step the new token overwrites the lowest |p*v| slot of the layer."
    graph_safe = True
    decides_layers_apart = True  # nothing per layer but its slots and observations
    crosses_heads = True  # its decode pass reduces over every rank's heads

    def select_prefill(self, batch, view, obs):
        # Cut the prompt to exactly the budget (window included), layer-wide:
        # prompt slots line up across heads, so scoring with the attention
        # summed over heads keeps the same tokens in the same slots of every
        # head, which the per-layer decode eviction relies on.
        budget = batch.budget.amin(dim=1)  # [R]
        window = torch.minimum(budget, batch.param("window"))
        summed = batch.heads.sum(obs.attention.sum(dim=1, keepdim=True)).expand_as(obs.attention)
        top_k = (budget - window).unsqueeze(1).expand_as(batch.budget)
        keep = snapkv_keep(view, summed, window, batch.param("kernel"), batch.max_param("kernel"), top_k)
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
        victim = fused_victim(batch, view, obs, protect.view(-1))
        if victim is None:
            protected = newest_mask(view.valid[:, 0], view.position[:, 0], protect.view(-1),
                                    max(1, batch.max_param("protect_recent")))  # [R, S]
            score = batch.heads.sum(obs.pv_norm.sum(dim=1))  # [R, S], over every rank's heads
            candidates = view.valid[:, 0] & ~protected
            victim = torch.where(candidates, score, torch.full_like(score, float("inf"))).argmin(dim=-1)  # [R]
        slots = torch.arange(view.valid.shape[-1], device=view.valid.device)
        evict = (slots == victim.unsqueeze(-1)) & over.unsqueeze(-1)  # [R, S]
        return evict.unsqueeze(1) & view.valid


#: The most slots a group's victim comes from the fused select kernel
#: (fused_victim; PyTorch's ops past it). radix_ext/kernel_warmup compiles
#: the kernel's every tile up to it at start.
FUSED_MAX_SLOTS = 8192


def fused_victim(batch, view, obs, protect):
    """The decode victim per row [R] from one Triton kernel
    (kernels/longflow_fused.py `longflow_select`: pv_norm summed over heads,
    the newest token out of the candidates, min and argmin; ties to the
    lowest slot, as argmin) instead of the PyTorch ops above, or None where
    it does not serve: several ranks (the score is all-reduced first),
    protect_recent above 1 (more than the newest protected), pv_norm neither
    on a GPU nor in Triton's interpreter, KVSIEVE_LONGFLOW_FUSED=0. Over
    the budget some slot is always a candidate, so its -1 (none) never
    meets a row that evicts."""
    if batch.heads.size != 1 or batch.max_param("protect_recent") > 1:
        return None
    pv = obs.pv_norm
    if not (pv.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") or pv.shape[-1] > FUSED_MAX_SLOTS:
        return None
    try:
        from kvsieve.kernels import longflow_fused
    except ImportError:  # no Triton
        return None
    if not longflow_fused.enabled():
        return None
    return longflow_fused.longflow_select(pv, view.valid[:, 0], view.position[:, 0], protect)[0]
