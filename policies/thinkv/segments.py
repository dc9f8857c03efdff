"""ThinKV's thought segments on the host (ThinKV §4.1, §4.3): which segment
each private token belongs to, its thought type, and how many of its tokens
every (layer, kv head) keeps. Plain Python, run once per step per request in
Policy.step_inputs; the device only applies the resulting per-segment targets
(policies.thinkv.select).

Every (layer, head) keeps the same number of tokens of each segment (the
anneals are decided here, per request, for all of them), so one count per
segment describes the whole request.

Segments: generated tokens of decode steps [k*refresh, (k+1)*refresh) form
segment k; a private prompt in the region is cut into refresh-sized chunks
counted back from its end (the oldest may be shorter), all of type R.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Sequence


class Thought(enum.IntEnum):
    """Thought types, valued by importance (ThinKV §3.2: R > E > T)."""

    TRANSITION = 0
    EXECUTION = 1
    REASONING = 2


def classify(sparsity: float, theta_low: float, theta_high: float) -> Thought:
    """ThinKV §4.1: T above theta_high, R between, E below theta_low."""
    if sparsity >= theta_high:
        return Thought.TRANSITION
    if sparsity >= theta_low:
        return Thought.REASONING
    return Thought.EXECUTION


@dataclass
class Segment:
    index: int  # generated segments 0, 1, ...; prompt chunks -m..-1
    size: int = 0  # tokens stored in it so far
    kept: int = 0  # tokens each (layer, head) retains
    level: int = 0  # anneals applied (the retention schedule's next entry)
    #: None until its first step's sparsity is read back; prompt chunks are R.
    thought: Optional[Thought] = None

    @property
    def importance(self) -> int:
        # Not yet typed: counted as the most important, so never picked first.
        return int(Thought.REASONING if self.thought is None else self.thought)


@dataclass
class SegmentBook:
    """One request's segments, oldest first (prompt chunks, then generated)."""

    refresh: int
    retention: Sequence[int]  # descending, e.g. (64, 32, 16, 8, 4)
    segments: list[Segment] = field(default_factory=list)
    prompt_segments: int = 0  # how many leading segments are prompt chunks
    held: int = 0  # tokens each (layer, head) retains, all segments (kept up to date)
    anneal_events: int = 0  # transitions that annealed earlier segments (case 1)
    budget_events: int = 0  # segment anneals or drops forced by the budget (case 2)

    # ----- growth ------------------------------------------------------------
    def add_prompt(self, tokens: int) -> None:
        """The private prompt's tokens, as R chunks of `refresh` counted back
        from its end. Called once, before any generated token."""
        assert not self.segments, "the prompt comes first"
        chunks = -(-tokens // self.refresh)
        for i in range(chunks):
            size = self.refresh if i < chunks - 1 else tokens - self.refresh * (chunks - 1)
            self.segments.append(Segment(index=-(i + 1), size=size, kept=size, thought=Thought.REASONING))
            self.held += size
        self.segments.reverse()  # oldest first
        self.prompt_segments = chunks

    def add_generated(self, step: int) -> Segment:
        """Decode step `step`'s token joins its segment (opened at a refresh boundary)."""
        k = step // self.refresh
        if not self.segments or self.segments[-1].index != k:
            self.segments.append(Segment(index=k))
        seg = self.segments[-1]
        seg.size += 1
        seg.kept += 1
        self.held += 1
        return seg

    def generated(self, k: int) -> Optional[Segment]:
        i = self.prompt_segments + k
        return self.segments[i] if 0 <= i < len(self.segments) else None

    # ----- eviction decisions ------------------------------------------------
    def _keep(self, seg: Segment, kept: int) -> None:
        self.held += kept - seg.kept
        seg.kept = kept

    def _anneal(self, seg: Segment) -> bool:
        """Move `seg` to its next retention level that cuts it; False when no
        level can (already at the last one, or at most its size)."""
        while seg.level < len(self.retention) and self.retention[seg.level] >= seg.kept:
            seg.level += 1  # a level at or above what it holds changes nothing
        if seg.level >= len(self.retention):
            return False
        self._keep(seg, self.retention[seg.level])
        seg.level += 1
        return True

    def transition_ended(self, k: int) -> int:
        """Case 1: generated segment k (a transition) just ended: every
        segment before it, earlier transitions and the prompt included, goes
        one level down (ThinKV §4.3: n anneals keep min(|S|, R_n)). Returns
        how many segments shrank."""
        shrunk = 0
        for seg in self.segments[: self.prompt_segments + k]:
            if seg.level < len(self.retention):
                before = seg.kept
                self._keep(seg, min(seg.kept, self.retention[seg.level]))
                seg.level += 1
                shrunk += seg.kept < before
        self.anneal_events += 1
        return shrunk

    def fit_budget(self, budget: int) -> None:
        """Case 2: while the request holds more than `budget` tokens per head,
        anneal the oldest segment of the least important type present that
        can still shrink. Past the schedule's last level **(decision: the
        paper is silent)** whole segments go, least important and oldest
        first, never the newest (it holds the current token); last, the
        newest is cut to what the budget leaves (at least its current token)."""
        floor = self.retention[-1]
        while self.held > budget:
            movable = [(s.importance, i) for i, s in enumerate(self.segments)
                       if s.level < len(self.retention) and s.kept > floor]
            if movable:
                self._anneal(self.segments[min(movable)[1]])
                self.budget_events += 1
                continue
            droppable = [(s.importance, i) for i, s in enumerate(self.segments[:-1]) if s.kept > 0]
            if droppable:
                seg = self.segments[min(droppable)[1]]
                self._keep(seg, 0)
                seg.level = len(self.retention)
                self.budget_events += 1
                continue
            newest = self.segments[-1]
            self._keep(newest, max(1, budget - (self.held - newest.kept)))
            newest.level = len(self.retention)
            self.budget_events += 1
            break

    def targets(self) -> list[int]:
        """Tokens each (layer, head) keeps per segment, oldest first."""
        return [s.kept for s in self.segments]
