"""What every compression policy is: a name, a parameter model, and batched
decisions.

One small class per policy (in the spirit of kvpress's presses). A policy is
a set of functions over a batch: for one layer, `select_prefill` and
`select_decode` get every row of the batch that runs this policy at once, as
[rows, heads, slots] tensors with per-row parameters and budgets as tensors
(policies.observations), and return an eviction mask of the same shape (True:
clear that slot) or None. The engine calls each policy class present in a
batch once per layer, with no Python loop over rows, heads or slots and no
host-device sync, so the decision can run inside a CUDA graph.

Per-request Python state is for rare events only (`on_tokens`, thought-type
transitions, calibration lookups), kept in a RequestState the policy makes
in `begin_request`, and applied between steps. radix_ext applies decisions to
the compressed region; a policy never touches SGLang objects.
"""

from __future__ import annotations

from dataclasses import dataclass
import types
import typing
from typing import Callable, ClassVar, Optional

import torch
from pydantic import BaseModel, ConfigDict, field_validator

from .observations import Need, Observations, PolicyBatch, SlotView, rows_to_device


class PolicyParams(BaseModel):
    """Base of every policy's parameter model: unknown fields are errors and
    types are strict (JSON `true` is not 1, "64" is not 64; an integer is
    still a valid float)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_loose_values(cls, value, info):
        # Pydantic's lax mode turns `true` into 1, "64" into 64 and "yes" into
        # True; full strict mode would also refuse a JSON list for a tuple
        # field. Refuse just booleans/strings given for numbers and
        # non-booleans given for booleans (Optional[...] fields included).
        kinds = _scalar_kinds(cls.model_fields[info.field_name].annotation)
        if kinds & {int, float} and bool not in kinds and isinstance(value, (bool, str)):
            raise ValueError(f"must be a number, not {type(value).__name__}")
        if kinds == {bool} and not isinstance(value, bool):
            raise ValueError(f"must be a boolean, not {type(value).__name__}")
        return value


def _scalar_kinds(annotation) -> set:
    """{int, float, bool} members of a field's type, through Optional/Union."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    members = [a for a in args if a is not type(None)] or [annotation]
    return {a for a in members if a in (int, float, bool)}


class RequestState:
    """Per-request host state of a policy (rare events only). The default
    keeps the request's params; subclasses add what they need."""

    def __init__(self, params: PolicyParams, num_layers: int, num_kv_heads: int):
        self.params = params


@dataclass(frozen=True)
class ModelInfo:
    """What a policy may know about the served model, given once per process
    (Policy.bind_model) before any request."""

    name: str
    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    #: Token ids that end a sentence: they decode to ".", "?", "!" or contain "\n".
    delimiter_ids: frozenset = frozenset()
    #: The model's tokenizer (text -> ids), None when the engine has none.
    encode: Optional[Callable[[str], list]] = None
    #: Its inverse (ids -> text), None when the engine has no tokenizer.
    decode: Optional[Callable[[list], str]] = None


@dataclass(slots=True)  # hundreds are made per step
class StepRow:
    """One request of a policy group in this step, as step_inputs sees it."""

    state: RequestState
    step: int  # decode step (tokens generated before this one); 0 in a prefill
    pool_row: int  # req_pool row: stable for the request's life
    budget: int  # tokens per (layer, kv head) this step
    prefill: bool
    #: Private tokens of the request stored so far, this step's included
    #: (its private prompt, when that is in the region, and generated tokens).
    private_tokens: int = 0


