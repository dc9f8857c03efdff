"""CrystalCache prefill S1-S6 (crystalcache.txt §3.2-3.7, policies.md) for one
request, as pure host-side functions: they run once at the end of prefill,
never inside the forward. Input: the first layer's attention probabilities of
every prompt query over the prompt ([H, n, n], causal) and the token ids.
Output: the positions kept (one index set for every layer and head).

Our decisions where the paper is loose:
  * E is undirected: one weight per unordered pair (an intra pair found from
    both ends carries the same cosine; intra and cross pairs never coincide).
  * S_i sums, per head, the attention token i receives from the queries of
    its own chunk (columns restricted to the chunk), then the top-3 heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Table 2 / policies.md constants. T_MAX, TAU_MERGE and ALPHA are the defaults
# of the per-request knobs t_max, tau_merge, alpha (CrystalCacheParams).
CHUNK = 1024
TOP_HEADS = 3
M_MIN, M_MAX = 0.1, 20.0
K_INTRA, TAU_INTRA = 8, 0.3
K_CROSS, TAU_CROSS = 4, 0.02
TAU_MERGE, T_MAX, INTERFACE = 0.3, 32, 5
TAU_EDGE = 0.05
STEEPNESS = 5.0
ALPHA = 1.0
N_SINK, W_RECENT, N_MIN = 4, 128, 3
EPS = 1e-8

Edges = dict[tuple[int, int], float]


def _add_edge(edges: Edges, a: int, b: int, w: float) -> None:
    key = (min(a, b), max(a, b))
    edges[key] = max(w, edges.get(key, w))


def saliency_and_edges(attn: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, Edges]:
    """S1: per-token saliency S [n] (clipped) and the edge set E."""
    attn = attn.double()
    heads, n, _ = attn.shape
    saliency = torch.zeros(n, dtype=torch.float64)
    edges: Edges = {}
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        block = attn[:, start:end, start:end]  # [H, Q, K] within the chunk
        per_head = block.sum(dim=1)  # [H, K]: mass each key receives
        top = per_head.topk(min(TOP_HEADS, heads), dim=0).values.sum(dim=0)
        saliency[start:end] = top.clamp(M_MIN, M_MAX)
        # Intra: cosine of head-mean attention rows (roles of tokens).
        rows = block.mean(dim=0)
        rows = rows / (rows.norm(dim=1, keepdim=True) + EPS)
        cos = rows @ rows.T
        cos.fill_diagonal_(-math.inf)
        k = min(K_INTRA, end - start - 1)
        if k > 0:
            vals, idx = cos.topk(k, dim=1)
            for q, (vs, js) in enumerate(zip(vals.tolist(), idx.tolist())):
                for w, j in zip(vs, js):
                    if w > TAU_INTRA:
                        _add_edge(edges, start + q, start + j, w)
        # Cross: head-mean attention from this chunk's queries to earlier keys.
        if start > 0:
            cross = attn[:, start:end, :start].mean(dim=0)
            vals, idx = cross.topk(min(K_CROSS, start), dim=1)
            for q, (vs, js) in enumerate(zip(vals.tolist(), idx.tolist())):
                for w, i in zip(vs, js):
                    if w > TAU_CROSS:
                        _add_edge(edges, i, start + q, w)
    return saliency, edges


def sentences(token_ids: list[int], delimiters: frozenset[int]) -> list[list[int]]:
    """S2 step 1: positions split after each delimiter token (kept in its sentence)."""
    out, cur = [], []
    for pos, tok in enumerate(token_ids):
        cur.append(pos)
        if tok in delimiters:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def interface_strength(edges: Edges, left: list[int], right: list[int]) -> float:
    """CAS: mean weight of the recorded edges between last5(left) x first5(right)."""
    ws = [edges[(a, b)] for a in left[-INTERFACE:] for b in right[:INTERFACE] if (a, b) in edges]
    return sum(ws) / len(ws) if ws else 0.0


def build_trunks(sents: list[list[int]], edges: Edges, t_max: int = T_MAX,
                 tau_merge: float = TAU_MERGE) -> list[list[int]]:
    """S2 steps 2-3: one left-to-right merge pass (CAS > tau_merge), then
    split trunks over t_max."""
    merged: list[list[int]] = []
    for s in sents:
        if merged and interface_strength(edges, merged[-1], s) > tau_merge and len(merged[-1]) + len(s) <= t_max:
            merged[-1] = merged[-1] + s
        else:
            merged.append(list(s))
    trunks = []
    for g in merged:
        pieces = math.ceil(len(g) / t_max)
        bounds = [round(i * len(g) / pieces) for i in range(pieces + 1)]
        trunks.extend(g[bounds[i]:bounds[i + 1]] for i in range(pieces))
    return trunks


def encoding_impact(saliency: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """S3: M_i = clip(M_MAX * (S_i / M_MAX / 2 + U_i / 2)), U_i = 1/(1+log(1+c_i))."""
    ids = torch.tensor(token_ids)
    _, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    rarity = 1.0 / (1.0 + torch.log1p(counts[inverse].double()))
    return (M_MAX * (0.5 * saliency.double() / M_MAX + 0.5 * rarity)).clamp(M_MIN, M_MAX)


def trunk_impact(impact: torch.Tensor, trunk: list[int]) -> float:
    """Eq. 23: mean of the trunk's top-3 M_i."""
    vals = impact[trunk]
    return float(vals.topk(min(3, len(trunk))).values.mean())


