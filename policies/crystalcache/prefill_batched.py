"""CrystalCache S1-S6 (prefill.py) for every request whose prompt ends in a
step at once, as tensor work on the device: no host read, no loop over
requests, trunks or edges. Rows are padded to the longest prompt N; trunk
and edge tables are padded to N and 12N. prefill.py is the specification;
tests/test_crystalcache_prefill_batched.py checks that both keep the same
positions.

How the sequential parts become batched:
  * S2's left-to-right merge: a group starting at sentence start g takes
    the following sentences while the interface is strong (> the row's
    tau_merge) and the group stays within the row's T_max tokens, so its
    end f(g) depends on g alone (max T_max steps of gathers for every g at
    once: a row's group takes at most its T_max - 1 sentences, the later
    steps change nothing there); the groups are the orbit of 0
    under f, found by pointer doubling (log2 N steps).
  * S6's bottom-up retention: trunks sorted by (score, index); the cut left
    before trunk k is cut - (sizes before k), so which trunks go whole and
    which one is partly kept follow from one cumulative sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .prefill import (
    ALPHA, EPS, INTERFACE, K_CROSS, K_INTRA, M_MAX, M_MIN, N_MIN, STEEPNESS, T_MAX, TAU_CROSS, TAU_EDGE,
    TAU_INTRA, TAU_MERGE,
)

F64 = torch.float64


@dataclass
class PrefillRows:
    """S1-S6 of E requests, local positions 0..N-1 (padding: trunk -1)."""

    keep: torch.Tensor  # [E, N] bool: kept positions
    trunk: torch.Tensor  # [E, N] int64 trunk of each position
    impact: torch.Tensor  # [E, N] M_i
    trunk_m: torch.Tensor  # [E, N] M̄ per trunk index
    crystal: torch.Tensor  # [E, N] D per trunk index, after S6
    trunks: torch.Tensor  # [E] trunk count
    graph: torch.Tensor  # [E, 12N, 3] trunk edges (a, b, W); W 0: none


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(1) - x


def prefill_rows(saliency, intra_index, intra_weight, cross_index, cross_weight, ids, length, delimiters,
                 budget, sinks, recent, t_max=None, tau_merge=None, alpha=None, max_t_max=None) -> PrefillRows:
    """saliency [E, N]; intra_* [E, N, K_INTRA]; cross_* [E, N, K_CROSS];
    ids [E, N] int64; length, budget, sinks, recent [E] int64; delimiters
    [K] int64 token ids; the rows' knobs t_max [E] int64, tau_merge and
    alpha [E] float64 (None: Table 2's T_MAX, TAU_MERGE, ALPHA for every
    row) and max_t_max, the host's largest t_max (bounds the merge loop).
    Every tensor on one device."""
    E, N = ids.shape
    dev = ids.device
    if t_max is None:
        t_max, max_t_max = torch.full((E,), T_MAX, dtype=torch.int64, device=dev), T_MAX
    elif max_t_max is None:
        max_t_max = int(t_max.max()) if E else T_MAX  # a read: callers on the device pass the host's maximum
    tau_merge = torch.full((E,), TAU_MERGE, dtype=F64, device=dev) if tau_merge is None else tau_merge.to(F64)
    alpha = torch.full((E,), ALPHA, dtype=F64, device=dev) if alpha is None else alpha.to(F64)
    t_max = t_max.long()
    pos = torch.arange(N, device=dev).expand(E, N)
    real = pos < length.unsqueeze(1)
    big = torch.iinfo(torch.int64).max

    # ----- S3: M_i from clipped saliency and in-prompt rarity ---------------
    padded_ids = torch.where(real, ids, big)
    ordered = padded_ids.sort(dim=1).values
    counts = torch.searchsorted(ordered, padded_ids, right=True) - torch.searchsorted(ordered, padded_ids)
    rarity = 1.0 / (1.0 + torch.log1p(counts.to(F64)))
    s = saliency.to(F64).clamp(M_MIN, M_MAX)
    impact = (M_MAX * (0.5 * s / M_MAX + 0.5 * rarity)).clamp(M_MIN, M_MAX)

    # ----- S1: the edge set, one weight per unordered pair (the largest) ----
    other = torch.cat([intra_index, cross_index], dim=2).long()  # [E, N, 12]
    weight = torch.cat([intra_weight, cross_weight], dim=2).to(F64)
    tau = torch.where(torch.arange(K_INTRA + K_CROSS, device=dev) < K_INTRA, TAU_INTRA, TAU_CROSS).to(F64)
    ok = (other >= 0) & (weight > tau) & real.unsqueeze(2)
    me = pos.unsqueeze(2).expand_as(other)
    lo, hi = torch.minimum(me, other).flatten(1), torch.maximum(me, other).flatten(1)
    weight, ok = weight.flatten(1), ok.flatten(1)
    key = torch.where(ok, lo * N + hi, big)
    by_weight = (-weight).argsort(dim=1, stable=True)
    order = by_weight.gather(1, key.gather(1, by_weight).argsort(dim=1, stable=True))
    key, lo, hi, weight = (t.gather(1, order) for t in (key, lo, hi, weight))
    first = torch.ones_like(ok)
    first[:, 1:] = key[:, 1:] != key[:, :-1]
    edge = first & (key != big)  # each pair once, with its largest weight

    # ----- S2 step 1: sentences -----------------------------------------------
    delim = torch.isin(ids, delimiters) & real
    next_delim = torch.where(delim, pos, big).flip(1).cummin(1).values.flip(1)
    sent_end = torch.where(next_delim != big, next_delim + 1, length.unsqueeze(1))
    sent_end = torch.where(real, sent_end, pos)
    start = real.clone()
    start[:, 1:] &= delim[:, :-1]

    # ----- S2 step 2: interface strength at every sentence start -------------
    # band[a, d - 1]: the edge (a, a + d) for d = 1 .. 2 * INTERFACE - 1.
    span = 2 * INTERFACE - 1
    near = edge & (hi - lo <= span)
    slot = torch.where(near, lo * span + (hi - lo - 1), N * span)
    band = torch.zeros(E, N * span + 1, dtype=F64, device=dev).scatter_(1, slot, torch.where(near, weight, 0.0))
    has = torch.zeros(E, N * span + 1, dtype=torch.bool, device=dev).scatter_(1, slot, near)
    band, has = band[:, :-1].view(E, N, span), has[:, :-1].view(E, N, span)
    right = (sent_end - pos).clamp(max=INTERFACE)  # first tokens of the sentence at b
    strength = torch.zeros(E, N + 1, INTERFACE, dtype=F64, device=dev)  # [.., L - 1]: left side b-L .. b-1
    for L in range(1, INTERFACE + 1):
        total = torch.zeros(E, N, dtype=F64, device=dev)
        found = torch.zeros(E, N, dtype=torch.int64, device=dev)
        for back in range(L, 0, -1):  # a = b - back, ascending (the reference's summation order)
            if back >= N:
                continue  # a = b - back lies before every row's start: no edge (prompts of 2-4 tokens)
            w_a = torch.zeros(E, N, span, dtype=F64, device=dev)
            h_a = torch.zeros(E, N, span, dtype=torch.bool, device=dev)
            w_a[:, back:], h_a[:, back:] = band[:, :N - back], has[:, :N - back]
            for ahead in range(INTERFACE):  # c = b + ahead
                hit = h_a[:, :, back + ahead - 1] & (ahead < right)
                total = total + torch.where(hit, w_a[:, :, back + ahead - 1], 0.0)
                found = found + hit.long()
        strength[:, :N, L - 1] = torch.where(found > 0, total / found.clamp(min=1).to(F64), 0.0)

    # ----- S2 step 2: the merge pass ------------------------------------------
    end_of = torch.cat([sent_end, length.unsqueeze(1)], dim=1)  # position N: past the end
    group = torch.arange(N + 1, device=dev).expand(E, N + 1)
    cur = end_of.clone()  # a group starting at g ends after g's sentence ...
    active = torch.ones(E, N + 1, dtype=torch.bool, device=dev)
    limit = length.unsqueeze(1)
    row_t_max, row_tau = t_max.unsqueeze(1), tau_merge.unsqueeze(1)
    for _ in range(max_t_max):  # ... and takes up to T_max - 1 more sentences
        b = cur.clamp(max=N)
        left = (b - group).clamp(1, INTERFACE)
        s_b = strength.gather(1, b.unsqueeze(2).expand(E, N + 1, INTERFACE)).gather(2, (left - 1).unsqueeze(2))[..., 0]
        e = end_of.gather(1, b)
        merge = active & (cur < limit) & (s_b > row_tau) & (e - group <= row_t_max)
        cur = torch.where(merge, e, cur)
        active = merge
    jump = torch.where(group < limit, cur, group)  # f(g); the end maps to itself
    reach = torch.zeros(E, N + 1, dtype=torch.long, device=dev)
    reach[:, 0] = 1
    for _ in range(max(1, (N + 1).bit_length())):
        reach = (reach + torch.zeros_like(reach).scatter_add_(1, jump, reach)).clamp(max=1)
        jump = jump.gather(1, jump)
    group_start = (reach[:, :N] > 0) & real

    # ----- S2 step 3: groups over T_max split into near-equal trunks ----------
    gs = torch.where(group_start, pos, -1).cummax(1).values
    ge = torch.where(group_start, pos, big)
    ge = torch.cat([ge[:, 1:], torch.full((E, 1), big, device=dev)], dim=1).flip(1).cummin(1).values.flip(1)
    ge = torch.minimum(ge, length.unsqueeze(1))
    size_g = (ge - gs).clamp(min=1)
    pieces = (size_g + row_t_max - 1) // row_t_max
    offset = pos - gs
    trunk_start = offset == 0
    guess = (offset * pieces) // size_g
    for shift in (-1, 0, 1):
        i = guess + shift
        bound = torch.round((i * size_g).to(F64) / pieces.to(F64)).long()  # Python's round: half to even
        trunk_start |= (i >= 1) & (i < pieces) & (offset == bound)
    trunk_start &= real
    trunk = torch.where(real, trunk_start.long().cumsum(1) - 1, -1)
    count = trunk_start.sum(1)
    tix = torch.where(real, trunk, N)  # padding goes to a spare trunk slot N
    size = torch.zeros(E, N + 1, dtype=torch.int64, device=dev).scatter_add_(1, tix, real.long())[:, :N]
    trunk_ok = torch.arange(N, device=dev).expand(E, N) < count.unsqueeze(1)

    # ----- Eq. 23: M̄ = mean of the trunk's top-3 M_i ------------------------
    by_impact = (-impact).argsort(dim=1, stable=True)
    order = by_impact.gather(1, tix.gather(1, by_impact).argsort(dim=1, stable=True))
    block = torch.cat([_exclusive_cumsum(size), torch.zeros(E, 1, dtype=torch.int64, device=dev)], dim=1)
    rank_sorted = torch.arange(N, device=dev).expand(E, N) - block.gather(1, tix.gather(1, order))
    rank = torch.empty_like(rank_sorted).scatter_(1, order, rank_sorted)
    top = torch.zeros(E, (N + 1) * 3 + 1, dtype=F64, device=dev)
    in_top = real & (rank < 3)
    top.scatter_(1, torch.where(in_top, tix * 3 + rank, (N + 1) * 3), torch.where(in_top, impact, 0.0))
    top = top[:, :N * 3].view(E, N, 3)
    trunk_m = (top[..., 0] + top[..., 1] + top[..., 2]) / size.clamp(1, 3).to(F64)

    # ----- S4: the trunk graph, Eq. 24-25 --------------------------------------
    ta, tb = tix.gather(1, lo.clamp(0, N - 1)), tix.gather(1, hi.clamp(0, N - 1))
    cross = edge & (ta != tb)
    pair = torch.where(cross, ta * N + tb, big)
    order = pair.argsort(dim=1, stable=True)
    pair, ta, tb, weight = (t.gather(1, order) for t in (pair, ta, tb, weight))
    head = torch.ones_like(cross)
    head[:, 1:] = pair[:, 1:] != pair[:, :-1]
    head &= pair != big
    run = (head.long().cumsum(1) - 1).clamp(min=0)
    member = pair != big
    M = pair.shape[1]
    sums = torch.zeros(E, M, dtype=F64, device=dev).scatter_add_(1, run, torch.where(member, weight, 0.0))
    hits = torch.zeros(E, M, dtype=torch.int64, device=dev).scatter_add_(1, run, member.long())
    ends = torch.zeros(E, M, 2, dtype=torch.int64, device=dev)
    ends.scatter_(1, torch.where(head, run, M - 1).unsqueeze(2).expand(E, M, 2),
                  torch.stack([ta, tb], dim=2) * head.unsqueeze(2))
    used = torch.arange(M, device=dev).expand(E, M) < head.sum(1, keepdim=True)
    sa = size.gather(1, ends[..., 0].clamp(max=N - 1)).to(F64)
    sb = size.gather(1, ends[..., 1].clamp(max=N - 1)).to(F64)
    hits_f = hits.clamp(min=1).to(F64)
    w = sums / hits_f * torch.sqrt(hits_f / (sa * sb))
    kept_edge = used & (w > TAU_EDGE)
    w = torch.where(kept_edge, w, 0.0)
    graph = torch.cat([ends.to(F64), w.unsqueeze(2)], dim=2)

    # ----- S4: crystallization D, Eq. 26-27 ------------------------------------
    deg = torch.zeros(E, N + 1, dtype=F64, device=dev)
    deg.scatter_add_(1, torch.where(kept_edge, ends[..., 0], N), w)
    deg.scatter_add_(1, torch.where(kept_edge, ends[..., 1], N), w)
    deg = deg[:, :N]
    m = count.clamp(min=1).to(F64).unsqueeze(1)
    mean = torch.where(trunk_ok, deg, 0.0).sum(1, keepdim=True) / m
    std = torch.sqrt(torch.where(trunk_ok, (deg - mean) ** 2, 0.0).sum(1, keepdim=True) / m)
    std = torch.where(std < EPS, 1.0, std)
    crystal = torch.where(trunk_ok, 1.0 / (1.0 + torch.exp(-STEEPNESS * (deg - mean) / std)), 0.0)

    # ----- S5-S6: branch dissolution down to the budget (Algorithm 1) ----------
    edge_token = real & ((pos < sinks.unsqueeze(1)) | (pos >= (length - recent).unsqueeze(1)))
    protected = torch.zeros(E, N + 1, dtype=torch.int64, device=dev).scatter_add_(1, tix, edge_token.long())[:, :N] > 0
    alive = trunk_ok & ~protected
    prot_size = (size * (trunk_ok & protected)).sum(1)
    cut = ((size * alive).sum(1) - (budget - prot_size)).clamp(min=0)
    logs = torch.log1p(trunk_m)
    low = torch.where(alive, logs, torch.inf).min(1, keepdim=True).values
    high = torch.where(alive, logs, -torch.inf).max(1, keepdim=True).values
    score = torch.maximum(crystal, alpha.unsqueeze(1) * (logs - low) / (high - low + EPS))
    order = torch.where(alive, score, torch.inf).argsort(dim=1, stable=True)  # ties: earlier trunk first
    sorted_size = torch.where(alive, size, 0).gather(1, order)
    left_sorted = cut.unsqueeze(1) - _exclusive_cumsum(sorted_size)
    left = torch.empty_like(left_sorted).scatter_(1, order, left_sorted)  # cut still to make at each trunk
    reached = alive & (left > 0)
    dropped = reached & ((size <= left) | (size - left < N_MIN))
    partial = reached & ~dropped
    ratio = (size - left).to(F64) / size.clamp(min=1).to(F64)
    take = torch.minimum(size, torch.round(ratio * size.to(F64)).long().clamp(min=N_MIN))
    crystal = torch.where(dropped, 0.0, torch.where(partial, ratio * crystal, crystal))
    spare = torch.zeros(E, 1, dtype=torch.bool, device=dev)
    gone = torch.cat([dropped, spare], 1).gather(1, tix)
    cut_here = torch.cat([partial, spare], 1).gather(1, tix)
    room = torch.cat([take, torch.zeros(E, 1, dtype=torch.int64, device=dev)], 1).gather(1, tix)
    keep = real & ~gone & (~cut_here | (rank < room))
    return PrefillRows(keep=keep, trunk=trunk, impact=torch.where(real, impact, 0.0), trunk_m=trunk_m,
                       crystal=crystal, trunks=count, graph=graph)
