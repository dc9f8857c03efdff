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
seen up to 15 steps late; 1 reads every step; each read lands a step later
without a wait, so the spans change two steps after the read). The spans reach the
decisions as [R, K] tensors (K padded to a power of two, so that the shapes
of a captured step change rarely), cached per request between changes.

Batching (SkipKV reorders padded batches by prompt length so that padding
does not eat the budget): SGLang's batches are ragged, each row's slots are
its own, so every request keeps its whole budget in any batch; the engine
tests check that a request's greedy output is the same alone and in a batch.

Steering (`steering: true`, policies.skipkv.steering): begin_request checks
the model's vectors and the layer (a 400 naming the field otherwise);
step_inputs starts the row in the SteeringTable and sets its α from the
book's counts on the device; the usage record reports what the forward did.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from pydantic import Field, field_validator

from ..base import RequestState, StepRow
from ..cadence import due_heads
from ..observations import Need, to_device
from ..registry import register_policy
from ..spec import KVPolicyError
from . import steering, steering_vectors
from .steering import DEFAULT_ALPHA, DEFAULT_ALPHA_MAX, DEFAULT_ALPHA_STEP
from .rkv import RKVBase, RKVParams
from .book import RowSentences, SentenceBook, delimiter_table
from .select import FAR, skipkv_evict
from .sentences import RedundantSpans

logger = logging.getLogger(__name__)


class SkipKVParams(RKVParams):
    tau: float = Field(default=0.9, ge=-1.0, le=1.0,
                       description="cosine above which a sentence is redundant with a later one")
    refresh: int = Field(default=16, ge=1, le=4096, description="decode steps between reads of the sentences")
    steering: bool = Field(default=False, description="add alpha * s to one layer's hidden state at newline tokens "
                                                      "(needs `kvsieve calibrate skipkv` for the model)")
    alpha: float = Field(default=DEFAULT_ALPHA, ge=0.0, le=64.0, description="steering strength at the start")
    alpha_step: float = Field(default=DEFAULT_ALPHA_STEP, ge=0.0, le=64.0,
                              description="added to alpha per re-validation (cue sentence or repeated sentence)")
    alpha_max: float = Field(default=DEFAULT_ALPHA_MAX, ge=0.0, le=64.0, validate_default=True,
                             description="cap of alpha (at least alpha)")
    layer: Optional[int] = Field(default=None, ge=0, le=4095,
                                 description="decoder layer whose output is steered (default: the calibrated one, "
                                             "two thirds of the depth)")

    @field_validator("alpha_max")
    @classmethod
    def _cap_above_start(cls, value, info):
        start = info.data.get("alpha")
        if start is not None and value < start:
            raise ValueError(f"must be at least alpha ({start})")
        return value