def trunk_graph(trunks: list[list[int]], edges: Edges) -> dict[tuple[int, int], float]:
    """S4 Eq. 24-25: W(a, b) = mean * sqrt(|W_ab| / (|a||b|)), pruned <= TAU_EDGE."""
    owner = {p: t for t, g in enumerate(trunks) for p in g}
    groups: dict[tuple[int, int], list[float]] = {}
    for (i, j), w in edges.items():
        a, b = owner[i], owner[j]
        if a != b:
            groups.setdefault((min(a, b), max(a, b)), []).append(w)
    graph = {}
    for (a, b), ws in groups.items():
        weight = sum(ws) / len(ws) * math.sqrt(len(ws) / (len(trunks[a]) * len(trunks[b])))
        if weight > TAU_EDGE:
            graph[(a, b)] = weight
    return graph


def crystallization(num_trunks: int, graph: dict[tuple[int, int], float]) -> list[float]:
    """S4 Eq. 26-27: D = logistic(5 * z(weighted degree)); sigma < eps -> 1."""
    deg = [0.0] * num_trunks
    for (a, b), w in graph.items():
        deg[a] += w
        deg[b] += w
    mean = sum(deg) / num_trunks
    std = math.sqrt(sum((d - mean) ** 2 for d in deg) / num_trunks)
    if std < EPS:
        std = 1.0
    return [1.0 / (1.0 + math.exp(-STEEPNESS * (d - mean) / std)) for d in deg]


def prefill_budget(n: int, budget_ratio: float) -> int:
    """Eq. 30: B = max(N_SINK + W_RECENT, ceil(beta * n))."""
    return max(N_SINK + W_RECENT, math.ceil(budget_ratio * n))


@dataclass
class Dissolution:
    kept: list[int]  # sorted positions retained
    ratio: list[float]  # r_g per trunk (1 for protected)
    crystal: list[float]  # D after Eq. 34
    protected: list[bool] = field(default_factory=list)


def branch_dissolve(trunks: list[list[int]], impact: torch.Tensor | dict[int, float], trunk_m: list[float],
                    crystal: list[float], budget: int, n: int, n_sink: int = N_SINK, w_recent: int = W_RECENT,
                    alpha: float = ALPHA) -> Dissolution:
    """S5 + S6 (Algorithm 1): score = max(D, alpha * minmax(log(1 + M̄))) over the
    unprotected trunks; bottom-up proportional retention with the N_MIN rule,
    then M_i-ranked tokens in the partially kept trunk. `impact`: M_i by
    position (the prefill's tensor, or the decode phase's table)."""
    protected = [any(p < n_sink or p >= n - w_recent for p in g) for g in trunks]
    alive = [t for t, prot in enumerate(trunks) if not protected[t]]
    prot_size = sum(len(g) for g, p in zip(trunks, protected) if p)
    cut = max(0, sum(len(trunks[t]) for t in alive) - (budget - prot_size))
    ratio = [1.0] * len(trunks)
    crystal = list(crystal)
    if cut > 0 and alive:  # nothing alive: protected trunks are all kept
        logs = {t: math.log1p(trunk_m[t]) for t in alive}
        lo, hi = min(logs.values()), max(logs.values())
        score = {t: max(crystal[t], alpha * (logs[t] - lo) / (hi - lo + EPS)) for t in alive}
        for t in sorted(alive, key=lambda t: (score[t], t)):  # ties: earlier trunk first
            if cut <= 0:
                break
            size = len(trunks[t])
            if size <= cut or size - cut < N_MIN:
                ratio[t], cut = 0.0, cut - size
            else:
                ratio[t], cut = (size - cut) / size, 0
    kept: list[int] = []
    for t, g in enumerate(trunks):
        r = ratio[t]
        if r >= 1.0:
            kept.extend(g)
        elif r <= 0.0:
            crystal[t] = 0.0
        else:
            k = min(len(g), max(N_MIN, round(r * len(g))))  # Python round: banker's
            order = sorted(g, key=lambda p: (-float(impact[p]), p))
            kept.extend(order[:k])
            crystal[t] = r * crystal[t]
    return Dissolution(sorted(kept), ratio, crystal, protected)


@dataclass
class PrefillResult:
    """What the decode phase starts from: kept positions and the trunk table."""

    dissolution: Dissolution
    trunks: list[list[int]]
    impact: torch.Tensor  # M_i per prompt position
    trunk_m: list[float]
    graph: dict[tuple[int, int], float]


def prefill_keep(attn: torch.Tensor, token_ids: list[int], delimiters: frozenset[int], budget: int,
                 chunk: int = CHUNK, t_max: int = T_MAX, tau_merge: float = TAU_MERGE,
                 alpha: float = ALPHA) -> PrefillResult:
    """S1-S6 end to end on one private prompt (T_max, tau_merge, alpha: the
    request's knobs, Table 2 defaults)."""
    n = len(token_ids)
    saliency, edges = saliency_and_edges(attn, chunk)
    impact = encoding_impact(saliency, token_ids)
    trunks = build_trunks(sentences(token_ids, delimiters), edges, t_max, tau_merge)
    trunk_m = [trunk_impact(impact, g) for g in trunks]
    graph = trunk_graph(trunks, edges)
    crystal = crystallization(len(trunks), graph)
    return PrefillResult(branch_dissolve(trunks, impact, trunk_m, crystal, budget, n, alpha=alpha), trunks, impact, trunk_m, graph)
