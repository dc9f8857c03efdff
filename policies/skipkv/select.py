"""skipkv's eviction of one layer, batched over rows and heads.

The redundant sentences of each row arrive as position spans ([R, K] sorted by
start, padded), so a slot finds its sentence with one searchsorted over its
position: no per-token table. A head that is due to evict (it holds budget +
buffer tokens) drops excess = held - budget tokens:
  1. whole redundant sentences first, in rank order (most similar to a later
     sentence first), as long as tokens are still to go: a sentence is dropped
     whole, so the head may end below its budget. A sentence with a token in
     the protected recent window is not dropped whole.
  2. then, while the head is still over budget, its lowest-scoring tokens, by
     the R-KV score minus the sentence penalty lambda_ij.
"""

from __future__ import annotations

import torch

from ..observations import SlotView, keep_top_k
from .rkv_scores import protected_recent

#: Padding of span tables: beyond every position.
FAR = 1 << 62


def sentence_of_slots(position: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """[R, H, S] index of the span (in starts/ends [R, K], sorted, padded
    with FAR) holding each slot's position, -1 for none."""
    R, K = starts.shape
    flat = position.reshape(R, -1).contiguous()
    idx = torch.searchsorted(ends.contiguous(), flat)  # first span ending at or after the position
    clamped = idx.clamp(max=max(K - 1, 0))
    inside = (idx < K) & (starts.gather(1, clamped) <= flat) & (flat >= 0)
    return torch.where(inside, clamped, torch.full_like(clamped, -1)).view_as(position)


def skipkv_evict(view: SlotView, score: torch.Tensor, budget: torch.Tensor, window: torch.Tensor,
                 due: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, penalty: torch.Tensor,
                 rank: torch.Tensor) -> torch.Tensor:
    """Eviction mask [R, H, S]. score: the R-KV score [R, H, S]; budget
    [R, H]; window [R]; due [R, H]; spans starts/ends/penalty/rank [R, K]
    (rank: a permutation of 0..K-1 per row, pads after the real spans)."""
    protected, recent_n = protected_recent(view, budget, window)
    R, H, S = view.valid.shape
    K = starts.shape[1]
    whole = torch.zeros_like(view.valid)
    if K:  # host-known shape: some row has a redundant sentence
        sent = sentence_of_slots(view.position, starts, ends)
        member = (sent >= 0) & view.valid
        idx = sent.clamp(min=0)
        held_in = torch.zeros((R, H, K), dtype=torch.int64, device=idx.device).scatter_add_(-1, idx, member.long())
        guarded = torch.zeros_like(held_in).scatter_add_(-1, idx, (member & protected).long())
        candidate = held_in * ((held_in > 0) & (guarded == 0))  # tokens a whole drop frees
        order = rank.unsqueeze(1).expand(R, H, K)
        by_rank = torch.zeros_like(candidate).scatter_(-1, order, candidate)
        before = by_rank.cumsum(-1) - by_rank  # tokens freed by higher-ranked drops
        excess = (view.held - budget).unsqueeze(-1)
        drop = ((before < excess) & (by_rank > 0)).gather(-1, order)  # per span, in span order
        whole = member & drop.gather(-1, idx) & due.unsqueeze(-1)
        score = score - torch.where(member, penalty.unsqueeze(1).expand(R, H, K).gather(-1, idx),
                                    torch.zeros_like(score))
    remaining = view.valid & ~whole
    keep = protected | keep_top_k(score, remaining & ~protected, budget - recent_n)
    return whole | (remaining & ~keep & due.unsqueeze(-1))
