"""`snapkv`: prefill-time selection. Prompt tokens are scored by the attention
of the last `window` prompt queries, max-pooled over `kernel` neighbours; the
top `budget` plus the window are kept. Nothing is evicted while decoding."""

from __future__ import annotations

import torch
from pydantic import Field, field_validator

from .base import Policy, PolicyParams
from .observations import Need, keep_top_k, rank_by_position
from .registry import register_policy


def odd_kernel(kernel: int) -> int:
    """A max-pooling width must be odd: a window centred on its token."""
    if kernel % 2 == 0:
        raise ValueError("must be odd (a centred pooling window)")
    return kernel


class SnapKVParams(PolicyParams):
    window: int = Field(default=32, ge=1)
    kernel: int = Field(default=7, ge=1)

    _odd_kernel = field_validator("kernel")(odd_kernel)


def pool_by_position(scores: torch.Tensor, view, kernel: torch.Tensor, max_kernel: int) -> torch.Tensor:
    """Max-pool each (row, head)'s scores over its row's `kernel` ([R])
    neighbours in position order. The loop runs over kernel offsets, bounded
    by `max_kernel` (a parameter bound known on the host), never over rows."""
    order = view.position.masked_fill(~view.valid, torch.iinfo(torch.int64).max).argsort(dim=-1)
    ordered = scores.gather(-1, order).masked_fill(~view.valid.gather(-1, order), 0.0)
    half = (kernel // 2).view(-1, 1, 1)
    pooled = ordered.clone()
    S = ordered.shape[-1]
    for d in range(1, max_kernel // 2 + 1):
        if d >= S:
            break
        pad = ordered.new_zeros((*ordered.shape[:-1], d))
        left = torch.cat([pad, ordered[..., :-d]], dim=-1)  # neighbour d slots older
        right = torch.cat([ordered[..., d:], pad], dim=-1)  # neighbour d slots newer
        within = d <= half
        pooled = torch.where(within, torch.maximum(pooled, torch.maximum(left, right)), pooled)
    out = torch.empty_like(pooled)
    out.scatter_(-1, order, pooled)
    return out


def snapkv_keep(view, attention, window: torch.Tensor, kernel: torch.Tensor, max_kernel: int,
                top_k: torch.Tensor) -> torch.Tensor:
    """SnapKV's selection, [R, H, S] bool: the newest `window` ([R]) slots of
    each head plus its `top_k` ([R, H]) others of highest pooled attention.
    `attention` is the mass each slot received from the prompt's last queries."""
    recent = view.valid & (rank_by_position(view, newest_first=True) < window.view(-1, 1, 1))
    # Pool the scores outside the window only: the window is kept anyway, and
    # its own scores must not spill onto the prompt tokens just before it.
    pooled = pool_by_position(attention.masked_fill(recent, 0.0), view, kernel, max_kernel)
    return recent | keep_top_k(pooled, view.valid & ~recent, top_k)


@register_policy
class SnapKVPolicy(Policy):
    name = "snapkv"
    Params = SnapKVParams
    needs = Need.ATTENTION
    compress_prompt = True
    description = "Prefill-time selection by the attention of the prompt's last queries."
    graph_safe = True
    decides_layers_apart = True  # nothing per layer but its slots and observations

    def select_prefill(self, batch, view, obs):
        keep = snapkv_keep(view, obs.attention, batch.param("window"), batch.param("kernel"),
                           batch.max_param("kernel"), batch.budget)
        return view.valid & ~keep

    def kept_after_prefill(self, params, private_prompt, budget):
        return min(private_prompt, budget + params.window)

    def max_private_tokens(self, params, private_prompt, max_new_tokens, budget):
        # The selection keeps window + budget prompt tokens; decode only adds.
        kept = self.kept_after_prefill(params, private_prompt, budget)
        return max(private_prompt, kept + max_new_tokens)
