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
counted back from its end (the oldest may be shorter), all of type R. With
`floor="merge"` a segment at the floor may later be merged into an older one
of its type: it stays in the list (its position range still maps to it) with
`merged_into` naming the segment that now holds its tokens.
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
    #: List index of the older segment of its type whose k-means took its
    #: tokens (floor="merge"); None while it holds its own.
    merged_into: Optional[int] = None

    @property
    def importance(self) -> int:
        # Not yet typed: counted as the most important, so never picked first.
        return int(Thought.REASONING if self.thought is None else self.thought)


@dataclass
class SegmentBook:
    """One request's segments, oldest first (prompt chunks, then generated)."""

    refresh: int
    retention: Sequence[int]  # descending, e.g. (64, 32, 16, 8, 4)
    #: What the budget does once no closed segment can shrink by the schedule:
    #: "merge" two floor-size neighbours of one type, or "drop" whole segments
    #: (ThinKVParams.floor; docs/design/thinkv.md has the measurement).
    floor: str = "merge"
    segments: list[Segment] = field(default_factory=list)
    prompt_segments: int = 0  # how many leading segments are prompt chunks
    held: int = 0  # tokens each (layer, head) retains, all segments (kept up to date)
    anneal_events: int = 0  # transitions that annealed earlier segments (case 1)
    budget_events: int = 0  # segment anneals, merges or drops forced by the budget (case 2)
    merge_events: int = 0  # of which merges (floor="merge")

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
        anneal the oldest closed segment of the least important type present
        that can still shrink. The open segment (the newest generated one) is
        never annealed: it is still growing and holds the newest context.
        Past the schedule's last level **(decisions: the paper is silent)**:
        with floor="merge" (the default) two neighbouring floor-size
        segments of one type become one (`_merge_floor`); when none can
        (floor="drop", or one segment per type left) whole segments go,
        least important and oldest first; never the newest either way. Last,
        the newest is cut to what the budget leaves (at least its current
        token): only when it alone holds more than the budget."""
        while self.held > budget:
            if self._anneal_closed() or (self.floor == "merge" and self._merge_floor()) or self._drop_closed():
                self.budget_events += 1
                continue
            newest = self.segments[-1]
            self._keep(newest, max(1, budget - (self.held - newest.kept)))
            newest.level = len(self.retention)
            self.budget_events += 1
            break

    def _open(self) -> Optional[int]:
        """List index of the open segment: the newest generated one (None at
        prefill, where every segment is a finished prompt chunk)."""
        if self.segments and self.segments[-1].index >= 0:
            return len(self.segments) - 1
        return None

    def _anneal_closed(self) -> bool:
        """One schedule step for the oldest segment of the least important
        type that can still shrink, the open segment aside."""
        floor, open_ = self.retention[-1], self._open()
        movable = [(s.importance, i) for i, s in enumerate(self.segments)
                   if i != open_ and s.level < len(self.retention) and s.kept > floor]
        return bool(movable) and self._anneal(self.segments[min(movable)[1]])

    def _drop_closed(self) -> bool:
        """Drop the oldest segment of the least important type, never the newest."""
        droppable = [(s.importance, i) for i, s in enumerate(self.segments[:-1]) if s.kept > 0]
        if not droppable:
            return False
        seg = self.segments[min(droppable)[1]]
        self._keep(seg, 0)
        seg.level = len(self.retention)
        return True

    def _floor_pairs(self) -> list[tuple[int, int, int]]:
        """(importance, older, newer) list indices of every two segments at
        the floor that are neighbours among those of their type and hold
        more than the floor together (so a merge frees a token). Never the
        newest: it holds the current token (the open segment in a decode,
        the last prompt chunk at prefill end), and a merged segment's tokens
        go with the older one's."""
        floor, newest = self.retention[-1], len(self.segments) - 1
        pairs, previous = [], {}  # importance -> its last floor-size segment
        for i, s in enumerate(self.segments):
            if i == newest or s.merged_into is not None or not 0 < s.kept <= floor:
                continue
            j = previous.get(s.importance)
            if j is not None and self.segments[j].kept + s.kept > floor:
                pairs.append((s.importance, j, i))
            previous[s.importance] = i
        return pairs

    def _merge_floor(self) -> bool:
        """floor="merge": the oldest pair of the least important type becomes
        one segment holding floor tokens, chosen on the device by the k-means
        over both segments' keys (the older one holds them). Keeping the floor
        of every thought instead of dropping some whole is why: ThinKV §6.3
        (Fig. 11a) finds that keeping nothing of a segment costs accuracy."""
        pairs = self._floor_pairs()
        if not pairs:
            return False
        _, older, newer = min(pairs)
        head, gone = self.segments[older], self.segments[newer]
        kept = min(self.retention[-1], head.kept + gone.kept)
        self._keep(gone, 0)
        self._keep(head, kept)
        gone.level = len(self.retention)
        for s in self.segments:  # no chains: every member names the head
            if s.merged_into == newer:
                s.merged_into = older
        gone.merged_into = older
        self.merge_events += 1
        return True

    def targets(self) -> list[int]:
        """Tokens each (layer, head) keeps per segment, oldest first; a
        merged segment's entry is -1 - (the index of the segment holding its
        tokens), which the device reads as that segment (select.tbe_evict)."""
        return [s.kept if s.merged_into is None else -1 - s.merged_into for s in self.segments]

    def cuts(self, before: Sequence[int]) -> list[tuple[int, int, int]]:
        """The segments the device cuts now, as (index, tokens held, tokens
        kept), both beside the current token (in the newest segment): those
        keeping less than they held per `before` (what each held before this
        step's decisions). A merge's survivor held both segments' tokens."""
        newest = len(self.segments) - 1
        had = list(before)
        for i, s in enumerate(self.segments):
            if s.merged_into is not None:
                had[s.merged_into] += had[i]
        return [(i, had[i] - (i == newest), s.kept - (i == newest))
                for i, s in enumerate(self.segments) if s.merged_into is None and s.kept < had[i]]
