"""`thinkv` (ThinKV, thinkv.txt §3-5): Think Before You Evict.

Decode steps are cut into segments of `refresh` tokens; each segment gets a
thought type (T, R, E) from the attention sparsity of its first step,
averaged over the query heads and the calibrated layers L*
(policies.thinkv.calibration). When a transition segment ends, every earlier
segment is annealed to the next level of the retention schedule; when the
request holds more than its budget, the oldest segment of the least
important type is. The host decides the per-segment targets once per step
(policies.thinkv.segments, in step_inputs); every layer then cuts the
segments over target on the device, keeping the tokens nearest the
centroids of a k-means over their post-RoPE keys (policies.thinkv.select).

Host/device hand-off: the sparsity of a refresh step is written to a
per-request device buffer [max_rows, layers] in the forward and read back
by step_inputs at the next step (one small copy every `refresh` steps).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Literal, Optional

import torch
from pydantic import Field, field_validator

from kvsieve.kernels import kv_formats as kvf

from . import calibration as calib
from ..base import ModelInfo, Policy, PolicyParams, RequestState, StepRow
from ..host_reads import HostCopy
from ..observations import Need, to_device
from ..registry import register_policy
from .segments import SegmentBook, Thought, classify
from .select import segment_index, tbe_evict

logger = logging.getLogger(__name__)

#: Target of a segment a row does not have (never cut).
_NO_TARGET = 1 << 40


def _bucket(n: int) -> int:
    """n rounded up to a power of two (0 stays 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


class ThinKVParams(PolicyParams):
    refresh: int = Field(default=128, ge=1, le=65536, description="steps per thought segment")
    retention: tuple[int, ...] = Field(default=(64, 32, 16, 8, 4), min_length=1, max_length=16,
                                       description="tokens a segment keeps after its 1st, 2nd, ... anneal")
    kmeans_iters: int = Field(default=8, ge=0, le=100, description="Lloyd iterations choosing the survivors")
    tbq: bool = Field(default=True, description="quantize generated tokens by thought type (TBQ, §4.2)")
    tbq_precision: Literal["R4E4T2", "R8E4T2"] = Field(
        default="R4E4T2", description="bits of reasoning, execution and transition tokens (8: FP8, 4: NVFP4, "
                                      "2: ternary)")

    @field_validator("retention")
    @classmethod
    def _descending(cls, retention: tuple[int, ...]) -> tuple[int, ...]:
        if any(r < 1 for r in retention):
            raise ValueError("every level must keep at least 1 token")
        if any(a <= b for a, b in zip(retention, retention[1:])):
            raise ValueError("must be strictly descending")
        return retention


class ThinKVState(RequestState):
    def __init__(self, params: ThinKVParams, num_layers: int, num_kv_heads: int):
        super().__init__(params, num_layers, num_kv_heads)
        self.book: Optional[SegmentBook] = None
        #: step_inputs may see one step twice (an extend builds groups twice):
        #: the step's key and its row inputs, to answer the same again.
        self.last_key: Optional[tuple] = None
        self.last_row: Optional[tuple] = None
        self.fallback: Optional[str] = None
        #: (step, HostCopy, index, segment): a segment's sparsity on its way
        #: to the host, typed at that decode step (host_reads.py)
        self.typing: deque = deque()

    def new_book(self) -> SegmentBook:
        return SegmentBook(refresh=self.params.refresh, retention=self.params.retention)


@register_policy
class ThinKVPolicy(Policy):
    name = "thinkv"
    Params = ThinKVParams
    needs = Need.SPARSITY | Need.KEYS
    #: tests_gpu/test_region_pass_cuda.py: replay equals the eager pass, no host sync. A
    #: step that cuts has shapes of its own (segments, members, centroids:
    #: each rounded up to a power of two in step_inputs) and runs eagerly
    #: unless a recent step had them; the steps between cuts only record
    #: sparsity and replay one graph.
    graph_safe = True
    crosses_heads = True  # its decode pass reduces over every rank's heads
    #: select_decode on a row that cuts nothing is its observe_decode: the
    #: row's targets are _NO_TARGET and it lists no segment.
    pads_decisions = True
    description = "Thought-typed segments annealed at each transition; k-means keeps representative tokens."

    calibration: Optional[calib.Calibration] = None
    _sparsity: Optional[torch.Tensor] = None  # [max_rows, layers] float32, the refresh step's sparsity

    # ----- model and calibration (once per process) ---------------------------
    def bind_model(self, info: ModelInfo) -> None:
        super().bind_model(info)
        self.use_calibration(calib.lookup(info.name, info.num_layers))

    def use_calibration(self, calibration: calib.Calibration) -> None:
        self.calibration = calibration
        self._layer_set = frozenset(calibration.layers)
        if calibration.fallback:
            logger.warning("thinkv: no calibration for model %r (%s); using the fallback layers %s and "
                           "thresholds %s. Run `kvsieve calibrate thinkv --model DIR` to calibrate.",
                           calibration.model, calibration.fallback, list(calibration.layers),
                           calibration.thresholds)
        else:
            logger.warning("thinkv: model %r calibrated: layers %s, thresholds %s", calibration.model,
                           list(calibration.layers), calibration.thresholds)

    def _calibration(self) -> calib.Calibration:
        if self.calibration is None:  # never bound (unit use): a 1-layer fallback
            self.use_calibration(calib.fallback("unknown", 1, "unbound"))
        return self.calibration

    # ----- per request ----------------------------------------------------------
    def begin_request(self, params, num_layers, num_kv_heads) -> ThinKVState:
        state = ThinKVState(params, num_layers, num_kv_heads)
        state.fallback = self._calibration().fallback
        if state.fallback:
            _count_fallback(state.fallback.split(":", 1)[0])
        return state

    # ----- quantized pages (TBQ) ------------------------------------------------
    def quantizes(self, params: ThinKVParams) -> bool:
        return params.tbq

    def group_format(self, state: ThinKVState, first_step: int) -> int:
        """The format of the thought type of the segment that holds the
        group's first token (a segment not typed yet counts as R)."""
        book = state.book
        seg = book.generated(first_step // book.refresh) if book is not None else None
        thought = Thought.REASONING if seg is None or seg.thought is None else seg.thought
        if thought == Thought.TRANSITION:
            return kvf.TERNARY
        if thought == Thought.REASONING and state.params.tbq_precision == "R8E4T2":
            return kvf.FP8
        return kvf.NVFP4

    # ----- per step (host) ------------------------------------------------------
    def step_inputs(self, rows: list[StepRow], device) -> dict[str, torch.Tensor]:
        self._read_thought_types(rows)
        per_row = [self._advance(row) for row in rows]
        cut = any(cuts for _, _, cuts in per_row)
        # No row cuts in this step: empty targets, and the decisions skip the
        # cut on that host-known shape. Else the shapes carry the host's
        # bounds: Kc cut segments, N tokens held, T tokens kept (per segment).
        # Each bound rounded up to a power of two: rows out of phase cut in
        # most steps, each step's bounds would otherwise be new shapes
        # (no captured graph to replay); the extra columns are padding.
        K = _bucket(max(len(t) for t, _, _ in per_row)) if cut else 0
        Kc = _bucket(max(len(c) for _, _, c in per_row)) if cut else 0
        N = _bucket(max((had for _, _, c in per_row for _, had, _ in c), default=0))
        T = _bucket(max((keep for _, _, c in per_row for _, _, keep in c), default=0))
        # Flat host lists, one tensor each (a tensor op per row costs more
        # than the row's work at hundreds of rows).
        flat_targets, cut_index, held, kept = [], [], [], []
        for row_targets, _, cuts in per_row:
            if K:
                flat_targets += row_targets
                flat_targets += [_NO_TARGET] * (K - len(row_targets))
            for index, had, keep in cuts:
                cut_index.append(index)
                held.append(had)
                kept.append(keep)
            pad = Kc - len(cuts)
            cut_index += [-1] * pad
            held += [0] * pad
            kept += [0] * pad
        R = len(rows)
        held_t = torch.tensor(held, dtype=torch.int64).view(R, Kc, 1)
        kept_t = torch.tensor(kept, dtype=torch.int64).view(R, Kc, 1)
        return {
            "targets": to_device(torch.tensor(flat_targets, dtype=torch.int64).view(R, K), torch.int64, device),
            "prompt_segments": to_device([p for _, p, _ in per_row], torch.int64, device),
            "cut_segments": to_device(torch.tensor(cut_index, dtype=torch.int64).view(R, Kc), torch.int64, device),
            "cut_members": to_device(torch.arange(N) < held_t, torch.bool, device),
            "cut_centroids": to_device(torch.arange(T) < kept_t, torch.bool, device),
        }

    def _advance(self, row: StepRow) -> tuple[list[int], int, list[tuple[int, int, int]]]:
        """This step of one row: its segment targets, how many prompt
        segments lead them, and the segments it cuts now as (index, tokens
        held, tokens kept), both beside the current token."""
        state: ThinKVState = row.state
        key = (row.prefill, row.step, row.private_tokens, row.budget)
        if state.last_key == key:
            return state.last_row
        before = None  # what the device holds per segment, when this step may cut
        if row.prefill:
            # The private prompt so far; the last call of a prefill has all of it.
            book = state.book = state.new_book()
            book.add_prompt(row.private_tokens)
            if book.held > row.budget:
                before = [s.kept for s in book.segments]  # the device holds the whole prompt
        else:
            book = state.book
            if book is None:
                book = state.book = state.new_book()
                prompt = row.private_tokens - (row.step + 1)
                if prompt > 0:  # a prompt in the region whose selection this policy never saw
                    book.add_prompt(prompt)
            k = row.step // book.refresh
            ended = book.generated(k - 1) if row.step and row.step % book.refresh == 0 else None
            if ended is not None and ended.thought == Thought.TRANSITION:
                before = [s.kept for s in book.segments] + [0]  # + the segment this step opens
                book.transition_ended(k - 1)  # case 1
            book.add_generated(row.step)
            if before is None and book.held > row.budget:
                before = [s.kept for s in book.segments]  # this step's token stored
            elif before is not None:
                before[-1] = book.segments[-1].kept  # this step's token stored
        book.fit_budget(row.budget)
        # The device cuts a segment to its target when it holds more; the
        # newest segment holds the current token, which stays. A row that
        # cuts nothing needs no targets (an empty list: never cut).
        if before is None:
            result = ([], book.prompt_segments, [])
            state.last_key, state.last_row = key, result
            return result
        newest = len(book.segments) - 1
        cuts = [(i, had - (i == newest), seg.kept - (i == newest))
                for i, (seg, had) in enumerate(zip(book.segments, before)) if seg.kept < had]
        result = (book.targets(), book.prompt_segments, cuts)
        state.last_key, state.last_row = key, result
        return result

    def _read_thought_types(self, rows: list[StepRow]) -> None:
        """Type each segment from its first step's recorded sparsity. The
        values are gathered for the segments whose first step ran in the
        previous forward and copied to the host without a wait (host_reads.py:
        with rows out of phase some segment starts in most steps, and a
        blocking read there stalled SGLang's overlap of host and GPU work);
        the segment is typed one decode step later, on every device alike."""
        cal = None
        for row in rows:
            queue = row.state.typing
            while queue and not row.prefill and queue[0][0] <= row.step:
                _, copy, at, seg = queue.popleft()
                value = copy.values()[at]
                if not math.isnan(value):
                    cal = cal or self._calibration()
                    seg.thought = classify(value, *cal.thresholds)
        due, segments = [], []
        for row in rows:
            book = row.state.book
            if row.prefill or book is None or row.step < 1 or (row.step - 1) % book.refresh:
                continue
            seg = book.generated((row.step - 1) // book.refresh)
            queue = row.state.typing
            if seg is not None and seg.thought is None and not (queue and queue[-1][3] is seg):
                due.append(row)
                segments.append(seg)
        if not due or self._sparsity is None:
            return
        cal = cal or self._calibration()
        device = self._sparsity.device
        layers = to_device(list(cal.layers), torch.int64, device)
        index = to_device([row.pool_row for row in due], torch.int64, device)
        copy = HostCopy(self._sparsity[index][:, layers].mean(-1))
        for at, (row, seg) in enumerate(zip(due, segments)):
            row.state.typing.append((row.step + 1, copy, at, seg))

    # ----- per layer (device) ---------------------------------------------------
    def _record_sparsity(self, batch, obs) -> None:
        self._calibration()
        if batch.layer not in self._layer_set or obs.sparsity is None or batch.pool_rows is None:
            return
        layers = self.model.num_layers if self.model is not None else batch.layer + 1
        if self._sparsity is None or self._sparsity.shape[0] < batch.max_rows or self._sparsity.shape[1] < layers:
            self._sparsity = torch.full((max(batch.max_rows, 1), layers), float("nan"),
                                        device=obs.sparsity.device)
        first_step = (batch.step % batch.param("refresh")) == 0  # [R]
        held = self._sparsity[batch.pool_rows, batch.layer]
        layer_sparsity = batch.heads.mean(obs.sparsity.float().mean(-1))  # over every rank's query heads
        self._sparsity[batch.pool_rows, batch.layer] = torch.where(first_step, layer_sparsity, held)

    def _cut(self, batch, view, prefill: bool):
        inputs = batch.inputs
        if inputs["targets"].shape[1] == 0:  # host-known shape: nothing to cut in this step
            return None
        newest = torch.where(view.valid, view.position, torch.full_like(view.position, -1)).amax(dim=(1, 2))
        # Decode step 0's token sits at gen_start; a prefill ends just before it.
        gen_start = newest + 1 if prefill else newest - batch.step
        seg = segment_index(view.position, gen_start, batch.param("refresh"), inputs["prompt_segments"])
        current = view.valid & (view.position == newest.view(-1, 1, 1))
        return tbe_evict(view.valid, view.position, view.keys, seg, current, inputs["targets"],
                         inputs["cut_segments"], inputs["cut_members"], inputs["cut_centroids"],
                         batch.param("kmeans_iters"), batch.max_param("kmeans_iters"))

    def select_prefill(self, batch, view, obs):
        return self._cut(batch, view, prefill=True)

    def observe_decode(self, batch, view, obs):
        self._record_sparsity(batch, obs)

    def deciding_rows(self, rows):
        # A row cuts only where step_inputs listed segments to cut (a
        # transition's anneal, or the budget reached): the k-means and the
        # key gather run for those rows only.
        return [bool(row.state.last_row and row.state.last_row[2]) for row in rows]

    def select_decode(self, batch, view, obs):
        self.observe_decode(batch, view, obs)
        return self._cut(batch, view, prefill=False)


def _count_fallback(reason: str) -> None:
    """kvsieve_policy_fallback_total{policy="thinkv", reason}: defined with the
    engine's metrics; absent (no prometheus_client) outside the engine."""
    try:
        from kvsieve.radix_ext.metrics import POLICY_FALLBACKS
    except ImportError:
        return
    POLICY_FALLBACKS.labels(ThinKVPolicy.name, reason).inc()
