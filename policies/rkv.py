"""`rkv` (R-KV, the baseline of ThinKV, SkipKV and LongFlow): decode-time
eviction per (layer, kv_head) by lambda_mix * importance - (1 - lambda_mix) *
redundancy (policies.rkv_scores), keeping the newest `window` tokens.

Trigger (decision, exposed as `buffer`): a head evicts down to its budget in
a step where it holds budget + buffer tokens. buffer 1 (default) keeps every
head within its budget after every step; R-KV's code compresses every 128
generated tokens (buffer 128), letting the cache overflow by that much.
"""

from __future__ import annotations

import torch
from pydantic import Field, field_validator

from .base import Policy, PolicyParams
from .observations import Need
from .registry import register_policy
from .snapkv import odd_kernel
from .rkv_scores import due_heads, keep_recent_and_top, observe_attention, rkv_scores, start_window_mean


class RKVParams(PolicyParams):
    window: int = Field(default=8, ge=1, le=4096, description="recent tokens always kept; queries averaged")
    kernel: int = Field(default=7, ge=1, le=63, description="max-pooling width of the importance, by position")
    lambda_mix: float = Field(default=0.07, ge=0.0, le=1.0, description="weight of importance against redundancy")
    buffer: int = Field(default=1, ge=1, le=4096, description="a head evicts when it holds budget + buffer tokens")

    _odd_kernel = field_validator("kernel")(odd_kernel)


class RKVBase(Policy):
    """R-KV scoring shared with skipkv: the running window of attention in
    SlotView.score / last_hit, keys for the redundancy."""

    Params = RKVParams
    needs = Need.ATTENTION | Need.KEYS
    keeps_slot_state = True

    def _group_size(self) -> int:
        """Query heads per kv head: attention arrives summed over the group;
        R-KV averages it, which keeps it on the redundancy's scale."""
        if self.model is None or not self.model.num_kv_heads:
            return 1
        return max(1, self.model.num_q_heads // self.model.num_kv_heads)

    def _scores(self, batch, view) -> torch.Tensor:
        return rkv_scores(view, view.score, batch.param("lambda_mix"), batch.param("kernel"),
                          batch.max_param("kernel"))

    def _start_prefill(self, batch, view, obs) -> None:
        # The prompt's last min(window, prompt length) queries were observed.
        newest = torch.where(view.valid, view.position, torch.full_like(view.position, -1)).amax(dim=(1, 2))
        queries = torch.minimum(batch.param("window"), newest + 1)
        start_window_mean(view, obs.attention / self._group_size(), queries)

    def max_private_tokens(self, params, private_prompt, max_new_tokens, budget):
        # A decode step stores its token before evicting: a head reaches
        # budget + buffer tokens before it cuts back to the budget.
        return min(private_prompt + max_new_tokens, max(private_prompt, budget + params.buffer))


@register_policy
class RKVPolicy(RKVBase):
    name = "rkv"
    graph_safe = True  # bench/results/graph-probe-rkv-skipkv.json: replay equals the eager pass
    description = "R-KV: attention of the recent queries minus key redundancy; keeps the recent window."

    def select_prefill(self, batch, view, obs):
        self._start_prefill(batch, view, obs)
        keep = keep_recent_and_top(view, self._scores(batch, view), batch.budget, batch.param("window"))
        return view.valid & ~keep

    def select_decode(self, batch, view, obs):
        observe_attention(view, obs.attention / self._group_size(), batch.param("window"))
        keep = keep_recent_and_top(view, self._scores(batch, view), batch.budget, batch.param("window"))
        due = due_heads(view, batch.budget, batch.param("buffer"))
        return view.valid & ~keep & due.unsqueeze(-1)
