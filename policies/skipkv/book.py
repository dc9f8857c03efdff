"""The sentences of every skipkv request of a process, on the hidden states'
device, updated for all requests at once.

Per forward the engine hands each request's new tokens to on_tokens; the
book only queues them (no device work per request) and `flush`, called once
per step from step_inputs, folds the whole queue into the device state in a
few batched ops: per request row (req_pool row) the current sentence's sum of
hidden states, its length and first position, and the finished sentences'
vectors and spans. Whether a token ends a sentence is looked up on the device
(a table of delimiter ids), so nothing waits for the GPU.

Finished sentences live in one store shared by all requests, each request
owning a contiguous range of it (`_Ranges`, power-of-two sizes). The host
knows how many sentences a request may have written (its count at the last
read-back plus the tokens queued since), and grows a range before it could
overflow: a read-back every `refresh` steps keeps ranges near the real count.

`read` (every `refresh` steps per request, between steps) starts copying
the counts of the due requests to the host in one transfer, and `take`, a
decode step later, finds the requests whose count changed and starts
copying their redundant sets (computed on the device) in one more, which
`take` hands to the requests one step after that. No step waits for the
GPU (policies/host_reads.py: by then the copies have landed), and the
steps are the request's own, so its spans change at the same step on
every device and in every batch.

With a cue table (`cue`, set once a request steers: policies.skipkv.steering)
the fold also counts, per row, the finished sentences holding a cue token
and whether the open sentence holds one (`revalidations`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..host_reads import HostCopy
from .sentences import RedundantSpans, redundant_sentences
from .steering import lookup

#: Smallest range of the store a request owns (sentences).
MIN_RANGE = 64


class _Ranges:
    """Power-of-two ranges of a growable store; freed ranges are reused."""

    def __init__(self):
        self.size = 0
        self.free: dict[int, list[int]] = {}

    def take(self, n: int) -> tuple[int, int]:
        cap = max(MIN_RANGE, 1 << (n - 1).bit_length())
        reuse = self.free.get(cap)
        if reuse:
            return reuse.pop(), cap
        base, self.size = self.size, self.size + cap
        return base, cap

    def give(self, base: int, cap: int) -> None:
        self.free.setdefault(cap, []).append(base)


class RowSentences:
    """Host view of one request in the book (kept in its RequestState)."""

    def __init__(self, row: int):
        self.row = row
        self.base = -1
        self.cap = 0
        self.known = 0  # finished sentences at the last read-back
        self.since = 0  # tokens queued since then (each could end a sentence)
        self.spans = RedundantSpans.empty()
        self.closed = False
        #: (step, HostCopy, index, tokens queued at the read, tau): a count on its way
        self.counting: Optional[tuple] = None
        #: (step, HostCopy, offset, sentences): redundant spans on their way
        self.spanning: Optional[tuple] = None


class SentenceBook:
    def __init__(self, delimiters: torch.Tensor, hidden: int, device):
        self.device = torch.device(device)
        self.delimiters = delimiters  # [V] bool on device
        self.hidden = hidden
        f32, i64 = torch.float32, torch.int64
        self.cur_sum = torch.zeros(0, hidden, dtype=f32, device=device)
        self.cur_count = torch.zeros(0, dtype=f32, device=device)
        self.cur_start = torch.zeros(0, dtype=i64, device=device)
        self.count = torch.zeros(0, dtype=i64, device=device)
        self.base = torch.zeros(0, dtype=i64, device=device)
        self.vectors = torch.zeros(0, hidden, dtype=f32, device=device)
        self.starts = torch.zeros(0, dtype=i64, device=device)
        self.ends = torch.zeros(0, dtype=i64, device=device)
        #: [V] bool: tokens of re-validation cues (None: not counted).
        self.cue: Optional[torch.Tensor] = None
        self.cue_sentences = torch.zeros(0, dtype=i64, device=device)
        self.cue_open = torch.zeros(0, dtype=torch.bool, device=device)
        self.ranges = _Ranges()
        #: (request, tokens, then (copy, first row) of its positions, ids, hidden states)
        self.queue: list[tuple] = []
        self._opening: list[RowSentences] = []

    # ----- host bookkeeping -------------------------------------------------------
    def open(self, row: int) -> RowSentences:
        """A request starts generating at req_pool row `row`."""
        rs = RowSentences(row)
        self._grow_rows(row + 1)
        rs.base, rs.cap = self.ranges.take(MIN_RANGE)
        self._grow_store(self.ranges.size)
        self._opening.append(rs)
        return rs

    def close(self, rs: RowSentences) -> None:
        rs.closed = True
        if rs.base >= 0:
            self.ranges.give(rs.base, rs.cap)
            rs.base = -1

    def add(self, rs: RowSentences, positions: torch.Tensor, token_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """Queue one request's generated tokens (all of the tensors' rows)."""
        self.add_forward([(rs, 0, token_ids.shape[0])], positions, token_ids, hidden)

    def add_forward(self, requests: list, positions: torch.Tensor, token_ids: torch.Tensor,
                    hidden: torch.Tensor) -> None:
        """Queue a forward's generated tokens of many requests at once:
        `requests` holds (RowSentences, first token, count) into the whole
        forward's tensors, copied once here (the engine may write into them
        after the forward), so the queue holds offsets into the copies."""
        pos, ids, hid = positions.clone(), token_ids.clone(), hidden.clone()
        for rs, start, n in requests:
            rs.since += n
            self.queue.append((rs, n, (pos, start), (ids, start), (hid, start)))

    def _grow_rows(self, n: int) -> None:
        have = self.count.shape[0]
        if n <= have:
            return
        new = max(n, 2 * have, 8)
        pad = lambda t: torch.cat([t, t.new_zeros((new - have, *t.shape[1:]))])  # noqa: E731
        self.cur_sum, self.cur_count, self.cur_start = pad(self.cur_sum), pad(self.cur_count), pad(self.cur_start)
        self.count, self.base = pad(self.count), pad(self.base)
        self.cue_sentences, self.cue_open = pad(self.cue_sentences), pad(self.cue_open)

    def _grow_store(self, n: int) -> None:
        have = self.vectors.shape[0]
        if n <= have:
            return
        new = max(n, 2 * have)
        pad = lambda t: torch.cat([t, t.new_zeros((new - have, *t.shape[1:]))])  # noqa: E731
        self.vectors, self.starts, self.ends = pad(self.vectors), pad(self.starts), pad(self.ends)

    def _fit(self, rs: RowSentences) -> None:
        """Grow the request's range when its queued tokens could overflow it."""
        need = rs.known + rs.since
        if need <= rs.cap:
            return
        base, cap = self.ranges.take(max(need, 2 * rs.cap))
        self._grow_store(self.ranges.size)
        for store in (self.vectors, self.starts, self.ends):  # the whole old range: the count is on the device
            store[base:base + rs.cap] = store[rs.base:rs.base + rs.cap]
        self.ranges.give(rs.base, rs.cap)
        rs.base, rs.cap = base, cap
        self.base[self._index([rs.row])] = self._index([base])

    def _index(self, values: list[int]) -> torch.Tensor:
        from ..observations import to_device

        return to_device(values, torch.int64, self.device)

    # ----- device updates, once per step --------------------------------------------
    def flush(self) -> None:
        """Fold the queued tokens into the device state, all requests at once."""
        if self._opening:
            rows = self._index([rs.row for rs in self._opening])
            for t in (self.cur_sum, self.cur_count, self.cur_start, self.count, self.cue_sentences, self.cue_open):
                t.index_fill_(0, rows, 0)  # (a scalar assigned through an index tensor would sync)
            self.base[rows] = self._index([rs.base for rs in self._opening])
            self._opening = []
        queue = [q for q in self.queue if not q[0].closed]
        self.queue = []
        for rs, *_ in queue:
            self._fit(rs)
        # Waves: the t-th token of each entry, rows unique within a wave (a
        # request queued by two forwards goes in two waves, in order).
        while queue:
            wave, later, seen = [], [], set()
            for entry in queue:
                (later if entry[0].row in seen else wave).append(entry)
                seen.add(entry[0].row)
            self._fold(wave)
            queue = later

    def _fold(self, entries) -> None:
        T = max(e[1] for e in entries)
        for t in range(T):  # tokens per request in one forward: 1 while decoding
            part = [e for e in entries if e[1] > t]
            rows = self._index([e[0].row for e in part])
            pos = self._gather(part, 2, t).long()
            ids = self._gather(part, 3, t).long()
            h = self._gather(part, 4, t).float()
            V = self.delimiters.shape[0]
            ends = self.delimiters[ids.clamp(0, V - 1)] & (ids >= 0) & (ids < V)
            count = self.cur_count[rows]
            self.cur_start[rows] = torch.where(count == 0, pos, self.cur_start[rows])
            total = self.cur_sum[rows] + h
            count = count + 1
            slot = self.base[rows] + self.count[rows]
            e = ends.unsqueeze(-1)
            self.vectors[slot] = torch.where(e, total / count.unsqueeze(-1), self.vectors[slot])
            self.starts[slot] = torch.where(ends, self.cur_start[rows], self.starts[slot])
            self.ends[slot] = torch.where(ends, pos, self.ends[slot])
            self.count[rows] = self.count[rows] + ends.long()
            self.cur_sum[rows] = torch.where(e, torch.zeros_like(total), total)
            self.cur_count[rows] = torch.where(ends, torch.zeros_like(count), count)
            if self.cue is not None:
                cue = self.cue_open[rows] | lookup(self.cue, ids)
                self.cue_sentences[rows] = self.cue_sentences[rows] + (cue & ends).long()
                self.cue_open[rows] = cue & ~ends

    def revalidations(self, rows: torch.Tensor) -> torch.Tensor:
        """[R] int64: cue sentences of req_pool rows `rows`, the open one included."""
        return self.cue_sentences[rows] + self.cue_open[rows].long()

    def _gather(self, part, field: int, t: int) -> torch.Tensor:
        """Row t of each entry's tensor `field`, in entry order: one
        index_select per copied tensor (one per forward, as a rule)."""
        if len(part) == 1:
            copy, first = part[0][field]
            return copy[first + t:first + t + 1].to(self.device)
        pieces, run = [], []
        for i, e in enumerate(part):
            run.append(e[field][1] + t)
            last = i + 1 == len(part) or part[i + 1][field][0] is not e[field][0]
            if last:  # a run of entries sharing one copy
                pieces.append(e[field][0].index_select(0, self._index(run).to(e[field][0].device)))
                run = []
        return torch.cat(pieces).to(self.device) if len(pieces) > 1 else pieces[0].to(self.device)

    # ----- host read-back, every `refresh` steps --------------------------------------
    def read(self, due: list[tuple[RowSentences, float, int]]) -> None:
        """Start reading back the counts of the due requests, (request, tau,
        decode step) each, after this step's flush; `take` uses them a step later."""
        due = [d for d in due if not d[0].closed]
        if not due:
            return
        copy = HostCopy(self.count[self._index([rs.row for rs, _, _ in due])])
        for at, (rs, tau, step) in enumerate(due):
            rs.counting = (step + 1, copy, at, rs.since, tau)  # the flush folded every queued token

    def take(self, rows: list[tuple[RowSentences, int]]) -> None:
        """Between steps, (request, decode step) each: hand over the spans
        due at that step, and compute the redundant sets of the requests
        whose count due now has changed (on the device; their copy starts)."""
        changed = []
        for rs, step in rows:
            if rs.closed:
                continue
            if rs.spanning is not None and rs.spanning[0] <= step:
                _, copy, at, n = rs.spanning
                rs.spanning = None
                flat = copy.tensor()
                starts, ends, redundant, penalty = (flat[at + i * n:at + (i + 1) * n] for i in range(4))
                rs.spans = RedundantSpans.of(starts.long(), ends.long(), redundant.bool(), penalty.float())
            if rs.counting is not None and rs.counting[0] <= step:
                _, copy, at, since, tau = rs.counting
                rs.counting = None
                n = copy.values()[at]
                rs.since -= since  # the tokens queued after the read stay counted
                if n != rs.known:
                    changed.append((rs, tau, n, step))
                rs.known = n
        if not changed:
            return
        parts = []
        for rs, tau, n, _ in changed:  # per request, but only every `refresh` steps and only on change
            lo, hi = rs.base, rs.base + n
            redundant, penalty = redundant_sentences(self.vectors[lo:hi], tau)
            parts += [self.starts[lo:hi].double(), self.ends[lo:hi].double(), redundant.double(), penalty.double()]
        copy, at = HostCopy(torch.cat(parts)), 0  # one transfer for every changed request
        for rs, _, n, step in changed:
            rs.spanning = (step + 1, copy, at, n)
            at += 4 * n


def delimiter_table(ids, device) -> Optional[torch.Tensor]:
    """[max id + 1] bool on device from ModelInfo.delimiter_ids (None: none)."""
    ids = sorted(int(i) for i in ids)
    if not ids:
        return None
    table = torch.zeros(ids[-1] + 1, dtype=torch.bool)
    table[ids] = True
    return table.to(device)
