"""`rkv` (R-KV, the baseline of ThinKV, SkipKV and LongFlow): decode-time
eviction per (layer, kv_head) by lambda_mix * importance - (1 - lambda_mix) *
redundancy (policies.skipkv.rkv_scores), keeping the newest `window` tokens.

Trigger (decision, exposed as `buffer`): a request decides every `buffer`
decode steps (steps buffer-1, 2*buffer-1, ...), and then each head over its
budget evicts down to it; in between the heads grow by up to `buffer`
tokens, the slack its admission ceiling reserves. R-KV's code compresses
every 128 generated tokens (buffer 128). Default 16: the decision (key
redundancy, position pooling, top-k) costs the same whatever it evicts, so
deciding once per 16 steps makes it 16x cheaper per step for 16 slots of
slack per head (1.6% at budget 1024); buffer 1 decides every step. Between
decisions a row only folds the step's attention into its running mean
(observe_decode), and the engine runs the decision for the due rows only
(deciding_rows).
"""

from __future__ import annotations

import torch
from pydantic import Field, field_validator

from ..base import Policy, PolicyParams
from ..observations import Need
from ..registry import register_policy
from ..snapkv import odd_kernel
from .rkv_scores import (decides_at, due_heads, keep_recent_and_top, observe_attention, rkv_scores,
                         start_window_mean)


class RKVParams(PolicyParams):
    window: int = Field(default=8, ge=1, le=4096, description="recent tokens always kept; queries averaged")
    kernel: int = Field(default=7, ge=1, le=63, description="max-pooling width of the importance, by position")
    lambda_mix: float = Field(default=0.07, ge=0.0, le=1.0, description="weight of importance against redundancy")
    buffer: int = Field(default=16, ge=1, le=4096,
                        description="decode steps between decisions: a head evicts down to its budget every "
                                    "`buffer` steps, holding up to budget + buffer tokens")

    _odd_kernel = field_validator("kernel")(odd_kernel)


class RKVBase(Policy):
    """R-KV scoring shared with skipkv: the running window of attention in
    SlotView.score / last_hit, keys for the redundancy."""

    Params = RKVParams
    needs = Need.ATTENTION | Need.KEYS
    keeps_slot_state = True
    pads_decisions = True  # select_decode = observe_decode + an eviction masked by due_heads

    def _group_size(self) -> int:
        """Query heads per kv head: attention arrives summed over the group;
        R-KV averages it, which keeps it on the redundancy's scale."""
        if self.model is None or not self.model.num_kv_heads:
            return 1
        return max(1, self.model.num_q_heads // self.model.num_kv_heads)

    def _scores(self, batch, view) -> torch.Tensor:
        return rkv_scores(view, view.score, batch.param("lambda_mix"), batch.param("kernel"),
                          batch.max_param("kernel"))

    def observe_decode(self, batch, view, obs) -> None:
        observe_attention(view, obs.attention / self._group_size(), batch.param("window"))

    def deciding_rows(self, rows):
        return [decides_at(row.step, row.state.params.buffer) for row in rows]

    def _start_prefill(self, batch, view, obs) -> None:
        # The prompt's last min(window, prompt length) queries were observed.
        newest = torch.where(view.valid, view.position, torch.full_like(view.position, -1)).amax(dim=(1, 2))
        queries = torch.minimum(batch.param("window"), newest + 1)
        start_window_mean(view, obs.attention / self._group_size(), queries)

    def max_private_tokens(self, params, private_prompt, max_new_tokens, budget):
        # A decode step stores its token before evicting, and a head decides
        # every `buffer` steps: it reaches budget + buffer tokens before it
        # cuts back to the budget.
        return min(private_prompt + max_new_tokens, max(private_prompt, budget + params.buffer))


@register_policy
class RKVPolicy(RKVBase):
    name = "rkv"
    graph_safe = True  # tests_gpu/test_region_pass_cuda.py: replay equals the eager pass, no host sync
    description = "R-KV: attention of the recent queries minus key redundancy; keeps the recent window."

    def select_prefill(self, batch, view, obs):
        self._start_prefill(batch, view, obs)
        keep = keep_recent_and_top(view, self._scores(batch, view), batch.budget, batch.param("window"))
        return view.valid & ~keep

    def select_decode(self, batch, view, obs):
        self.observe_decode(batch, view, obs)
        keep = keep_recent_and_top(view, self._scores(batch, view), batch.budget, batch.param("window"))
        due = due_heads(view, batch.budget, batch.step, batch.param("buffer"))
        return view.valid & ~keep & due.unsqueeze(-1)
