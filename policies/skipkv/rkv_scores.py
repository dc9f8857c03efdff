"""R-KV's token scores as batched tensor functions ([R, H, S] slots, any order):
`scoring: "fast"`, the default. `scoring: "paper"` (policies.skipkv.rkv_paper)
recomputes the importance from the last queries and builds the S x S
redundancy with the paper's correction, the two approximations below undone.

score = lambda_mix * importance - (1 - lambda_mix) * redundancy, where
  importance = attention of the recent queries, averaged over the kv head's
               query group and max-pooled over `kernel` neighbours by position;
  redundancy = softmax over the head's slots of each key's mean cosine
               similarity to the other keys (R-KV's code softmaxes it too, so
               both terms sum to about 1 over the slots and lambda_mix mixes
               quantities of one scale).
The newest `window` tokens of a head are always kept (R-KV keeps its query
window); the rest of the budget goes to the highest scores.

Decision (the window of queries): R-KV recomputes the attention of its last
`window` queries when it compresses. The engine shows a policy only the
current query's attention, and a per-slot ring of `window` past values would
cost window x the region's slot count in memory. So each slot keeps a running
mean in SlotView.score with its observation count in SlotView.last_hit
(saturating at `window`): the plain mean of every query that saw the token
while it has been seen fewer than `window` times, then an exponential mean of
weight 1/window, whose mean age is that of a `window`-query window.

Decision (redundancy): the mean over the other keys is computed from the sum
of the head's unit keys, O(S·D) instead of R-KV's S x S matrix. R-KV's code
also drops, per key, its similarity to the newest key above a 0.5 threshold
(one term of S); that correction needs the S x S matrix and is left out.
"""

from __future__ import annotations

import torch

from ..observations import SlotView, keep_top_k, rank_by_position
from ..snapkv import pool_by_position

#: Added to key norms before dividing (a zero key has similarity 0 to all).
_EPS = 1e-8


def observe_attention(view: SlotView, attention: torch.Tensor, window: torch.Tensor) -> None:
    """Fold one query's attention [R, H, S] into each valid slot's running
    mean (view.score), counting observations in view.last_hit up to
    `window` ([R]). A freshly stored slot (score 0, count 0) takes the
    attention as is."""
    count = (view.last_hit.long() + 1).clamp(max=window.view(-1, 1, 1))
    mean = view.score + (attention.float() - view.score) / count
    view.score.copy_(torch.where(view.valid, mean, view.score))
    view.last_hit.copy_(torch.where(view.valid, count, view.last_hit.long()).to(view.last_hit.dtype))


def start_window_mean(view: SlotView, attention_sum: torch.Tensor, queries: torch.Tensor) -> None:
    """At prefill end: each slot's mean attention over the `queries` ([R])
    prompt queries observed, as the running mean, counted as seen that often."""
    q = queries.clamp(min=1).view(-1, 1, 1)
    view.score.copy_(torch.where(view.valid, attention_sum.float() / q, view.score))
    view.last_hit.copy_(torch.where(view.valid, q.expand_as(view.last_hit), view.last_hit.long())
                        .to(view.last_hit.dtype))


def key_redundancy(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[R, H, S]: softmax over each head's valid slots of the key's mean cosine
    similarity to the head's other valid keys (the mean divides by the slots
    held, as R-KV divides by the sequence length). Invalid slots get 0.

    Two batched products, no [S, S] matrix: total = sum of the head's unit
    keys, then each key's dot with it. 16-bit keys on a GPU stay 16-bit
    (tensor cores, fp32 accumulation and outputs; the unit weights and the
    total enter the products rounded to 16 bits, ~0.4% relative): a float32
    copy of every key would triple the memory traffic."""
    R, H, S, D = keys.shape
    k = keys.reshape(R * H, S, D)
    mask = valid.reshape(R * H, S)
    if _sixteen_bit_on_gpu(k):
        norm = torch.linalg.vector_norm(k, dim=-1, dtype=torch.float32)
        weight = mask / (norm + _EPS)  # 1/|k| for valid keys, 0 otherwise
        total = torch.bmm(weight.to(k.dtype).unsqueeze(1), k, out_dtype=torch.float32)  # [RH, 1, D]
        dots = torch.bmm(k, total.to(k.dtype).transpose(1, 2), out_dtype=torch.float32).squeeze(-1)
    else:
        kf = k.float()
        norm = kf.norm(dim=-1)
        weight = mask / (norm + _EPS)
        total = torch.bmm(weight.unsqueeze(1), kf)
        dots = torch.bmm(kf, total.transpose(1, 2)).squeeze(-1)
    self_sim = (norm * weight) ** 2  # a unit key's cosine with itself (0 for a zero key)
    to_others = dots * weight - self_sim  # sum of cosines to the other keys
    held = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    mean = (to_others / held).masked_fill(~mask, float("-inf"))
    out = torch.nan_to_num(torch.softmax(mean, dim=-1), nan=0.0)  # a head with no valid slot: 0, not NaN
    return out.view(R, H, S)


def _sixteen_bit_on_gpu(k: torch.Tensor) -> bool:
    return k.is_cuda and k.dtype in (torch.bfloat16, torch.float16)


def rkv_scores(view: SlotView, importance: torch.Tensor, lambda_mix: torch.Tensor, kernel: torch.Tensor,
               max_kernel: int) -> torch.Tensor:
    """R-KV's score of every slot [R, H, S] from its running-mean importance
    (view.score, pooled here) and its key's redundancy (view.keys)."""
    pooled = pool_by_position(importance, view, kernel, max_kernel)
    lam = lambda_mix.view(-1, 1, 1)
    return lam * pooled - (1 - lam) * key_redundancy(view.keys, view.valid)


def protected_recent(view: SlotView, budget: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The newest min(window, budget) valid slots of each head (always kept;
    they include the current token) and that count [R, H]."""
    recent_n = torch.minimum(window.view(-1, 1), budget)
    return view.valid & (rank_by_position(view, newest_first=True) < recent_n.unsqueeze(-1)), recent_n


def keep_recent_and_top(view: SlotView, score: torch.Tensor, budget: torch.Tensor, window: torch.Tensor,
                        candidates: torch.Tensor | None = None) -> torch.Tensor:
    """[R, H, S] kept: the protected recent slots plus the budget's rest by
    highest score among `candidates` (default: every other valid slot)."""
    protected, recent_n = protected_recent(view, budget, window)
    pool = view.valid if candidates is None else candidates
    return protected | keep_top_k(score, pool & ~protected, budget - recent_n)
