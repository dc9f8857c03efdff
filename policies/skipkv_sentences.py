"""skipkv's sentences of one request: segmentation of the generated tokens,
sentence vectors (mean of the last layer's hidden states over the sentence),
and the redundant set.

The tracker lives on the hidden states' device and is fed once per forward
(Policy.on_tokens) without a host-device sync: whether a token is a
delimiter is looked up on the device, and the current sentence's sum, its
first position and the finished sentences' vectors and spans stay in device
buffers. The host reads them back only in `redundant_spans` (called from
step_inputs every `refresh` steps), and then only the sentence count and, if
it changed, the redundant set computed on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def redundant_sentences(vectors: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sentence i is redundant when some later sentence j has cos(v_i, v_j) > tau.
    vectors [K, D] in sentence order. Returns (redundant [K] bool, penalty [K]
    float32: the largest similarity to a later sentence for a redundant one,
    0 otherwise)."""
    K = vectors.shape[0]
    if K == 0:
        return torch.zeros(0, dtype=torch.bool, device=vectors.device), vectors.new_zeros(0, dtype=torch.float32)
    unit = vectors.float()
    unit = unit / unit.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    sim = unit @ unit.T
    later = torch.ones(K, K, dtype=torch.bool, device=vectors.device).triu(diagonal=1)
    best = sim.masked_fill(~later, float("-inf")).amax(dim=1)  # the last sentence has no later one: -inf
    redundant = best > tau
    return redundant, torch.where(redundant, best, torch.zeros_like(best))


@dataclass(frozen=True)
class RedundantSpans:
    """The request's redundant sentences as position spans (host tensors),
    sorted by start: first and last position of each, its penalty, and its
    eviction rank (0 first: highest penalty, ties oldest first)."""

    starts: torch.Tensor  # [Kr] int64
    ends: torch.Tensor  # [Kr] int64
    penalty: torch.Tensor  # [Kr] float32
    rank: torch.Tensor  # [Kr] int64

    @staticmethod
    def empty() -> "RedundantSpans":
        z = torch.zeros(0, dtype=torch.int64)
        return RedundantSpans(z, z, torch.zeros(0), z)

    @staticmethod
    def of(starts: torch.Tensor, ends: torch.Tensor, redundant: torch.Tensor, penalty: torch.Tensor) -> "RedundantSpans":
        starts, ends, penalty = starts[redundant], ends[redundant], penalty[redundant].float()
        # Most similar first; stable sort keeps the older of equal penalties first.
        order = torch.sort(-penalty, stable=True).indices
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel())
        return RedundantSpans(starts.long(), ends.long(), penalty, rank)


class SentenceTracker:
    """Sentences of one request's generated tokens, accumulated on the device."""

    def __init__(self, delimiters: torch.Tensor, hidden: int, device, capacity: int = 64):
        self.delimiters = delimiters  # [V] bool on device: token id -> ends a sentence
        self.device = device
        self.cur_sum = torch.zeros(hidden, dtype=torch.float32, device=device)
        self.cur_count = torch.zeros((), dtype=torch.float32, device=device)
        self.cur_start = torch.zeros((), dtype=torch.int64, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)  # finished sentences
        self.vectors = torch.zeros(capacity, hidden, dtype=torch.float32, device=device)
        self.starts = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.ends = torch.zeros(capacity, dtype=torch.int64, device=device)
        #: Generated tokens seen (host): an upper bound of the sentence count.
        self.tokens = 0
        self.known = 0  # sentence count at the last read-back
        self.spans = RedundantSpans.empty()

    def _reserve(self, n: int) -> None:
        """Room for n finished sentences (every token could end one)."""
        cap = self.vectors.shape[0]
        if n <= cap:
            return
        new = max(n, 2 * cap)
        grow = lambda t: torch.cat([t, t.new_zeros((new - cap, *t.shape[1:]))])  # noqa: E731
        self.vectors, self.starts, self.ends = grow(self.vectors), grow(self.starts), grow(self.ends)

    def _is_delimiter(self, token_ids: torch.Tensor) -> torch.Tensor:
        V = self.delimiters.shape[0]
        ids = token_ids.to(self.device).long()
        inside = (ids >= 0) & (ids < V)
        return self.delimiters[ids.clamp(0, V - 1)] & inside

    def add(self, positions: torch.Tensor, token_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """Generated tokens [T] in order with their last-layer hidden states
        [T, hidden]. Device ops only; T is 1 in a decode step."""
        T = token_ids.shape[0]
        self._reserve(self.tokens + T)
        self.tokens += T
        delim = self._is_delimiter(token_ids)
        positions = positions.to(self.device).long()
        hidden = hidden.to(self.device).float()
        for t in range(T):  # tokens of one forward (1 while decoding), never the region's slots
            first = self.cur_count == 0
            self.cur_start = torch.where(first, positions[t], self.cur_start)
            self.cur_sum += hidden[t]
            self.cur_count += 1
            ends = delim[t]
            k = self.count.view(1)
            mean = (self.cur_sum / self.cur_count).unsqueeze(0)
            self.vectors.index_copy_(0, k, torch.where(ends, mean, self.vectors.index_select(0, k)))
            self.starts.index_copy_(0, k, torch.where(ends, self.cur_start, self.starts.index_select(0, k)))
            self.ends.index_copy_(0, k, torch.where(ends, positions[t], self.ends.index_select(0, k)))
            self.count += ends.long()
            self.cur_sum *= (~ends).float()
            self.cur_count *= (~ends).float()

    def redundant_spans(self, tau: float) -> RedundantSpans:
        """The redundant set over the finished sentences, recomputed only when
        their number changed since the last call (host read-back)."""
        count = int(self.count.item())  # between steps (step_inputs): a sync is allowed here
        if count != self.known:
            self.known = count
            redundant, penalty = redundant_sentences(self.vectors[:count], tau)
            self.spans = RedundantSpans.of(self.starts[:count].cpu(), self.ends[:count].cpu(), redundant.cpu(),
                                           penalty.cpu())
        return self.spans


def delimiter_table(ids, device) -> Optional[torch.Tensor]:
    """[max id + 1] bool on device from ModelInfo.delimiter_ids (None: none)."""
    ids = sorted(int(i) for i in ids)
    if not ids:
        return None
    table = torch.zeros(ids[-1] + 1, dtype=torch.bool)
    table[ids] = True
    return table.to(device)
