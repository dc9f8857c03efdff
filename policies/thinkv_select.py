"""ThinKV's eviction on the device: each (row, head) cuts every segment that
holds more than its target down to the target, keeping the real tokens
nearest the centroids of a k-means over the segment's post-RoPE keys
(ThinKV §4.3, appendix D.4). Batched over rows, heads, segments and
centroids at once: no loop over any of them, no host sync.

Inputs come from the host (policies.thinkv_segments through step_inputs):
per row the segment targets, and a table of centroids naming the segment
each one clusters (the host knows which segments anneal in this step). A
slot's segment follows from its position: decode step (position -
gen_start) // refresh, where gen_start is the position of decode step 0.
"""

from __future__ import annotations

from typing import Optional

import torch

from .observations import ranks_of

_BIG = 1 << 40  # segment stride in sort keys (positions stay far below it)


def segment_index(position: torch.Tensor, gen_start: torch.Tensor, refresh: torch.Tensor,
                  prompt_segments: torch.Tensor) -> torch.Tensor:
    """Index of each slot's segment in its row's target list (prompt chunks
    first). position [R, H, S]; gen_start, refresh, prompt_segments [R]."""
    rel = position - gen_start.view(-1, 1, 1)
    return torch.div(rel, refresh.view(-1, 1, 1), rounding_mode="floor") + prompt_segments.view(-1, 1, 1)


def _rank_in_segment(eligible: torch.Tensor, seg: torch.Tensor, order_key: torch.Tensor, K: int) -> torch.Tensor:
    """Rank of each eligible slot among the eligible slots of its segment,
    by ascending order_key (ties: lower slot). [R, H, S]."""
    key = torch.where(eligible, seg * _BIG + order_key, torch.full_like(seg, torch.iinfo(torch.int64).max))
    rank = ranks_of(key, descending=False)
    per_seg = torch.zeros((*seg.shape[:-1], K), dtype=torch.int64, device=seg.device)
    per_seg.scatter_add_(-1, seg, eligible.long())
    start = per_seg.cumsum(-1) - per_seg  # eligible slots in earlier segments
    return rank - start.gather(-1, seg)


def kmeans_medoids(keys: torch.Tensor, member: torch.Tensor, init_slot: torch.Tensor, iters: torch.Tensor,
                   max_iters: int) -> torch.Tensor:
    """Lloyd's k-means, batched: slot s of (row, head) may join centroid c
    where member[r, h, s, c]; centroids start at the keys of init_slot
    [R, H, C]; row r runs iters[r] updates (the loop runs max_iters, a host
    bound, and freezes finished rows, so a row's result never depends on
    the others'). Returns [R, H, S] bool: for each non-empty cluster, the
    member slot nearest its final centroid (a real token, kept with its
    value)."""
    k = keys.float()  # [R, H, S, D]
    centroids = k.gather(2, init_slot.unsqueeze(-1).expand(*init_slot.shape, k.shape[-1]))  # [R, H, C, D]
    sq = (k * k).sum(-1, keepdim=True)  # [R, H, S, 1]
    inf = torch.tensor(float("inf"), device=k.device)

    def distances(c):
        d = sq - 2 * torch.einsum("rhsd,rhcd->rhsc", k, c) + (c * c).sum(-1).unsqueeze(2)
        return torch.where(member, d, inf)

    clusters = torch.arange(member.shape[-1], device=k.device)
    for i in range(max_iters + 1):
        assign = distances(centroids).argmin(-1, keepdim=True)  # [R, H, S, 1]; ties: lower centroid
        onehot = member & (clusters == assign)
        if i == max_iters:
            break
        counts = onehot.sum(2)  # [R, H, C]
        sums = torch.einsum("rhsc,rhsd->rhcd", onehot.float(), k)
        # An empty cluster keeps its centroid (it has no medoid, see below).
        moved = torch.where(counts.unsqueeze(-1) > 0, sums / counts.clamp(min=1).unsqueeze(-1), centroids)
        centroids = torch.where((i < iters).view(-1, 1, 1, 1), moved, centroids)
    # A medoid is the nearest member of its own cluster under the final
    # centroids, so no two clusters share one.
    counts = onehot.sum(2)
    dist = torch.where(onehot, distances(centroids), inf)
    nearest = dist.argmin(2)  # [R, H, C]
    medoid = torch.zeros(member.shape[:-1], dtype=torch.int64, device=k.device)
    medoid.scatter_add_(-1, nearest, (counts > 0).long())
    return medoid > 0


