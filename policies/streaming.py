"""`streaming` (StreamingLLM): the first `sinks` private tokens and the most recent rest.

Cadence (`buffer`, as rkv's: policies/cadence.py): a request evicts every
`buffer` decode steps, each head then dropping its oldest tokens after the
sinks down to the budget; in between it holds up to budget + buffer tokens.
StreamingLLM rolls its window every step (buffer 1); the default 16 keeps
the same window a step in 16 and spares the 15 others the whole decision
(the slot view, two reductions and the eviction writes per layer: 11.8 of
35.7 ms a step at 600 rows on an H200, docs/gpu-kernels.md). Budget 1024
plus 16 is still 65 pages of 16 a head: admission's ceiling does not move."""

from __future__ import annotations

import torch
from pydantic import Field

from .base import Policy, PolicyParams
from .cadence import ceiling_with_buffer, decides_at, due_heads
from .observations import rank_by_position
from .registry import register_policy
from .spec import MIN_RATIO_BUDGET


class StreamingParams(PolicyParams):
    sinks: int = Field(default=4, ge=0)
    buffer: int = Field(default=16, ge=1, le=4096,
                        description="decode steps between evictions: a head drops its oldest tokens down to its "
                                    "budget every `buffer` steps, holding up to budget + buffer tokens (1: every "
                                    "step, as StreamingLLM)")


@register_policy
class StreamingPolicy(Policy):
    name = "streaming"
    Params = StreamingParams
    description = "Attention sinks plus a sliding window of recent tokens."
    graph_safe = True
    decides_layers_apart = True  # nothing per layer but its slots and observations
    pads_decisions = True  # a padded row is not due (due_heads): it evicts nothing

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

    def deciding_rows(self, rows):
        return [decides_at(row.step, row.state.params.buffer) for row in rows]

    def max_private_tokens(self, params, private_prompt, max_new_tokens, budget):
        return ceiling_with_buffer(private_prompt, max_new_tokens, budget, params.buffer)

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
        due = due_heads(view, budget, batch.step, batch.param("buffer"))
        return view.valid & ~keep & due.unsqueeze(-1)
