"""ThinKV's eviction on the device: each (row, head) cuts every segment that
holds more than its target down to the target, keeping the real tokens
nearest the centroids of a k-means over the segment's post-RoPE keys
(ThinKV §4.3, appendix D.4). Batched over rows, heads, cut segments and
centroids at once: no loop over any of them, no host sync.

Inputs come from the host (policies.thinkv.segments through step_inputs):
per row the segment targets and the segments it cuts in this step. A slot's
segment follows from its position: decode step (position - gen_start) //
refresh, where gen_start is the position of decode step 0. A segment merged
into an older one (floor="merge") has the target -1 - (that one's index):
its slots count there, so the k-means of a merge runs over both segments'
tokens in position order like any other cut.

Layout: the k-means works segment by segment: the slots of each cut
segment are gathered in position order into [R, H, Kc, N] (Kc cut segments,
N their largest size, at most `refresh`) against [R, H, Kc, T] centroids (T
the largest target), so its distance tensor is [R, H, Kc, N, T], never
[slots x centroids] of the whole head.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..observations import ranks_of

_BIG = 1 << 40  # segment stride in sort keys (positions stay far below it)
_LAST = torch.iinfo(torch.int64).max
#: Medoid ties: members whose distance to their centroid is within this share
#: of (best distance + |centroid|^2) of the cluster's best are tied. A
#: two-member cluster's centroid is their midpoint, equidistant from both in
#: exact arithmetic: float32 rounding alone (relative 1e-7) picked one, so any
#: ulp of noise in the keys (a batched GEMM's order, TP's all-reduce) moved
#: the kept token. 100x that rounding, far below real distance gaps.
_TIE = 1e-5


def segment_index(position: torch.Tensor, gen_start: torch.Tensor, refresh: torch.Tensor,
                  prompt_segments: torch.Tensor) -> torch.Tensor:
    """Index of each slot's segment in its row's target list (prompt chunks
    first). position [R, H, S]; gen_start, refresh, prompt_segments [R]."""
    rel = position - gen_start.view(-1, 1, 1)
    return torch.div(rel, refresh.view(-1, 1, 1), rounding_mode="floor") + prompt_segments.view(-1, 1, 1)


def merged_segments(seg: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each slot's segment once merges are followed, and the targets with
    the merged segments' entries at 0 (no slot maps to them any more).
    seg [R, H, S] in [0, K); targets [R, K], where -1 - j names segment j.
    Without merges both come back unchanged (an identity gather)."""
    R, H, _ = seg.shape
    K = targets.shape[1]
    own = torch.arange(K, device=targets.device).expand(R, K)
    holder = torch.where(targets < 0, -1 - targets, own)
    return holder.unsqueeze(1).expand(R, H, K).gather(-1, seg), targets.clamp(min=0)