def tbe_evict(valid: torch.Tensor, position: torch.Tensor, keys: Optional[torch.Tensor], seg: torch.Tensor,
              current: torch.Tensor, targets: torch.Tensor, centroid_segment: torch.Tensor,
              centroid_rank: torch.Tensor, iters: torch.Tensor, max_iters: int) -> torch.Tensor:
    """The eviction mask [R, H, S] of one layer.

    valid/position/seg/current [R, H, S] (seg: each slot's segment index,
    current: the row's newest token, never evicted); keys [R, H, S, D] or
    None; targets [R, K] tokens kept per segment, the current token
    included; centroid_segment [R, C] the segment each centroid clusters
    (-1: unused) and centroid_rank [R, C] its index within that segment;
    iters [R] k-means updates per row (max_iters: their maximum, on the host).

    A segment holding more than its target keeps, per (row, head): the
    medoids of a k-means over its keys with one centroid per kept token,
    then (only when a cluster ended empty, or with no keys) its newest
    tokens up to the target. Init: centroid j of a segment whose n tokens
    must become t starts at its token of position rank floor((2j+1)n/(2t))
    (spread evenly in time; deterministic, so no seed is needed)."""
    R, H, S = valid.shape
    K = targets.shape[1]
    if K == 0:  # no target this step: nothing to cut
        return torch.zeros_like(valid)
    seg = seg.clamp(0, K - 1)
    candidate = valid & ~current
    # The current token counts against its segment's target.
    cur_seg = torch.where(current, seg, torch.zeros_like(seg)).amax(dim=(1, 2))  # [R]
    has_current = current.any(-1).any(-1)
    seg_target = targets.unsqueeze(1).expand(R, H, K).clone()
    seg_target.scatter_add_(-1, cur_seg.view(R, 1, 1).expand(R, H, 1), -has_current.long().view(R, 1, 1).expand(R, H, 1))
    count = torch.zeros((R, H, K), dtype=torch.int64, device=valid.device)
    count.scatter_add_(-1, seg, candidate.long())
    over = candidate & (count > seg_target).gather(-1, seg)  # slots of segments to cut

    medoid = torch.zeros_like(over)
    C = centroid_segment.shape[1]
    if C and keys is not None:
        cseg = centroid_segment.view(R, 1, 1, C)
        member = over.unsqueeze(-1) & (seg.unsqueeze(-1) == cseg)  # [R, H, S, C]
        rank = _rank_in_segment(over, seg, position, K)
        safe = centroid_segment.clamp(min=0).view(R, 1, C).expand(R, H, C)
        n, t = count.gather(-1, safe), seg_target.gather(-1, safe).clamp(min=1)
        init_rank = ((2 * centroid_rank.view(R, 1, C) + 1) * n) // (2 * t)  # [R, H, C]
        at_init = member & (rank.unsqueeze(-1) == init_rank.unsqueeze(2))
        init_slot = at_init.int().argmax(2)  # [R, H, C] (0 for an unused centroid: it has no members)
        medoid = kmeans_medoids(keys, member, init_slot, iters, max_iters) & over

    # Fill: where clusters ended empty (or no k-means ran), the newest tokens.
    per_seg = torch.zeros_like(count)
    per_seg.scatter_add_(-1, seg, medoid.long())
    deficit = (seg_target - per_seg).gather(-1, seg)
    rest = over & ~medoid
    newest_rank = _rank_in_segment(rest, seg, -position, K)
    fill = rest & (newest_rank < deficit)
    return over & ~(medoid | fill)
