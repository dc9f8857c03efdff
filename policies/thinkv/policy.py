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
import os
from collections import deque
from typing import Annotated, Literal, Optional

import torch
from pydantic import Field, field_validator

from kvsieve.kernels import kv_formats as kvf

from . import calibration as calib
from ..base import ModelInfo, Policy, PolicyParams, RequestState, StepRow
from ..host_reads import HostCopy
from ..observations import Need, to_device
from ..registry import register_policy
from ..spec import KVPolicyError
from .segments import SegmentBook, Thought, classify
from .select import segment_index, tbe_evict

logger = logging.getLogger(__name__)

#: Target of a segment a row does not have (never cut).
_NO_TARGET = 1 << 40


def _bucket(n: int) -> int:
    """n rounded up to a power of two (0 stays 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


#: The widest cut-segment shapes step_inputs starts from (tokens held per
#: cut segment): a larger `refresh` buckets its segments above this.
MAX_CUT_WIDTH = 256


#: Width of the server's quantized rows, 4 or 8 bits (radix_ext/memory_split
#: reads the same setting to size them).
TBQ_BITS_ENV = "KVSIEVE_TBQ_BITS"

# Strict items: JSON true or "0.5" is not a threshold, nor "3" a layer.
Sparsity = Annotated[float, Field(ge=0.0, le=1.0, strict=True)]
LayerIndex = Annotated[int, Field(ge=0, le=4095, strict=True)]


def server_tbq_bits() -> int:
    """Bits per element a quantized page row of this server holds."""
    return 8 if os.environ.get(TBQ_BITS_ENV, "4") == "8" else 4


class ThinKVParams(PolicyParams):
    refresh: int = Field(default=128, ge=1, le=65536, description="steps per thought segment")
    retention: tuple[int, ...] = Field(default=(64, 32, 16, 8, 4), min_length=1, max_length=16,
                                       description="tokens a segment keeps after its 1st, 2nd, ... anneal")
    kmeans_iters: int = Field(default=8, ge=0, le=100, description="Lloyd iterations choosing the survivors")
    floor: Literal["drop", "merge"] = Field(
        default="merge", description="once every closed segment is at the schedule's last level and the budget is "
                                    "still exceeded: drop whole segments, or merge two neighbouring segments of one "
                                    "thought type into one of the last level's size (k-means over both)")
    tbq: bool = Field(default=True, description="quantize generated tokens by thought type (TBQ, §4.2)")
    tbq_precision: Literal["R4E4T2", "R8E4T2"] = Field(
        default="R4E4T2", description="bits of reasoning, execution and transition tokens (8: FP8, 4: NVFP4, "
                                      f"2: ternary); R8E4T2 needs a server started with {TBQ_BITS_ENV}=8")
    thresholds: Optional[tuple[Sparsity, Sparsity]] = Field(
        default=None, description="(theta_1, theta_2) sparsity thresholds between thought types (E below theta_1, "
                                  "T from theta_2, §4.1), overriding the model's calibration artifact")
    layers: Optional[tuple[LayerIndex, ...]] = Field(
        default=None, min_length=1, max_length=64,
        description="layers L* whose mean sparsity types a segment (§4.1), overriding the calibration artifact")

    @field_validator("retention")
    @classmethod
    def _descending(cls, retention: tuple[int, ...]) -> tuple[int, ...]:
        if any(r < 1 for r in retention):
            raise ValueError("every level must keep at least 1 token")
        if any(a <= b for a, b in zip(retention, retention[1:])):
            raise ValueError("must be strictly descending")
        return retention

    @field_validator("tbq_precision")
    @classmethod
    def _server_holds_it(cls, precision: str, info) -> str:
        # Refused rather than stored at a lower precision than asked.
        if precision == "R8E4T2" and info.data.get("tbq", True) and server_tbq_bits() < 8:
            raise ValueError(f"R8E4T2 keeps reasoning tokens in FP8, and this server's quantized pages hold "
                             f"4-bit rows ({TBQ_BITS_ENV} is not 8); ask for R4E4T2 or tbq: false, or start "
                             f"the server with {TBQ_BITS_ENV}=8")
        return precision

    @field_validator("thresholds")
    @classmethod
    def _ordered(cls, thresholds):
        if thresholds is not None and not thresholds[0] < thresholds[1]:
            raise ValueError("theta_1 must be below theta_2")
        return thresholds

    @field_validator("layers")
    @classmethod
    def _distinct(cls, layers):
        if layers is not None and len(set(layers)) != len(layers):
            raise ValueError("must not repeat a layer")
        return layers


_TYPE_NAMES = {Thought.REASONING: "reasoning", Thought.EXECUTION: "execution", Thought.TRANSITION: "transition"}
_FORMAT_NAMES = {kvf.FP8: "fp8", kvf.NVFP4: "nvfp4", kvf.TERNARY: "ternary"}


def precision_of(thought: Thought, tbq_precision: str) -> int:
    """Storage format of a thought type's groups (§4.2): T ternary, E NVFP4,
    R NVFP4 or FP8. FP8 only where the server's rows hold it (the engine
    stores it as NVFP4 otherwise; the params refuse R8E4T2 there first)."""
    if thought == Thought.TRANSITION:
        return kvf.TERNARY
    if thought == Thought.REASONING and tbq_precision == "R8E4T2" and server_tbq_bits() >= 8:
        return kvf.FP8
    return kvf.NVFP4


class ThinKVState(RequestState):
    def __init__(self, params: ThinKVParams, num_layers: int, num_kv_heads: int):
        super().__init__(params, num_layers, num_kv_heads)
        self.book: Optional[SegmentBook] = None
        #: step_inputs may see one step twice (an extend builds groups twice):
        #: the step's key and its row inputs, to answer the same again.
        self.last_key: Optional[tuple] = None
        self.last_row: Optional[tuple] = None
        self.fallback: Optional[str] = None
        #: The layers and thresholds that type its segments: the model's
        #: calibration, or its own overrides (set by begin_request).
        self.calibration: Optional[calib.Calibration] = None
        self.num_layers = num_layers
        #: [num_layers] bools of its own layer set; None without an override.
        self.layer_mask: Optional[list[bool]] = None
        #: first decode step of each quantized group -> (thought, format), as
        #: group_format named it: what kv_usage reports.
        self.groups: dict[int, tuple[Thought, int]] = {}
        #: (step, HostCopy, index, segment): a segment's sparsity on its way
        #: to the host, typed at that decode step (host_reads.py)
        self.typing: deque = deque()

    def new_book(self) -> SegmentBook:
        return SegmentBook(refresh=self.params.refresh, retention=self.params.retention, floor=self.params.floor)


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
    decides_layers_apart = True  # its sparsity is recorded per row at batch.row_layers(); the cut is per row
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
        try:
            state.calibration = calib.overridden(self._calibration(), num_layers, params.layers, params.thresholds)
        except ValueError as exc:
            raise KVPolicyError("kv_policy.params.layers", str(exc)) from None
        if params.layers is not None:
            chosen = set(state.calibration.layers)
            state.layer_mask = [layer in chosen for layer in range(num_layers)]
        state.fallback = state.calibration.fallback
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
        fmt = precision_of(thought, state.params.tbq_precision)
        state.groups[first_step] = (thought, fmt)
        return fmt

    def usage(self, state: ThinKVState) -> dict:
        """kv_usage: the format each thought type's quantized groups got
        ("full" for a type with none: no TBQ, or no whole group of it), the
        group counts, and the calibration that typed the segments."""
        precision = {t: "full" for t in _TYPE_NAMES.values()}
        groups = {t: 0 for t in _TYPE_NAMES.values()}
        for thought, fmt in state.groups.values():
            precision[_TYPE_NAMES[thought]] = _FORMAT_NAMES[fmt]
            groups[_TYPE_NAMES[thought]] += 1
        cal = state.calibration or self._calibration()
        source = "override" if len(cal.overrides) == 2 else "fallback" if cal.fallback else "artifact"
        return {"tbq_precision": precision, "tbq_groups": groups,
                "thought_typing": {"layers": list(cal.layers), "thresholds": list(cal.thresholds),
                                   "source": source, "overrides": list(cal.overrides)}}

    # ----- per step (host) ------------------------------------------------------
    def step_inputs(self, rows: list[StepRow], device) -> dict[str, torch.Tensor]:
        self._read_thought_types(rows)
        per_row = [self._advance(row) for row in rows]
        cut = any(cuts for _, _, cuts, _ in per_row)
        # No row cuts in this step: empty targets, and the decisions skip the
        # cut on that host-known shape. Else the shapes carry the host's
        # bounds: Kc cut segments, N tokens held, T tokens kept (per segment).
        # Each bound rounded up to a power of two: rows out of phase cut in
        # most steps, each step's bounds would otherwise be new shapes
        # (no captured graph to replay); the extra columns are padding.
        # N and T start at a segment's width and half of it: a segment's
        # tokens halve cut after cut (128 -> 64 -> ... -> 4), each halving
        # was a new group shape (a capture of 30-140 ms on an H200,
        # 2026-12-02), and the padded k-means costs the GPU no more kernels.
        # The floor keeps the gathered keys (Kc x N per head) within twice
        # the tokens a cutting row holds, so within the slots the decision
        # scratch was planned for, however many segments a step cuts.
        K = _bucket(max(len(t) for t, _, _, _ in per_row)) if cut else 0
        Kc = _bucket(max(len(c) for _, _, c, _ in per_row)) if cut else 0
        width = _bucket(min(max(row.state.params.refresh for row in rows), MAX_CUT_WIDTH)) if cut else 0
        if cut:
            width = min(width, _bucket(max(row_held for _, _, _, row_held in per_row)) // Kc)
        N = max(_bucket(max((had for _, _, c, _ in per_row for _, had, _ in c), default=0)), width)
        T = max(_bucket(max((keep for _, _, c, _ in per_row for _, _, keep in c), default=0)), width // 2)
        # Flat host lists, one tensor each (a tensor op per row costs more
        # than the row's work at hundreds of rows).
        flat_targets, cut_index, held, kept = [], [], [], []
        for row_targets, _, cuts, _ in per_row:
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
        inputs = {
            "targets": to_device(torch.tensor(flat_targets, dtype=torch.int64).view(R, K), torch.int64, device),
            "prompt_segments": to_device([p for _, p, _, _ in per_row], torch.int64, device),
            "cut_segments": to_device(torch.tensor(cut_index, dtype=torch.int64).view(R, Kc), torch.int64, device),
            "cut_members": to_device(torch.arange(N) < held_t, torch.bool, device),
            "cut_centroids": to_device(torch.arange(T) < kept_t, torch.bool, device),
        }
        if any(row.state.layer_mask is not None for row in rows):
            # Some row types its segments from layers of its own: every layer
            # records sparsity for the rows whose set holds it. Only then, so
            # the usual group records in L* alone (an input name is part of
            # a captured graph's key, so either kind replays its own graph).
            inputs["sparsity_layers"] = to_device([self._layer_mask(row.state) for row in rows], torch.bool, device)
        return inputs

    def _layer_mask(self, state: ThinKVState) -> list[bool]:
        if state.layer_mask is not None:
            return state.layer_mask
        return [layer in self._layer_set for layer in range(state.num_layers)]

    def _advance(self, row: StepRow) -> tuple[list[int], int, list[tuple[int, int, int]], int]:
        """This step of one row: its segment targets, how many prompt
        segments lead them, the segments it cuts now as (index, tokens
        held, tokens kept), both beside the current token, and the tokens
        the row holds before the cut (0 when it cuts nothing)."""
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
            result = ([], book.prompt_segments, [], 0)
            state.last_key, state.last_row = key, result
            return result
        cuts = book.cuts(before)
        result = (book.targets(), book.prompt_segments, cuts, sum(before))
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
                    cal = row.state.calibration or self._calibration()
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
        device = self._sparsity.device
        index = to_device([row.pool_row for row in due], torch.int64, device)
        if all(row.state.layer_mask is None for row in due):
            layers = to_device(list(self._calibration().layers), torch.int64, device)
            copy = HostCopy(self._sparsity[index][:, layers].mean(-1))
        else:  # each row's mean over its own layers (a layer not recorded yet: NaN, typed later)
            width = self._sparsity.shape[1]
            mask = to_device([self._layer_mask(row.state)[:width] for row in due], torch.bool, device)
            values = torch.where(mask, self._sparsity[index][:, :mask.shape[1]], torch.zeros((), device=device))
            copy = HostCopy(values.sum(-1) / mask.sum(-1).clamp(min=1))
        for at, (row, seg) in enumerate(zip(due, segments)):
            row.state.typing.append((row.step + 1, copy, at, seg))

    # ----- per layer (device) ---------------------------------------------------
    def _record_sparsity(self, batch, obs) -> None:
        self._calibration()
        chosen = batch.inputs.get("sparsity_layers")  # [R, layers]: rows with layer sets of their own
        if obs.sparsity is None or batch.pool_rows is None:
            return
        stacked = batch.layers is not None  # several layers' rows (radix_ext/layer_blocks.py)
        if chosen is None and not stacked and batch.layer not in self._layer_set:
            return
        top = max(batch.layer_ids) if stacked else batch.layer
        layers = self.model.num_layers if self.model is not None else top + 1
        if self._sparsity is None or self._sparsity.shape[0] < batch.max_rows or self._sparsity.shape[1] < layers:
            self._sparsity = torch.full((max(batch.max_rows, 1), layers), float("nan"),
                                        device=obs.sparsity.device)
        first_step = (batch.step % batch.param("refresh")) == 0  # [R]
        row_layer = batch.row_layers()
        if chosen is not None and stacked:
            first_step = first_step & chosen.gather(1, row_layer.view(-1, 1)).squeeze(1)
        elif chosen is not None:
            first_step = first_step & chosen[:, batch.layer]
        elif stacked:  # the rows whose layer is one the calibration records
            first_step = first_step & self._layer_set_mask(layers, obs.sparsity.device)[row_layer]
        held = self._sparsity[batch.pool_rows, row_layer]
        layer_sparsity = batch.heads.mean(obs.sparsity.float().mean(-1))  # over every rank's query heads
        self._sparsity[batch.pool_rows, row_layer] = torch.where(first_step, layer_sparsity, held)

    def _layer_set_mask(self, layers: int, device) -> torch.Tensor:
        """[layers] bool: the calibration's layer set on the device, made once
        (in the eager pass that precedes any capture of a stacked pass)."""
        key = (self._layer_set, layers, str(device))
        if getattr(self, "_layer_mask_key", None) != key:
            mask = torch.zeros(layers, dtype=torch.bool)
            mask[[layer for layer in self._layer_set if layer < layers]] = True
            self._layer_mask_tensor, self._layer_mask_key = mask.to(device), key
        return self._layer_mask_tensor

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

    def decision_gather_slots(self, inputs):
        """The k-means gathers Kc x N keys per (row, head): every row padded
        to the step's most segments cut and their largest."""
        members = inputs.get("cut_members")
        return 0 if members is None else members.shape[1] * members.shape[2]

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