class SkipKVState(RequestState):
    def __init__(self, params: SkipKVParams, num_layers: int, num_kv_heads: int):
        super().__init__(params, num_layers, num_kv_heads)
        #: Set by step_inputs before each forward: tokens seen by on_tokens
        #: after a decode step's metadata are generated, others prompt.
        self.decoding = False
        self.pool_row = -1
        self.sentences: Optional[RowSentences] = None  # its row in the policy's SentenceBook
        self.steer_layer = -1  # the steered layer (steering on), checked at begin_request
        self.steer_row = -1  # its req_pool row in the SteeringTable once started


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

    _vectors: Optional[steering_vectors.SteeringVectors] = None
    _cues: Optional[torch.Tensor] = None

    @classmethod
    def tensor_params(cls) -> list[str]:
        # Steering's parameters are read on the host (step_inputs), never by the decisions.
        return [p for p in super().tensor_params() if p not in ("steering", "alpha", "alpha_step", "alpha_max")]

    def begin_request(self, params, num_layers, num_kv_heads) -> SkipKVState:
        state = SkipKVState(params, num_layers, num_kv_heads)
        if params.steering:
            state.steer_layer = self._steering_layer(params, num_layers)
        return state

    def _steering_layer(self, params: SkipKVParams, num_layers: int) -> int:
        """The layer a steered request uses; loads the table on first use.
        KVPolicyError (a 400 naming the field) when it cannot steer."""
        field = "kv_policy.params.steering"
        engine = steering.ENGINE
        if engine is None:
            raise KVPolicyError(field, "this engine does not steer (its model's decoder layers were not found)")
        if self._vectors is None:
            name = self.model.name if self.model is not None else ""
            vectors, why = steering_vectors.lookup(name, num_layers)
            if vectors is None:
                raise KVPolicyError(field, why)
            if vectors.vectors.shape[1] != engine.hidden_size:
                raise KVPolicyError(field, f"the steering vectors have width {vectors.vectors.shape[1]}, the "
                                           f"model's hidden size is {engine.hidden_size}; calibrate this model")
            self._start_table(vectors, engine)
        layer = self._vectors.default_layer if params.layer is None else params.layer
        if layer >= num_layers:
            raise KVPolicyError("kv_policy.params.layer", f"must be below the model's {num_layers} layers")
        return layer

    def _start_table(self, vectors, engine) -> None:
        decode = self.model.decode if self.model is not None else None
        delimiters = self.model.delimiter_ids if self.model is not None else frozenset()
        if decode is None:
            raise KVPolicyError("kv_policy.params.steering",
                                "the engine has no tokenizer: no newline tokens to steer at")
        newline = steering.token_table([i for i in delimiters if "\n" in decode([i])], engine.device)
        if newline is None:
            raise KVPolicyError("kv_policy.params.steering", "the model's vocabulary has no newline token")
        self._cues = steering.token_table(self._encoded_cues(), engine.device)
        if self.book is not None:
            self.book.cue = self._cues
        steering.TABLE = steering.SteeringTable(engine.rows, vectors.vectors.to(engine.device, engine.dtype), newline)
        self._vectors = vectors
        logger.warning("skipkv: steering vectors of %r loaded (%d layers, default layer %d)", vectors.model,
                       vectors.num_layers, vectors.default_layer)

    def _encoded_cues(self) -> frozenset:
        """Single-token encodings of the cue words (with and without a leading space, capitalised)."""
        encode = self.model.encode if self.model is not None else None
        if encode is None:
            return frozenset()
        ids = set()
        for word in steering.CUE_WORDS:
            for text in (word, " " + word, word.capitalize(), " " + word.capitalize()):
                tokens = encode(text)
                if len(tokens) == 1:
                    ids.add(tokens[0])
        return frozenset(ids)

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
            self.book.cue = self._cues
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
            decoding = [row for row in rows if row.state.sentences is not None and not row.prefill]
            self.book.take([(row.state.sentences, row.step) for row in decoding])
            self.book.read([(row.state.sentences, row.state.params.tau, row.step) for row in decoding
                            if row.step % row.state.params.refresh == 0])
        self._steer(rows)
        spans = [row.state.sentences.spans if row.state.sentences is not None else RedundantSpans.empty()
                 for row in rows]
        most = max(len(s.lists[0]) for s in spans)
        R = len(rows)
        if most == 0:  # no redundant sentence in any row (the usual step): no span table to build
            empty = torch.zeros((R, 0), dtype=torch.int64, device=device)
            return {"span_starts": empty, "span_ends": empty, "span_penalty": empty.float(), "span_rank": empty}
        K = max(4, 1 << (most - 1).bit_length())
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

    def _steer(self, rows: list[StepRow]) -> None:
        """Start newly steered rows in the table, and set every steered
        decoding row's α from its re-validations (device ops, no sync)."""
        table = steering.TABLE
        if table is None:
            return
        due = []
        for row in rows:
            state = row.state
            if state.steer_layer < 0:
                continue
            if state.steer_row < 0:
                state.steer_row = row.pool_row
                table.begin(row.pool_row, state.steer_layer, state.params.alpha)
            if state.sentences is not None and self.book is not None and not row.prefill:
                due.append(state)
        if not due:
            return
        device = table.alpha.device
        rows_index = to_device([s.steer_row for s in due], torch.int64, device)
        repeats = to_device([s.sentences.spans.starts.numel() for s in due], torch.int64, device)
        p = [s.params for s in due]
        alpha = steering.alpha_schedule(to_device([x.alpha for x in p], torch.float32, device),
                                        to_device([x.alpha_step for x in p], torch.float32, device),
                                        to_device([x.alpha_max for x in p], torch.float32, device),
                                        self.book.revalidations(rows_index) + repeats)
        table.set_alpha(rows_index, alpha)

    def usage(self, state: SkipKVState) -> dict:
        if state.steer_layer < 0:
            return {}
        report = {"layer": state.steer_layer, "steered_tokens": 0, "alpha_peak": 0.0}
        if state.steer_row >= 0 and steering.TABLE is not None:
            report.update(steering.TABLE.report(state.steer_row))
        return {"steering": report}

    def end_request(self, state: SkipKVState) -> None:
        if state.sentences is not None and self.book is not None:
            self.book.close(state.sentences)
        state.sentences = None
        if state.steer_row >= 0 and steering.TABLE is not None:
            steering.TABLE.end(state.steer_row, state.steer_layer)
        state.steer_row = -1

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
