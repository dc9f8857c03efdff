"""CrystalCache per-request trunk table across the decode phase (host side):
it starts from the prefill result, grows trunks from decoded sentences,
decays D every step and runs the breath cycle every 64 steps.

Decisions (policies.md marks the first; the rest are ours):
  * A decoded token's saliency is the layer-0 attention it received from
    later queries until its sentence closed (`receive`), clipped like S_i;
    its rarity counts the ids of prompt and generated tokens so far.
  * A new trunk enters with D = 0.5 (logistic of a zero z-score: no edges
    are known for it yet) and no graph edges.
  * An unfinished sentence reaching T_max tokens (the request's t_max) is
    closed as a trunk, so the unjudged tail (always kept) stays bounded by T_max.
"""

from __future__ import annotations

from collections import Counter

import torch

from .decode import BREATH, breath_cycle, decay_crystal
from .prefill import ALPHA, M_MAX, M_MIN, T_MAX, PrefillResult, trunk_impact


class CrystalTrunks:
    def __init__(self, prefill: PrefillResult, token_ids: list[int], delimiters: frozenset[int],
                 t_max: int = T_MAX, alpha: float = ALPHA):
        kept = set(prefill.dissolution.kept)
        self.t_max = t_max  # the request's T_max: longest unfinished sentence
        self.alpha = alpha  # the request's alpha for the re-eviction's score (S5)
        self.delimiters = delimiters
        self.counts = Counter(token_ids)
        impact = prefill.impact.tolist()
        self.impact = {p: impact[p] for p in kept}
        self.trunks = [[p for p in g if p in kept] for g in prefill.trunks]
        self.trunk_m = list(prefill.trunk_m)
        self.crystal = list(prefill.dissolution.crystal)
        self.graph = dict(prefill.graph)
        self.pending: list[tuple[int, int]] = []  # (position, id) of the unfinished sentence
        self.received: dict[int, float] = {}
        self.steps = 0

    def receive(self, mass: dict[int, float]) -> None:
        """Layer-0 attention received by pending tokens (position -> mass)."""
        for p, m in mass.items():
            self.received[p] = self.received.get(p, 0.0) + m

    def add_token(self, position: int, token_id: int) -> None:
        self.counts[token_id] += 1
        self.pending.append((position, token_id))
        if token_id in self.delimiters or len(self.pending) >= self.t_max:
            self._close_sentence()

    def _close_sentence(self) -> None:
        positions = [p for p, _ in self.pending]
        saliency = torch.tensor([min(M_MAX, max(M_MIN, self.received.pop(p, 0.0))) for p in positions])
        # Rarity over the whole context so far: U from the current counts.
        ids = [t for _, t in self.pending]
        rarity_ids = [self.counts[t] for t in ids]
        impact = encoding_impact_counts(saliency, rarity_ids)
        for p, m in zip(positions, impact.tolist()):
            self.impact[p] = m
        self.trunks.append(positions)
        self.trunk_m.append(trunk_impact(impact, list(range(len(positions)))))
        self.crystal.append(0.5)
        self.pending = []

    def step(self) -> bool:
        """One decode step done: D decays; True when a breath cycle is due."""
        self.crystal = decay_crystal(self.crystal, self.trunk_m)
        self.steps += 1
        return self.steps % BREATH == 0

    def breath(self, inv_key_norm: dict[int, float], budget: int, n_sink: int = 4) -> list[int]:
        """Breath cycle over the cached trunks; returns every kept position
        (trunks kept plus the unfinished sentence)."""
        live = [t for t, g in enumerate(self.trunks) if g]
        index = {t: i for i, t in enumerate(live)}
        graph = {(index[a], index[b]): w for (a, b), w in self.graph.items() if a in index and b in index}
        width = max(self.impact) + 1
        impact = torch.zeros(width, dtype=torch.float64)
        impact[torch.tensor(list(self.impact), dtype=torch.int64)] = torch.tensor(list(self.impact.values()),
                                                                                  dtype=torch.float64)
        out, graph = breath_cycle([self.trunks[t] for t in live], impact, [self.trunk_m[t] for t in live],
                                  [self.crystal[t] for t in live], graph, inv_key_norm,
                                  budget - len(self.pending), n_sink, alpha=self.alpha)
        kept = set(out.kept)
        for i, t in enumerate(live):
            self.trunks[t] = [p for p in self.trunks[t] if p in kept]
            self.crystal[t] = out.crystal[i]
        self.graph = {(live[a], live[b]): w for (a, b), w in graph.items()}
        return sorted(kept | {p for p, _ in self.pending})


    def drop_dead(self) -> None:
        """Forget trunks with no cached token left (no breath cycle judges
        them again) and the M_i of evicted positions, so that a cycle's
        work follows what is cached, not everything generated so far."""
        live = [t for t, g in enumerate(self.trunks) if g]
        if len(live) < len(self.trunks):
            index = {t: i for i, t in enumerate(live)}
            self.trunks = [self.trunks[t] for t in live]
            self.trunk_m = [self.trunk_m[t] for t in live]
            self.crystal = [self.crystal[t] for t in live]
            self.graph = {(index[a], index[b]): w for (a, b), w in self.graph.items() if a in index and b in index}
        cached = {p for g in self.trunks for p in g}
        self.impact = {p: m for p, m in self.impact.items() if p in cached}


def encoding_impact_counts(saliency: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Eq. 21-22 with the counts given (the context is wider than these tokens)."""
    rarity = 1.0 / (1.0 + torch.log1p(torch.tensor(counts, dtype=torch.float64)))
    return (M_MAX * (0.5 * saliency.double() / M_MAX + 0.5 * rarity)).clamp(M_MIN, M_MAX)
