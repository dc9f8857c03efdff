"""`snapkv`: prefill-time selection. Prompt tokens are scored by the attention
of the last `window` prompt queries, max-pooled over `kernel` neighbours; the
top `budget` plus the window are kept. Nothing is evicted while decoding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator

from .base import Policy, PolicyParams
from .observations import Need, keep_top_k, rank_by_position
from .registry import register_policy


class SnapKVParams(PolicyParams):
    window: int = Field(default=32, ge=1)
    kernel: int = Field(default=7, ge=1)

    @field_validator("kernel")
    @classmethod
    def _odd_kernel(cls, kernel: int) -> int:
        if kernel % 2 == 0:
            raise ValueError("must be odd (a centred pooling window)")
        return kernel


def pool_by_position(scores: torch.Tensor, view, kernel: int) -> torch.Tensor:
    """Max-pool each head's scores over `kernel` neighbours in position order."""
    order = view.position.masked_fill(~view.valid, torch.iinfo(torch.int64).max).argsort(dim=1)
    ordered = scores.gather(1, order).masked_fill(~view.valid.gather(1, order), 0.0)
    pooled = F.max_pool1d(ordered.unsqueeze(1), kernel, stride=1, padding=kernel // 2).squeeze(1)
    out = torch.empty_like(pooled)
    out.scatter_(1, order, pooled)
    return out


@register_policy
class SnapKVPolicy(Policy):
    name = "snapkv"
    Params = SnapKVParams
    needs = Need.ATTENTION
    description = "Prefill-time selection by the attention of the prompt's last queries."

    def on_prefill_end(self, layer, view, obs, budget):
        # obs.attention: mass each slot received from the last `window` prompt queries.
        window = view.valid & (rank_by_position(view, newest_first=True) < self.params.window)
        pooled = pool_by_position(obs.attention, view, self.params.kernel)
        keep = window | keep_top_k(pooled, view.valid & ~window, budget)
        return view.valid & ~keep
