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


def snapkv_keep(view, obs, window: int, kernel: int, top_k: torch.Tensor) -> torch.Tensor:
    """SnapKV's selection, [H, S] bool: the newest `window` slots of each head
    plus its `top_k` others of highest pooled attention. obs.attention is the
    mass each slot received from the prompt's last queries."""
    recent = view.valid & (rank_by_position(view, newest_first=True) < window)
    pooled = pool_by_position(obs.attention, view, kernel)
    return recent | keep_top_k(pooled, view.valid & ~recent, top_k)


@register_policy
class SnapKVPolicy(Policy):
    name = "snapkv"
    Params = SnapKVParams
    needs = Need.ATTENTION
    description = "Prefill-time selection by the attention of the prompt's last queries."

    def on_prefill_end(self, layer, view, obs, budget):
        return view.valid & ~snapkv_keep(view, obs, self.params.window, self.params.kernel, budget)

    def max_private_tokens(self, private_prompt, max_new_tokens, budget):
        # The selection keeps window + budget prompt tokens; decode only adds.
        kept = min(private_prompt, budget + self.params.window)
        return max(private_prompt, kept + max_new_tokens)