class Policy:
    """Base class of a compression policy.

    Subclasses set `name`, `Params` (a PolicyParams subclass with defaults and
    bounds), `needs` (the observations their decisions read) and override the
    decisions they make. `compresses` is False only for `full`, which keeps
    SGLang's own KV path untouched. `compress_prompt` is the default of the
    kv_policy field of that name: True for policies that select from the
    prompt (its private part then lives in the region and is cut at prefill
    end); False for decode-phase policies, whose prompt stays in SGLang's
    radix cache, shared with later requests, and only generated tokens go to
    the region.

    The region calls select_decode after the step's new token is stored and
    has taken part in attention, so the new token is scored in its own step.
    Numeric fields of Params reach the decisions as [R] tensors in
    PolicyBatch.params (the engine builds them once per step).
    """

    name: ClassVar[str]
    Params: ClassVar[type[PolicyParams]] = PolicyParams
    compresses: ClassVar[bool] = True
    takes_budget: ClassVar[bool] = True
    compress_prompt: ClassVar[bool] = False
    needs: ClassVar[Need] = Need.NONE
    #: Whether decisions update SlotView.score / last_hit (written back to
    #: the region after each step only then: it is a write per layer per step).
    keeps_slot_state: ClassVar[bool] = False
    description: ClassVar[str] = ""
    #: Whether select_decode may be captured in a CUDA graph and replayed
    #: (radix_ext/region_graphs.py): its only host inputs are shapes and
    #: parameter maxima, and it does not allocate state it keeps. Set it
    #: once tests_gpu/test_region_pass_cuda.py passes for the policy on a
    #: GPU (replay equals the eager pass, no host sync).
    graph_safe: ClassVar[bool] = False
    #: Whether observe_decode alone may be captured and replayed, for a
    #: policy whose select_decode may not (it hands a snapshot to the host):
    #: the steps between its decisions then replay from graphs.
    observe_graph_safe: ClassVar[bool] = False
    #: Whether the decode pass combines heads through PolicyBatch.heads (a
    #: collective under tensor parallelism: LongFlow's layer-wide score,
    #: ThinKV's sparsity mean, CrystalCache's snapshot). Under TP such a
    #: pass runs eagerly; passes without one replay from graphs there too
    #: (radix_ext/region_graphs.capturable).
    crosses_heads: ClassVar[bool] = False
    #: Whether the policy reads the first layer's observations only
    #: (attention, slot state): the other layers compute none for its rows
    #: and skip its observe_decode; select_decode still runs in every layer.
    observes_first_layer_only: ClassVar[bool] = False
    #: Whether select_decode on a row whose decision is not due (deciding_rows
    #: said False) changes what observe_decode would and evicts nothing. The
    #: engine may then run such rows with the deciding ones to keep the
    #: deciding group's size on a few buckets (step_meta.decision_bucket): a
    #: batch of requests at different phases of their cadence then keeps its
    #: step shapes, and replays its captured graphs, from step to step.
    pads_decisions: ClassVar[bool] = False
    #: Whether a group's decision may run on any split of its rows in
    #: separate calls (each row's result depends on that row alone, and no
    #: host state is keyed by the group): the engine then decides in row
    #: chunks that bound the keys it gathers (step_meta.chunk_key_readers)
    #: and retries a decision that ran out of GPU memory on halves of the
    #: group. CrystalCache hands its breath-cycle snapshot to the host per
    #: group: it decides whole.
    decides_rows_apart: ClassVar[bool] = True
    #: Whether select_decode / observe_decode of a row in one layer reads
    #: nothing of which layer it is (not batch.layer, no per-(row, layer)
    #: buffer): only its slots, observations and per-row inputs. The engine
    #: may then stack several layers' rows into one call where the groups
    #: run after the decoder stack (radix_ext/layer_blocks.py): the same
    #: work in a k-th of the kernels.
    decides_layers_apart: ClassVar[bool] = False

    @classmethod
    def decide_graph_safe(cls, input_names) -> bool:
        """Whether this step's decide pass may be captured, given the names
        of its step inputs (those step_inputs returned): graph_safe, unless
        a policy whose select_decode hands something to the host on some
        steps only (CrystalCache's snapshot) says its other steps may be."""
        return cls.graph_safe

    # ----- batched decisions (inside the forward) ---------------------------
    def select_prefill(self, batch: PolicyBatch, view: SlotView, obs: Observations) -> Optional[torch.Tensor]:
        """The private prompt of `batch.layer` is stored for every row; may
        select what to keep. obs holds what the prompt's last queries saw."""
        return None

    def select_decode(self, batch: PolicyBatch, view: SlotView, obs: Observations) -> Optional[torch.Tensor]:
        """One decode step of `batch.layer` is done for the rows whose
        decision is due (deciding_rows). Called for every row every step it
        must give the same result, so it does its own due check on the
        device and its own observe_decode."""
        return None

    def observe_decode(self, batch: PolicyBatch, view: SlotView, obs: Observations) -> None:
        """One decode step of `batch.layer` for the rows whose decision is
        not due in this step: update the per-slot state the decisions read
        (a running mean of attention, ThinKV's sparsity), evict nothing."""

    @classmethod
    def acts_during_decode(cls) -> bool:
        """Whether a decode step runs anything of this policy (its own
        select_decode or observe_decode). One that only selects from the
        prompt (snapkv) forms no decode group: its rows store and attend,
        ask for no observations, and no group pass runs for them."""
        return cls.select_decode is not Policy.select_decode or cls.observe_decode is not Policy.observe_decode

    def deciding_rows(self, rows: list[StepRow]) -> Optional[list[bool]]:
        """Host, once per decode step after step_inputs: which rows run
        select_decode in this step (the others run observe_decode only), or
        None for all of them. A policy that decides every k steps (rkv's
        `buffer`) or at segment ends (thinkv) names the rows due now, so the
        engine runs the decision, and gathers the keys it reads, for those
        rows only."""
        return None

    def decision_gather_slots(self, inputs: dict) -> int:
        """Keys per (row, head) one decision gathers when that can be more
        than its view's slots (0: never more), read from the step's inputs'
        shapes. The engine sizes its decision chunks by the larger, so the
        decision scratch planned per slot (memory_plan) holds."""
        return 0

    # ----- per-process and per-step host hooks -------------------------------
    model: Optional[ModelInfo] = None

    def bind_model(self, info: ModelInfo) -> None:
        """Called once per process, before any request, with the served model."""
        self.model = info

    def step_inputs(self, rows: list[StepRow], device) -> dict[str, torch.Tensor]:
        """Per-step dynamic inputs of the group's rows, built on the host
        before the forward (with observations.to_device: no sync). Each
        tensor has len(rows) as its leading dim; decisions read them as
        `batch.inputs[name]`. A "budget" of shape [R, num_layers, H] replaces
        the uniform budget (batch.budget is then its [:, layer] slice). Runs
        between steps, so a rare host read of device state (every N steps)
        belongs here, not in the decisions."""
        return {}

    def prompt_attention_inputs(self, rows: list, device) -> dict[str, torch.Tensor]:
        """Need.LAYER0_ATTENTION: the rows of this policy whose private prompt
        ends in this step, each as an observations.PromptAttention (host
        tensors), once per step in the first layer's forward, before any
        layer's select_prefill; the tensors returned join those rows'
        `batch.inputs` for this step's select_prefill (leading dim: rows)."""
        return {}

    # ----- per-request host events (between steps) -------------------------
    def begin_request(self, params: PolicyParams, num_layers: int, num_kv_heads: int) -> RequestState:
        return RequestState(params, num_layers, num_kv_heads)

    def on_tokens(self, state: RequestState, positions: torch.Tensor, token_ids: torch.Tensor,
                  hidden_states: Optional[torch.Tensor]) -> None:
        """Called once per forward pass, after the last layer, for policies
        that need TOKEN_IDS or HIDDEN_STATES: the private tokens the request
        just processed (a prompt chunk, or the one decode token) with their
        positions [T], ids [T] and, with HIDDEN_STATES, the last layer's
        hidden states after the final norm [T, hidden]."""

    def on_forward_tokens(self, requests: list, positions: torch.Tensor, token_ids: torch.Tensor,
                          hidden_states: Optional[torch.Tensor]) -> None:
        """Once per forward pass for all of this policy's observing requests:
        `requests` holds (state, first token, token count) into the forward's
        positions, ids and (with HIDDEN_STATES) hidden states. The default
        hands each request its slices through on_tokens; a policy with many
        requests per batch takes them at once instead."""
        for state, start, n in requests:
            rows = slice(start, start + n)
            self.on_tokens(state, positions[rows], token_ids[rows],
                           hidden_states[rows] if hidden_states is not None else None)

    def observes_tokens(self, state: RequestState) -> bool:
        """Whether on_tokens must see this request's tokens (a per-request
        host call in every forward): by default when the policy needs token
        ids or hidden states."""
        return bool(self.needs & (Need.TOKEN_IDS | Need.HIDDEN_STATES))

    def end_request(self, state: RequestState) -> None:
        """The request ended (finished, aborted or failed)."""

    def usage(self, state: RequestState) -> dict:
        """Entries for the request's kv_usage record, taken as it ends, before
        end_request (host; may read its device counters once)."""
        return {}

    # ----- quantized pages (host) --------------------------------------------
    def quantizes(self, params: PolicyParams) -> bool:
        """Whether the request's generated tokens are quantized in groups
        (radix_ext/tbq_store.py; ThinKV's TBQ). The engine then keeps one
        full-precision page per (layer, head) and asks `group_format` for
        each group's format."""
        return False

    def group_format(self, state: RequestState, first_step: int) -> int:
        """Storage format (kernels.kv_formats id) of the group of decode
        tokens that starts at decode step `first_step`."""
        return 0

    # ----- admission (host) ---------------------------------------------------
    def kept_after_prefill(self, params: PolicyParams, private_prompt: int, budget: int) -> int:
        """Most private prompt tokens one (layer, head) keeps once the prefill
        selection ran (the default: a policy that cuts to its budget)."""
        return min(private_prompt, budget)

    def max_private_tokens(self, params: PolicyParams, private_prompt: int, max_new_tokens: int,
                           budget: int) -> int:
        """Most private tokens one (layer, kv_head) can hold at once: the
        request's compressed ceiling, which admission reserves in the region.

        The default fits a policy that evicts down to `budget` at prefill end
        and after every decode step: the whole private prompt is held until
        prefill ends, and a decode step stores its token before evicting."""
        return min(private_prompt + max_new_tokens, max(private_prompt, budget + 1))

    @classmethod
    def check_budget(cls, params: PolicyParams, budget: Optional[int],
                     budget_ratio: Optional[float]) -> Optional[tuple[str, str]]:
        """Cross-field check of a request's budget against its params:
        None, or (field under kv_policy, message) for a 400."""
        return None

    @classmethod
    def observation_window(cls, params: PolicyParams, private_prompt: int) -> int:
        """Prompt queries (the last ones) whose attention the prefill
        selection reads: the params' `window`, else 32."""
        return getattr(params, "window", 32)

    @classmethod
    def tensor_params(cls) -> list[str]:
        """Names of the numeric parameters passed to decisions as [R] tensors
        (found once per class: batch_params asks every step)."""
        found = cls.__dict__.get("_tensor_params")
        if found is None or found[0] is not cls.Params:
            found = (cls.Params, [name for name, info in cls.Params.model_fields.items()
                                  if info.annotation in (int, float, bool)])
            cls._tensor_params = found
        return found[1]

    @classmethod
    def batch_params(cls, rows: list[PolicyParams], device="cpu") -> tuple[dict, dict]:
        """The rows' numeric parameters as [R] tensors, and each one's largest
        value (PolicyBatch.params and .maxima). Built once per step."""
        params, maxima = {}, {}
        by_dtype: dict = {}  # one transfer per dtype (observations.rows_to_device)
        for name in cls.tensor_params():
            values = [getattr(row, name) for row in rows]
            dtype = torch.float32 if isinstance(values[0], float) else torch.int64
            by_dtype.setdefault(dtype, []).append((name, values))
            maxima[name] = max(values)
        for dtype, named in by_dtype.items():
            for (name, _), tensor in zip(named, rows_to_device([values for _, values in named], dtype, device)):
                params[name] = tensor
        return params, maxima
