"""CrystalCache decode phase (crystalcache.txt §3.8, policies.md) for one
request, as pure host-side functions over trunks: D decays every step
(cheap, m trunks), and every 64 steps a breath cycle runs activation,
resonance, Hebbian update and re-eviction.

Our decisions where the paper is loose:
  * Resonance: each active trunk sends a pulse along graph edges for up to
    2 hops (first arrival wins, the origin itself gets nothing); every pulse
    received is applied in turn (origins in trunk order).
  * Hebbian: only edges already in the graph between two co-active trunks
    are reinforced (a new edge would start at 0.05, which the prune rule
    would keep at the threshold without any co-attention evidence).
  * Re-eviction protects the trunks touching the first `n_sink` tokens
    (policies.md: losing the sink breaks decoding); no recent window.
"""

from __future__ import annotations

import math

import torch

from kvsieve.policies.crystalcache.prefill import ALPHA, TAU_EDGE, Dissolution, branch_dissolve

BETA0, D_C = 0.05, 2.0
THETA_ACT = 0.3
GAMMA_HOP, MAX_HOPS, TAU_PULSE, ALPHA_RES = 0.5, 2, 0.01, 0.15
ETA_HEBB, GAMMA_DECAY = 0.05, 0.99
BREATH = 64

Graph = dict[tuple[int, int], float]


def decay_crystal(crystal: list[float], mbar: list[float], steps: int = 1) -> list[float]:
    """Eq. 36 applied `steps` times: D <- max(0, D - 0.05 exp(-D M̄ / 2) D)."""
    out = list(crystal)
    for _ in range(steps):
        out = [max(0.0, d - BETA0 * math.exp(-d * m / D_C) * d) for d, m in zip(out, mbar)]
    return out


def decay_rows(crystals: list[list[float]], mbars: list[list[float]], steps: list[int]) -> list[list[float]]:
    """decay_crystal for many requests at once, each its own number of
    steps: one tensor of every request's trunks, one update per step."""
    sizes = [len(c) for c in crystals]
    if not sum(sizes):
        return [[] for _ in crystals]
    d = torch.tensor([x for c in crystals for x in c], dtype=torch.float64)
    m = torch.tensor([x for c in mbars for x in c], dtype=torch.float64)
    todo = torch.repeat_interleave(torch.tensor(steps, dtype=torch.int64), torch.tensor(sizes, dtype=torch.int64))
    for i in range(max(steps)):
        d = torch.where(todo > i, (d - BETA0 * torch.exp(-d * m / D_C) * d).clamp(min=0.0), d)
    flat, out, at = d.tolist(), [], 0
    for n in sizes:
        out.append(flat[at:at + n])
        at += n
    return out


def active_trunks(inv_key_norm: dict[int, float], trunks: list[list[int]]) -> list[bool]:
    """(a) eta = first-layer inverse key norm / its max over the kept tokens; a
    trunk is active when more than half of its kept tokens have eta > 0.3.
    `inv_key_norm` maps kept positions to 1/||k||; missing tokens were evicted."""
    top = max(inv_key_norm.values(), default=0.0)
    flags = []
    for g in trunks:
        present = [inv_key_norm[p] for p in g if p in inv_key_norm]
        hot = sum(1 for v in present if top > 0 and v / top > THETA_ACT)
        flags.append(bool(present) and hot * 2 > len(present))
    return flags


def _neighbours(graph: Graph, num: int) -> list[list[tuple[int, float]]]:
    adj: list[list[tuple[int, float]]] = [[] for _ in range(num)]
    for (a, b), w in sorted(graph.items()):
        adj[a].append((b, w))
        adj[b].append((a, w))
    return adj


def resonate(crystal: list[float], graph: Graph, active: list[bool]) -> list[float]:
    """(b) Eq. 37-38: pulse_h = pulse_{h-1} * W * 0.5, up to 2 hops, stop
    below 0.01; a trunk receiving p gets D <- min(1, D + 0.15 p (1 - D))."""
    out = list(crystal)
    adj = _neighbours(graph, len(crystal))
    for origin, on in enumerate(active):
        if not on:
            continue
        seen, frontier = {origin}, [(origin, 1.0)]
        for _ in range(MAX_HOPS):
            nxt = []
            for node, pulse in frontier:
                for other, w in adj[node]:
                    p = pulse * w * GAMMA_HOP
                    if other in seen or p < TAU_PULSE:
                        continue
                    seen.add(other)
                    out[other] = min(1.0, out[other] + ALPHA_RES * p * (1.0 - out[other]))
                    nxt.append((other, p))
            frontier = nxt
    return out


def hebbian(graph: Graph, active: list[bool]) -> Graph:
    """(c) Eq. 39-40: co-active edges +0.05 (cap 1), the others x0.99, prune < 0.05."""
    out = {}
    for (a, b), w in graph.items():
        w = min(1.0, w + ETA_HEBB) if active[a] and active[b] else GAMMA_DECAY * w
        if w >= TAU_EDGE:
            out[(a, b)] = w
    return out


def breath_cycle(trunks: list[list[int]], impact, mbar: list[float], crystal: list[float], graph: Graph,
                 inv_key_norm: dict[int, float], budget: int, n_sink: int = 4,
                 alpha: float = ALPHA) -> tuple[Dissolution, Graph]:
    """(a)-(d) on the trunks still (partly) cached. `budget` is the room left for
    trunk tokens (the caller subtracts the tokens of the unfinished sentence);
    `alpha`: the request's S5 weight, as in the prefill's dissolution.
    Returns the dissolution (kept positions, new D) and the new graph."""
    active = active_trunks(inv_key_norm, trunks)
    crystal = resonate(crystal, graph, active)
    graph = hebbian(graph, active)
    n = max((p for g in trunks for p in g), default=-1) + 1
    return branch_dissolve(trunks, impact, mbar, crystal, budget, n, n_sink=n_sink, w_recent=0, alpha=alpha), graph