def _segment_starts(eligible: torch.Tensor, seg: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eligible slots per segment [R, H, K] and how many eligible slots lie
    in earlier segments (the segment's first index once sorted by segment)."""
    per_seg = torch.zeros((*seg.shape[:-1], K), dtype=torch.int64, device=seg.device)
    per_seg.scatter_add_(-1, seg, eligible.long())
    return per_seg, per_seg.cumsum(-1) - per_seg


def kmeans_medoids(keys: torch.Tensor, member: torch.Tensor, active: torch.Tensor, init: torch.Tensor,
                   iters: torch.Tensor, max_iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means in every (row, head, segment) at once.

    keys [R, H, Kc, N, D] the segments' keys; member [R, H, Kc, N] which are
    real; active [R, H, Kc, T] which centroids exist; init [R, H, Kc, T]
    the member index each centroid starts at. Row r runs iters[r] updates
    (the loop runs max_iters, a host bound, and freezes finished rows, so a
    row's result never depends on the others'). Returns, per centroid, the
    index of the member nearest it at the end (its medoid: a real token,
    kept with its value) [R, H, Kc, T], and whether its cluster is non-empty.

    Cost: per iteration one batched matmul writing [B, N, T] scores, its
    argmin, and the one-hot matmul of the centroid update (deterministic,
    unlike a float scatter_add); the medoids come from [B, N] reductions."""
    R, H, Kc, N, D = keys.shape
    T = active.shape[-1]
    B = R * H * Kc
    k = keys.reshape(B, N, D).float()
    m, a = member.reshape(B, N), active.reshape(B, T)
    c = k.gather(1, init.reshape(B, T, 1).expand(B, T, D))
    row_iters = iters.view(R, 1).expand(R, H * Kc).reshape(B, 1, 1)
    inf = k.new_full((), float("inf"))  # a fill, not a host-to-device copy
    ids = torch.arange(T, device=k.device)

    def assign(c):
        # argmin_t ||k - c_t||^2 = argmin_t ||c_t||^2 - 2 k.c_t (ties: the
        # lower centroid); a missing centroid scores inf and is never chosen.
        cc = torch.where(a, (c * c).sum(-1), inf).unsqueeze(1)  # [B, 1, T]
        return torch.baddbmm(cc, k, c.transpose(1, 2), alpha=-2).argmin(-1)  # [B, N]

    for i in range(max_iters):
        onehot = ((assign(c).unsqueeze(-1) == ids) & m.unsqueeze(-1)).float()  # [B, N, T]
        counts = onehot.sum(1).unsqueeze(-1)  # [B, T, 1]
        sums = torch.bmm(onehot.transpose(1, 2), k)  # [B, T, D]
        # An empty cluster keeps its centroid (and gets no medoid, see below).
        moved = torch.where(counts > 0, sums / counts.clamp(min=1), c)
        c = torch.where(i < row_iters, moved, c)
    # A medoid is the member nearest its own cluster's centroid (ties, up to
    # float rounding (_TIE): the lower index), so no two clusters share one.
    # Members that no centroid could take (their segment keeps none) go to a
    # spill bucket T.
    owner = torch.where(m & a.any(-1, keepdim=True), assign(c), T)  # [B, N]
    own = c.gather(1, owner.clamp(max=T - 1).unsqueeze(-1).expand(B, N, D))
    d = torch.where(owner < T, ((k - own) ** 2).sum(-1), inf)
    best = torch.full((B, T + 1), float("inf"), device=k.device).scatter_reduce(1, owner, d, "amin")
    best = best.gather(1, owner)
    tied = d <= best + _TIE * (best + (own * own).sum(-1))
    index = torch.where((owner < T) & tied, torch.arange(N, device=k.device), N)
    nearest = torch.full((B, T + 1), N, device=k.device).scatter_reduce(1, owner, index, "amin")[:, :T]
    return nearest.clamp(max=N - 1).view(R, H, Kc, T), (nearest < N).view(R, H, Kc, T)


def tbe_evict(valid: torch.Tensor, position: torch.Tensor, keys: Optional[torch.Tensor], seg: torch.Tensor,
              current: torch.Tensor, targets: torch.Tensor, cut_segments: torch.Tensor, cut_members: torch.Tensor,
              cut_centroids: torch.Tensor, iters: torch.Tensor, max_iters: int) -> torch.Tensor:
    """The eviction mask [R, H, S] of one layer.

    valid/position/seg/current [R, H, S] (seg: each slot's segment index,
    current: the row's newest token, never evicted); keys [R, H, S, D] or
    None; targets [R, K] tokens kept per segment, the current token
    included (-1 - j: merged into segment j). From the host, for the Kc
    segments each row cuts now: cut_segments [R, Kc] their index (-1:
    padding), cut_members [R, Kc, N] (index < tokens it holds beside the
    current one) and cut_centroids [R, Kc, T] (index < tokens it keeps
    beside the current one); iters [R] k-means updates (max_iters: their
    maximum, on the host).

    A segment holding more than its target keeps, per (row, head): the
    medoids of a k-means over its keys with one centroid per kept token,
    then (where a cluster ended empty, for a segment the host did not
    list, or with no keys) its newest tokens up to the target. Centroid j
    of a segment whose n tokens become t starts at its token of position
    rank floor((2j+1)n/(2t)): spread evenly in time and deterministic, so
    no random seed is involved."""
    R, H, S = valid.shape
    K = targets.shape[1]
    if K == 0:  # no target this step: nothing to cut
        return torch.zeros_like(valid)
    seg, targets = merged_segments(seg.clamp(0, K - 1), targets)
    candidate = valid & ~current
    # The current token counts against its segment's target.
    cur_seg = torch.where(current, seg, torch.zeros_like(seg)).amax(dim=(1, 2))  # [R]
    has_current = current.flatten(1).any(-1).long()
    seg_target = targets.unsqueeze(1).expand(R, H, K).clone()
    seg_target.scatter_add_(-1, cur_seg.view(R, 1, 1).expand(R, H, 1), -has_current.view(R, 1, 1).expand(R, H, 1))
    count, _ = _segment_starts(candidate, seg, K)
    over = candidate & (count > seg_target).gather(-1, seg)  # slots of segments to cut

    medoid = torch.zeros_like(over)
    Kc, N, T = cut_members.shape[1], cut_members.shape[2], cut_centroids.shape[2]
    if keys is not None and Kc and N and T:
        # Each cut segment's slots in position order: sort by (segment, position).
        order = torch.where(over, seg * _BIG + position, torch.full_like(seg, _LAST)).argsort(-1)
        _, start = _segment_starts(over, seg, K)
        cs = cut_segments.clamp(min=0).view(R, 1, Kc).expand(R, H, Kc)
        listed = (cut_segments >= 0).view(R, 1, Kc) & (count > seg_target).gather(-1, cs)
        n, t = count.gather(-1, cs), seg_target.gather(-1, cs)  # [R, H, Kc]
        idx = torch.arange(N, device=valid.device)
        member = listed.unsqueeze(-1) & cut_members.unsqueeze(1) & (idx < n.unsqueeze(-1))  # [R, H, Kc, N]
        where = (start.gather(-1, cs).unsqueeze(-1) + idx).clamp(max=S - 1)
        slot = order.gather(-1, where.flatten(2)).view(R, H, Kc, N)
        seg_keys = keys.gather(2, slot.flatten(2).unsqueeze(-1).expand(R, H, Kc * N, keys.shape[-1]))
        j = torch.arange(T, device=valid.device)
        active = listed.unsqueeze(-1) & cut_centroids.unsqueeze(1) & (j < t.unsqueeze(-1))  # [R, H, Kc, T]
        init = ((2 * j + 1) * n.unsqueeze(-1)) // (2 * t.clamp(min=1).unsqueeze(-1))
        nearest, nonempty = kmeans_medoids(seg_keys.view(R, H, Kc, N, -1), member, active,
                                           init.clamp(max=N - 1), iters, max_iters)
        kept_slot = slot.gather(-1, nearest)  # [R, H, Kc, T]
        hits = torch.zeros((R, H, S), dtype=torch.int64, device=valid.device)
        hits.scatter_add_(-1, kept_slot.flatten(2), (nonempty & active).long().flatten(2))
        medoid = (hits > 0) & over

    # Fill: where clusters ended empty (or no k-means ran), the newest tokens.
    per_seg, _ = _segment_starts(medoid, seg, K)
    deficit = (seg_target - per_seg).gather(-1, seg)
    rest = over & ~medoid
    _, rest_start = _segment_starts(rest, seg, K)
    key = torch.where(rest, seg * _BIG - position, torch.full_like(seg, _LAST))
    newest_rank = ranks_of(key, descending=False) - rest_start.gather(-1, seg)
    fill = rest & (newest_rank < deficit)
    return over & ~(medoid | fill)
