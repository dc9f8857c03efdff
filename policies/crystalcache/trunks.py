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

import math
from collections import Counter

from .decode import BREATH, breath_cycle, decay_crystal
from .prefill import ALPHA, M_MAX, M_MIN, T_MAX, PrefillResult


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
        self.add_tokens([(position, token_id)])

    def add_tokens(self, tokens) -> None:
        """(position, id) pairs in order; a delimiter or T_max tokens close a sentence."""
        counts, pending, delimiters, t_max = self.counts, self.pending, self.delimiters, self.t_max
        for position, token_id in tokens:
            counts[token_id] += 1
            pending.append((position, token_id))
            if token_id in delimiters or len(pending) >= t_max:
                self._close_sentence()
                pending = self.pending

    def _close_sentence(self) -> None:
        # Rarity over the whole context so far: U from the current counts.
        # Plain floats: a sentence is a few tokens, a tensor op costs more.
        received, counts = self.received, self.counts
        positions = [p for p, _ in self.pending]
        impact = [token_impact(received.pop(p, 0.0), counts[t]) for p, t in self.pending]
        self.impact.update(zip(positions, impact))
        self.trunks.append(positions)
        top = sorted(impact, reverse=True)[:3]
        self.trunk_m.append(sum(top) / len(top))  # Eq. 23: mean of the top-3 M_i
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
        out, graph = breath_cycle([self.trunks[t] for t in live], self.impact, [self.trunk_m[t] for t in live],
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


def token_impact(received: float, count: int) -> float:
    """Eq. 21-22 for one decoded token: its saliency (the attention it
    received, clipped) and its id's count in the context so far."""
    saliency = min(M_MAX, max(M_MIN, received))
    rarity = 1.0 / (1.0 + math.log1p(count))
    return min(M_MAX, max(M_MIN, M_MAX * (0.5 * saliency / M_MAX + 0.5 * rarity)))
