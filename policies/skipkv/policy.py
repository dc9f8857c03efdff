"""`skipkv` (SkipKV, skipkv-slides.txt): sentence-primary eviction.

Generated tokens are cut into sentences at delimiter tokens (ModelInfo.
delimiter_ids: ".", "?", "!" or a newline; the delimiter ends its sentence).
A finished sentence's vector is the mean of the last layer's hidden states
over its tokens; sentence i is redundant when a later sentence j has
cos(v_i, v_j) > tau (policies.skipkv.sentences). Per (layer, kv_head), a head
over its budget drops whole redundant sentences first, then its tokens of
lowest R-KV score (policies.skipkv.rkv_scores) minus lambda_ij for tokens of a
redundant sentence (policies.skipkv.select).

Host/device split: on_forward_tokens queues every request's tokens of a forward at
once (one copy of the forward's tensors, no per-request slices); step_inputs
folds the queue of every request into the device state at once
(policies.skipkv.book: no sync), reads the finished-sentence counts back
every `refresh` decode steps and, when a sentence was finished since, the
redundant set (decision: refresh 16 by default, so a redundant sentence is
seen up to 15 steps late; 1 reads every step). The spans reach the
decisions as [R, K] tensors (K padded to a power of two, so that the shapes
of a captured step change rarely), cached per request between changes.

Batching (SkipKV reorders padded batches by prompt length so that padding
does not eat the budget): SGLang's batches are ragged, each row's slots are
its own, so every request keeps its whole budget in any batch; the engine
tests check that a request's greedy output is the same alone and in a batch.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from pydantic import Field

from ..base import RequestState, StepRow
from ..observations import Need, to_device
from ..registry import register_policy
from .rkv import RKVBase, RKVParams
from .rkv_scores import due_heads
from .book import RowSentences, SentenceBook, delimiter_table
from .select import FAR, skipkv_evict
from .sentences import RedundantSpans

logger = logging.getLogger(__name__)


class SkipKVParams(RKVParams):
    tau: float = Field(default=0.9, ge=-1.0, le=1.0,
                       description="cosine above which a sentence is redundant with a later one")
    refresh: int = Field(default=16, ge=1, le=4096, description="decode steps between reads of the sentences")


class SkipKVState(RequestState):
    def __init__(self, params: SkipKVParams, num_layers: int, num_kv_heads: int):
        super().__init__(params, num_layers, num_kv_heads)
        #: Set by step_inputs before each forward: tokens seen by on_tokens
        #: after a decode step's metadata are generated, others prompt.
        self.decoding = False
        self.pool_row = -1
        self.sentences: Optional[RowSentences] = None  # its row in the policy's SentenceBook


@register_policy
class SkipKVPolicy(RKVBase):
    name = "skipkv"
    graph_safe = True  # tests_gpu/test_region_pass_cuda.py: replay equals the eager pass, no host sync
    Params = SkipKVParams
    needs = Need.ATTENTION | Need.KEYS | Need.TOKEN_IDS | Need.HIDDEN_STATES
    description = "SkipKV: whole redundant sentences evicted first, then R-KV scores minus sentence redundancy."

    _delimiters: Optional[torch.Tensor] = None
    _warned = False
    book: Optional[SentenceBook] = None  # every request's sentences, on the hidden states' device

    def begin_request(self, params, num_layers, num_kv_heads) -> SkipKVState:
        return SkipKVState(params, num_layers, num_kv_heads)

    # ----- host, once per forward ---------------------------------------------
    def on_tokens(self, state: SkipKVState, positions, token_ids, hidden_states) -> None:
        self.on_forward_tokens([(state, 0, token_ids.shape[0])], positions, token_ids, hidden_states)

    def on_forward_tokens(self, requests, positions, token_ids, hidden_states) -> None:
        # Every generating request's tokens of this forward in one queue
        # entry of the book (a copy of each tensor, not three slices per request).
        if hidden_states is None:
            return
        if self.book is None:
            delimiters = self._delimiter_table(hidden_states.device)
            if delimiters is None:
                return
            self.book = SentenceBook(delimiters, hidden_states.shape[-1], hidden_states.device)
        taken = []
        for state, start, n in requests:
            if not state.decoding or state.pool_row < 0:
                continue  # prompt tokens: sentences are cut from generated tokens only
            if state.sentences is None:
                state.sentences = self.book.open(state.pool_row)
            taken.append((state.sentences, start, n))
        if taken:
            self.book.add_forward(taken, positions, token_ids, hidden_states)

    def _delimiter_table(self, device) -> Optional[torch.Tensor]:
        if self._delimiters is None or self._delimiters.device != torch.device(device):
            ids = self.model.delimiter_ids if self.model is not None else frozenset()
            self._delimiters = delimiter_table(ids, device)
            if self._delimiters is None and not SkipKVPolicy._warned:
                SkipKVPolicy._warned = True
                logger.warning("skipkv: the model has no sentence delimiters (no tokenizer?): no sentences, "
                               "eviction by R-KV scores only")
        return self._delimiters

    # ----- host, once per step --------------------------------------------------
    def step_inputs(self, rows: list[StepRow], device) -> dict[str, torch.Tensor]:
        for row in rows:
            row.state.decoding = not row.prefill
            row.state.pool_row = row.pool_row
        if self.book is not None:
            self.book.flush()
            self.book.read([(row.state.sentences, row.state.params.tau) for row in rows
                            if row.state.sentences is not None and not row.prefill
                            and row.step % row.state.params.refresh == 0])
        spans = [row.state.sentences.spans if row.state.sentences is not None else RedundantSpans.empty()
                 for row in rows]
        most = max(s.starts.numel() for s in spans)
        K = 0 if most == 0 else max(4, 1 << (most - 1).bit_length())
        R = len(rows)
        starts, ends, penalty, rank = [], [], [], []
        for s in spans:  # flat host lists, one tensor each: cheap for hundreds of rows
            st, en, pe, ra = s.lists
            pad = K - len(st)
            starts += st + [FAR] * pad
            ends += en + [FAR] * pad
            penalty += pe + [0.0] * pad
            rank += ra + list(range(len(st), K))  # pads rank after the real spans
        starts = torch.tensor(starts, dtype=torch.int64).view(R, K)
        ends = torch.tensor(ends, dtype=torch.int64).view(R, K)
        penalty = torch.tensor(penalty, dtype=torch.float32).view(R, K)
        rank = torch.tensor(rank, dtype=torch.int64).view(R, K)
        return {"span_starts": to_device(starts, torch.int64, device),
                "span_ends": to_device(ends, torch.int64, device),
                "span_penalty": to_device(penalty, torch.float32, device),
                "span_rank": to_device(rank, torch.int64, device)}

    def end_request(self, state: SkipKVState) -> None:
        if state.sentences is not None and self.book is not None:
            self.book.close(state.sentences)
        state.sentences = None

    # ----- per layer (device) ---------------------------------------------------
    def _evict(self, batch, view, due):
        i = batch.inputs
        if not i:  # a decision called without step_inputs (unit use): no sentences
            R = view.valid.shape[0]
            empty = torch.zeros((R, 0), dtype=torch.int64, device=view.valid.device)
            i = {"span_starts": empty, "span_ends": empty, "span_rank": empty,
                 "span_penalty": empty.float()}
        return skipkv_evict(view, self._scores(batch, view), batch.budget, batch.param("window"), due,
                            i["span_starts"], i["span_ends"], i["span_penalty"], i["span_rank"])

    def select_prefill(self, batch, view, obs):
        # The prompt has no generated sentences: R-KV's cut to the budget.
        self._start_prefill(batch, view, obs)
        return self._evict(batch, view, view.held > batch.budget)

    def select_decode(self, batch, view, obs):
        self.observe_decode(batch, view, obs)
        return self._evict(batch, view, due_heads(view, batch.budget, batch.step, batch.param("buffer")))
