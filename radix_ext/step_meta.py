"""Once per step, on the host: the tensors the batched compressed forward
reads in every layer.

The attention backend builds a StepMeta in init_forward_metadata, before the
forward. Everything that needs the host (request lookups, prefix lengths,
budgets, policy parameters, which rows end their prompt) is decided here,
once; the per-layer forward (backend.py) is tensor calls only, with no loop
over rows and no host-device sync.

Rows of a batch split three ways:
* region rows: compressed requests whose private tokens live in the region
  (decode, or an extend of a prompt the policy compresses);
* pool rows: everything else (`full` requests, and the prompt of a
  compressed request whose prompt stays in the radix cache) run SGLang's
  own backend on their subset (`sub_batch`);
* rows of requests being aborted for a full region get zeros.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from kvsieve.kernels import decode_attention
from kvsieve.kernels.kv_formats import FP8, NVFP4
from kvsieve.policies import Need, Policy, PolicyBatch
from kvsieve.policies.base import StepRow
from kvsieve.policies.observations import rows_to_device, to_device

from . import byte_pack, faults, head_parallel, metrics, region_graphs
from .head_pages import plan_head_pages
from .profiling import span
from .runtime import RUNTIME, CompressedRequest

#: Prompt queries whose attention scores the prompt at prefill end when a
#: policy names no window (snapkv's default).
DEFAULT_OBSERVATION_WINDOW = 32

#: The smallest deciding group a policy with Policy.pads_decisions is padded to.
MIN_DECISION_BUCKET = 8


#: The page-table row every padded row reads: SGLang's req_to_token row 0,
#: which it never gives a request (its own graphs pad batches with it). Its
#: page-table row holds only the null page, which has no valid slot.
PAD_POOL_ROW = 0

#: Picks of one class whose gathered parameters are kept (_picked_params):
#: a steady batch repeats a few (deciding, observing, chunks).
MAX_HELD_PICKS = 16

#: Where a step's policy groups are built; StepBuilder._ship then moves them to the device at once.
HOST = "cpu"


def row_bucket(rows: int) -> int:
    """Rows a policy group is padded to when its step may replay captured
    graphs: 1, 2, 4, 8, then multiples of 16 to 256, then of 64 (SGLang's
    decode graphs bucket batch sizes alike). At most 15 rows or 1/4 more
    work; in exchange a request that joins or ends mostly keeps the step's
    shapes."""
    if rows <= 0:
        return 0
    if rows <= 8:
        return 1 << (rows - 1).bit_length()
    step = 16 if rows <= 256 else 64
    return -(-rows // step) * step


#: A decode step's padded row count is a multiple of this (StepBuilder.pad_groups).
ROWS_STEP = 16

#: Where graphs replay, a decode step's page-table width (columns of 16
#: slots) is rounded up to a multiple of this: requests growing towards
#: their budgets change the width every 16 tokens, and every new width is a
#: new set of captures for every segment (region_graphs.py: ~1-2 s for a
#: batch of eight policies on an H100, 65 widths on the way to budget 1024).
#: Every 64 tokens instead, for at most 3 columns of null pages the
#: attention reads past the widest row (4.6% at budget 1024).
WIDTH_STEP = 4
#: Past this many columns (2,048 tokens) widths grow geometrically instead
#: (width_bucket): a row that is never cut (snapkv, or any policy before its
#: budget with a long private prompt) grows by a column every 16 tokens,
#: and under traffic such a row set the width of every step, which
#: restarted every captured graph every 64 tokens.
WIDE_FROM = 128


def width_bucket(columns: int) -> int:
    """Page-table columns a decode step (or a policy group) is padded to
    where graphs replay: multiples of WIDTH_STEP up to WIDE_FROM, then four
    steps per doubling (160, 192, 224, 256, 320, ...: at most a quarter of
    null columns, which the attention kernel skips block by block)."""
    if columns <= WIDE_FROM:
        return max(WIDTH_STEP, -(-columns // WIDTH_STEP) * WIDTH_STEP)
    return _four_per_doubling(columns)


def _four_per_doubling(n: int) -> int:
    """`n` rounded up to the next of four evenly spaced values per power of
    two (past 32: 40, 48, 56, 64, 80, ...): at most a quarter wasted."""
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step


#: Past this many columns (512 tokens) a decode step's own width grows
#: geometrically (step_width_bucket), before its groups' widths do.
STEP_WIDE_FROM = 32


def step_width_bucket(columns: int) -> int:
    """A decode step's page-table width where graphs replay: as
    width_bucket to STEP_WIDE_FROM columns, then four steps per doubling
    (40, 48, 56, 64, 80, 96, ...). Every new step width restarts the
    step's captured attention and decoder stack (~0.2 s at 128 rows on an
    H200), and a row that is never cut (snapkv, a long prompt before its
    budget) widens the step every WIDTH_STEP columns: every 64 tokens,
    against every 128-256 here past 512 tokens. The attention kernel stops
    each row at its own columns, so the null columns cost it nothing; a
    group's pass keeps its own, finer width (width_bucket)."""
    if columns <= STEP_WIDE_FROM:
        return width_bucket(columns)
    return _four_per_doubling(columns)


def observe_bits(policy) -> int:
    """The decode kernel's per-row observation bits (kernels.decode_attention
    row_observe) for a row of `policy`: the region's attention, sparsity and
    |p*v| in the first layer; the same LATER_LAYERS_SHIFT higher in later
    layers (none for a policy that observes the first layer only)."""
    return observe_bits_of(policy.needs, policy.observes_first_layer_only)


def observe_bits_of(needs: Need, first_layer_only: bool = False) -> int:
    """observe_bits of rows whose policy reads `needs`."""
    first = ((OBSERVE_REGION if needs & (Need.ATTENTION | Need.PV_NORM) else 0)
             | (OBSERVE_SPARSITY if needs & Need.SPARSITY else 0) | (OBSERVE_PV if needs & Need.PV_NORM else 0))
    return first | (0 if first_layer_only else first << LATER_LAYERS_SHIFT)


OBSERVE_REGION, OBSERVE_SPARSITY, OBSERVE_PV = (decode_attention.OBSERVE_REGION.value,
                                                decode_attention.OBSERVE_SPARSITY.value, decode_attention.OBSERVE_PV.value)
#: observe_bits' shift for a layer past the first.
LATER_LAYERS_SHIFT = decode_attention.OBSERVE_BITS.value


def prefix_bucket(tokens: int) -> int:
    """Width of the prefix-slot table when rows are padded: the longest
    prefix rounded up to 128 up to 512, then two steps per doubling (768,
    1,024, 1,536, 2,048, 3,072, ...). A pool-only row (`full`) grows its
    prefix every step, and each new width restarts the step's captured
    attention and decoder stack (~0.2 s at 128 rows on an H200): growing
    from 64 to 2,112 tokens it crosses 9 widths, not 17. The decode kernel
    skips the blocks past a row's own prefix. Steps with `full` rows use
    the planned width instead (StepBuilder._decode_prefix_width)."""
    if tokens <= 512:
        return -(-tokens // 128) * 128
    step = 1 << ((tokens - 1).bit_length() - 2)
    return -(-tokens // step) * step


def decision_bucket(due: int, rows: int) -> int:
    """How many of a group's `rows` run select_decode when `due` of them
    are due and the policy pads its decisions: none, all, or the next power
    of two from MIN_DECISION_BUCKET (all of them past `rows`). Requests that
    joined at different steps are due at different steps, `due` changes
    from step to step, and every distinct size is a new set of shapes:
    eager steps and captures instead of graph replays."""
    if due == 0 or due == rows:
        return due
    return min(max(MIN_DECISION_BUCKET, 1 << (due - 1).bit_length()), rows)


#: Bytes of keys one decision may gather at once (KVSIEVE_DECISION_SCRATCH_MB):
#: a policy that reads keys (rkv, skipkv, crystalcache, thinkv) gathers
#: [rows, heads, slots, head_dim] of them, ~1 MB a row at the headline's
#: budget 1024, and computes a few tensors of that order from them; whole
#: 640-row groups asked for 0.7 GB at once inside graph captures and ran an
#: H100 out of memory. Groups are cut into row chunks below this bound, so
#: decision scratch does not grow with the batch (memory_split plans it).
DECISION_SCRATCH_ENV = "KVSIEVE_DECISION_SCRATCH_MB"
DEFAULT_DECISION_SCRATCH_MB = 128


def decision_scratch_bytes() -> int:
    raw = os.environ.get(DECISION_SCRATCH_ENV, str(DEFAULT_DECISION_SCRATCH_MB))
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{DECISION_SCRATCH_ENV}={raw!r}: must be a number of MiB > 0") from None
    if value <= 0:
        raise ValueError(f"{DECISION_SCRATCH_ENV}={raw}: must be > 0 (MiB of keys one decision gathers at once)")
    return int(value * 2**20)


def decision_rows_limit(heads: int, slots: int, head_dim: int, element: int) -> int:
    """Most rows whose keys one decision call gathers: a row_bucket size
    (a whole chunk pads to itself), at least 1."""
    rows = max(1, decision_scratch_bytes() // max(1, heads * slots * head_dim * element))
    if rows >= 16:
        return rows // 16 * 16 if rows <= 256 else rows // 64 * 64
    return 1 << (rows.bit_length() - 1)


def decision_key_slots(policy, inputs: dict, slots: int) -> int:
    """Keys per (row, head) a decision of `policy` gathers over a view of
    `slots`: the view's, or more where the policy says so (thinkv's cuts)."""
    return max(slots, policy.decision_gather_slots(inputs))


def chunk_key_readers(groups: list, limit_of) -> list:
    """Deciding groups of policies that read keys, cut into chunks of at
    most `limit_of(group)` rows (one decision call each; decisions are per
    row)."""
    out = []
    for group in groups:
        n = len(group.members)
        limit = limit_of(group)
        reads_keys = group.policy.needs & (Need.KEYS | Need.LAYER0_KEYS)
        if (group.action != "decide" or not reads_keys or n <= limit or not group.policy.decides_rows_apart
                or not group.splittable()):
            out.append(group)
            continue
        out += [group.subset(list(range(i, min(i + limit, n))), "decide") for i in range(0, n, limit)]
    return out


class RowIndex:
    """A host list of positions as an index of tensors on any device: the
    host tensors of a group being built take it on the host, the device
    inputs of policies on the device (one transfer each)."""

    def __init__(self, positions: list[int]):
        self.positions = positions
        self._on: dict = {}

    def take(self, t: torch.Tensor) -> torch.Tensor:
        index = self._on.get(t.device)
        if index is None:
            index = self._on[t.device] = _long(self.positions, t.device)
        return t[index]


@dataclass
class PolicyGroup:
    """The rows of one policy class in this step: one batched call per layer."""

    policy: Policy
    rows: torch.Tensor  # [Rg] indices into the step's region rows
    budget: torch.Tensor  # [Rg] int64 tokens per (layer, head)
    step: torch.Tensor  # [Rg] int64
    params: dict  # name -> [Rg] tensor
    maxima: dict  # name -> host max
    inputs: dict = field(default_factory=dict)  # Policy.step_inputs of this step
    pool_rows: Optional[torch.Tensor] = None  # [Rg] req_pool rows
    max_rows: int = 0
    members: list = field(default_factory=list)  # host: the rows' indices (as `rows`)
    #: "decide": select_prefill / select_decode; "observe": observe_decode
    #: (decode rows whose decision is not due this step: Policy.deciding_rows).
    action: str = "decide"
    #: Host: the CompressedRequest of each member (None for padded rows), so
    #: a fault in the group's policy code ends exactly these (faults.py).
    requests: list = field(default_factory=list)
    #: Set when its policy code failed in this step (faults.py): later
    #: layers skip it.
    failed: bool = False
    #: Page-table columns of the group's own rows (decode; padded by
    #: width_bucket where graphs replay): its pass reads its rows' slots
    #: through the page table's rows `pool_rows` up to this width, never
    #: through the step's table, so neither its work nor its captured graph
    #: depends on the step's other rows (region_graphs.py).
    width: int = 0
    #: Its tensors' bytes where the step shipped them to the device
    #: (StepBuilder._ship: one uint8 view, byte_pack's layout), or None.
    packed: Optional[torch.Tensor] = None
    #: A stacked pass (layer_blocks.py): the layers its rows repeat over,
    #: layer-major (rows i*Rg..(i+1)*Rg-1 are layer_ids[i]'s); None: one layer.
    layer_ids: Optional[list] = None

    def splittable(self) -> bool:
        """Whether every parameter and input is laid out per row (subset can
        cut the group into row chunks)."""
        n = len(self.members)
        return all(t.dim() > 0 and t.shape[0] == n for t in (*self.params.values(), *self.inputs.values()))

    def input_names(self) -> frozenset:
        """The names of its step inputs (Policy.decide_graph_safe reads them)."""
        return frozenset(self.inputs)

    def subset(self, positions: list[int], action: str) -> "PolicyGroup":
        """The group restricted to its members at `positions` (host list)."""
        take = RowIndex(positions).take
        return PolicyGroup(
            policy=self.policy, rows=take(self.rows), budget=take(self.budget), step=take(self.step),
            params={k: take(v) for k, v in self.params.items()}, maxima=self.maxima,
            inputs={k: take(v) for k, v in self.inputs.items()}, pool_rows=take(self.pool_rows),
            max_rows=self.max_rows, members=[self.members[i] for i in positions], action=action,
            requests=[self.requests[i] for i in positions], width=self.width)

    def host_tensors(self) -> list[tuple[object, str, torch.Tensor]]:
        """(holder, key, tensor) of each of its tensors still on the host
        (StepBuilder builds a step's groups there and ships them at once)."""
        out = [(self, name, getattr(self, name)) for name in ("rows", "budget", "step", "pool_rows")]
        out += [(self.params, k, v) for k, v in self.params.items()]
        out += [(self.inputs, k, v) for k, v in self.inputs.items()]
        return [(holder, key, t) for holder, key, t in out if t is not None and t.device.type == "cpu"]

    def over_layers(self, layer_ids: list) -> "PolicyGroup":
        """The group's rows once per layer of `layer_ids` (consecutive), as
        one group of len(layer_ids) x Rg rows, layer-major (layer_blocks.py).
        Needs every parameter and input laid out per row (splittable)."""
        from .layer_blocks import repeat_rows

        k = len(layer_ids)
        return PolicyGroup(
            policy=self.policy, rows=repeat_rows(self.rows, k), budget=repeat_rows(self.budget, k),
            step=repeat_rows(self.step, k), params={n: repeat_rows(t, k) for n, t in self.params.items()},
            maxima=self.maxima, inputs={n: repeat_rows(t, k) for n, t in self.inputs.items()},
            pool_rows=repeat_rows(self.pool_rows, k), max_rows=self.max_rows, members=self.members * k,
            action=self.action, requests=self.requests, failed=self.failed, width=self.width,
            layer_ids=list(layer_ids))

    def batch(self, layer: int, num_kv_heads: int) -> PolicyBatch:
        per_layer = self.inputs.get("budget")
        if per_layer is not None and per_layer.dim() == 3 and self.layer_ids is not None:
            n = per_layer.shape[0] // len(self.layer_ids)  # each stacked layer's rows take its own budgets
            budget = torch.cat([per_layer[i * n:(i + 1) * n, lid] for i, lid in enumerate(self.layer_ids)])
        elif per_layer is not None and per_layer.dim() == 3:
            budget = per_layer[:, layer]
        else:
            budget = self.budget.unsqueeze(1).expand(-1, num_kv_heads)
        layers = None
        if self.layer_ids is not None:  # consecutive ids (layer_blocks.blocks), each for a run of rows
            first, k = self.layer_ids[0], len(self.layer_ids)
            layers = torch.arange(first, first + k, device=self.step.device).repeat_interleave(
                self.step.shape[0] // k, output_size=self.step.shape[0])
        return PolicyBatch(layer=layer, budget=budget, step=self.step, params=self.params, maxima=self.maxima,
                           inputs=self.inputs, pool_rows=self.pool_rows, max_rows=self.max_rows,
                           heads=head_parallel.SHARDS, layers=layers, layer_ids=self.layer_ids)


@dataclass
class ClassRows:
    """One policy class's rows of a step on the host, before they are cut
    into groups: per row its region row, budget, step and req_pool row
    (host lists), and the class's parameters and step inputs (host tensors,
    one row each)."""

    policy: Policy
    members: list  # region rows
    requests: list  # CompressedRequest of each
    budgets: list
    steps: list
    pool_rows: list
    params: dict
    maxima: dict
    inputs: dict
    #: Whether every parameter and input is laid out per row (PolicyGroup.splittable).
    splittable: bool = True


@dataclass
class GroupDraft:
    """A policy group while the step cuts it (decisions due, key-reading
    chunks) and pads it (StepBuilder.pad_groups): which rows of its class
    it takes, as positions into ClassRows (`picks`; a padded row repeats
    the first row's). Only host lists change here; StepBuilder._materialize
    then makes every draft of the step a PolicyGroup at once (a cut and a
    pad made separately were a gather of every tensor each, dozens a step
    in a mixed batch)."""

    source: ClassRows
    picks: list  # position in `source` of each row
    members: list  # region row of each (padded rows: rows past the step's real ones)
    requests: list  # CompressedRequest of each, None for padded rows
    action: str = "decide"
    width: int = 0

    @property
    def policy(self) -> Policy:
        return self.source.policy

    def splittable(self) -> bool:
        return self.source.splittable

    def input_names(self) -> frozenset:
        """The names of its class's step inputs (Policy.decide_graph_safe)."""
        return frozenset(self.source.inputs)

    def subset(self, positions: list[int], action: str) -> "GroupDraft":
        """The draft restricted to its rows at `positions`."""
        return GroupDraft(source=self.source, picks=[self.picks[i] for i in positions],
                          members=[self.members[i] for i in positions],
                          requests=[self.requests[i] for i in positions], action=action, width=self.width)

    def pad(self, new_rows: list[int]) -> None:
        """Append padded rows (region rows `new_rows`), copies of the first row
        but for their table row (PAD_POOL_ROW) and their request (none)."""
        self.picks = self.picks + [self.picks[0]] * len(new_rows)
        self.members = self.members + list(new_rows)
        self.requests = self.requests + [None] * len(new_rows)


@dataclass
class RegionRows:
    """Region rows of the step, in batch order."""

    requests: list  # CompressedRequest, host side only
    batch_index: torch.Tensor  # [R] rows of the ForwardBatch
    pool_rows: torch.Tensor  # [R] req_pool_idx (page table and req_to_token rows)
    tables: torch.Tensor  # [R, L, H, M] page table of the rows
    prefix_slots: torch.Tensor  # [R, P] token-pool slots of the shared prefix (0: padding)
    prefix_mask: torch.Tensor  # [R, P] True where the row has a prefix token
    prefix_lens: torch.Tensor  # [R] int64 prefix tokens of each row
    #: [R] int32 page-table columns each row holds (0: pool-only and padded
    #: rows); the decode kernel stops each row there, not at the padded width.
    columns: torch.Tensor
    #: [R] int32: which observations each row's own policy reads
    #: (observe_bits; 0: pool-only and padded rows, rows of no group).
    observe: torch.Tensor
    groups: list  # PolicyGroup per policy class present
    needs: Need  # observations any group asked for
    keeps_state: bool  # whether any group updates score / last_hit
    #: The same past the first layer: groups of policies that observe the
    #: first layer only (Policy.observes_first_layer_only) ask for nothing there.
    later_needs: Need = Need.NONE
    later_keeps_state: bool = False
    #: Host: the leading rows that are requests; the rest (StepBuilder.pad_groups)
    #: pad policy groups to row_bucket sizes, read page-table row
    #: PAD_POOL_ROW (null pages only), and their outputs are dropped.
    real: int = 0
    positions: Optional[torch.Tensor] = None  # [R] position of the decode token
    #: Rows whose full-precision group is whole after this step (TBQ:
    #: tbq_store.flush) and the format of each group; None when none.
    flush_rows: Optional[torch.Tensor] = None  # [Rf] indices into the region rows
    flush_format: Optional[torch.Tensor] = None  # [Rf] kernels.kv_formats ids
    #: Decode: the token-pool slot each row's new token goes to (SGLang's
    #: out_cache_loc: the dummy slot 0 for compressed and padded rows, a
    #: real slot for pool rows). A whole-stack replay writes it itself.
    out_slots: Optional[torch.Tensor] = None  # [R]
    #: Decode: rows that are not compressed requests (`full`, no kv_policy)
    #: and run here instead of SGLang's backend (StepBuilder.fold_pool_rows):
    #: their whole KV is their prefix in the token pool, and their page-table
    #: row is PAD_POOL_ROW's (no region slot). Host count.
    pool_only: int = 0
    #: Host: the leading slots of each row whose per-slot observations
    #: (attention, |p*v|) a group reads: its widest observing group's
    #: columns x page_size (a group reads its own columns, a prefix of the
    #: step's). Kept observations (region_graphs.ObservationBuffers) are cut
    #: there, not at the step's width.
    observed_slots: int = 0


@dataclass
class ExtendRows:
    """Token layout of the region rows' prompt chunks (extend only)."""

    token_index: torch.Tensor  # [N] tokens of the batch that go to the region
    token_row: torch.Tensor  # [N] their region row
    token_col: torch.Tensor  # [N] their place in the row's chunk (0..T-1)
    token_slot: torch.Tensor  # [N] the region slot each token takes (sequential in prefill)
    query_pos: torch.Tensor  # [R, T] position of each padded query (-1: padding)
    observe: torch.Tensor  # [R, T] queries whose attention the prefill selection reads
    max_len: int  # T
    ending: torch.Tensor  # [E] region rows whose private prompt ends in this step
    ending_groups: list  # PolicyGroup per policy class, rows indexing `ending`
    #: Host: region rows whose policy needs Need.LAYER0_ATTENTION (layer0_probe.py).
    probe: list = field(default_factory=list)
    ending_rows: list = field(default_factory=list)  # host copy of `ending`


@dataclass
class ProbeRow:
    """A region row of an extend whose first-layer attention is probed."""

    row: int  # region row
    token_start: int  # its first token in the batch
    count: int  # its tokens in this extend
    first: int  # local position (private prompt index) of its first token
    request: CompressedRequest
    budget: int  # its budget this step


@dataclass
class StepMeta:
    region: Optional[RegionRows]
    extend: Optional[ExtendRows]
    pool_batch_index: Optional[torch.Tensor]  # rows running SGLang's backend
    pool_token_index: Optional[torch.Tensor]  # their tokens (extend)
    pool_batch: object  # the ForwardBatch of those rows (a sub-batch, or the whole one)
    zero_batch_index: Optional[torch.Tensor] = None  # rows being aborted (outputs unused)
    zero_token_index: Optional[torch.Tensor] = None
    counters: dict = field(default_factory=dict)


def _long(values, device) -> torch.Tensor:
    return to_device(values, torch.int64, device)


def _padded(t: torch.Tensor, rows: RegionRows) -> torch.Tensor:
    """`t` (one value per real row) with zeros for the step's padded rows."""
    extra = rows.pool_rows.shape[0] - rows.real
    return torch.cat([t, t.new_zeros((extra, *t.shape[1:]))]) if extra else t


def sub_batch(forward_batch, rows: list[int], token_rows: Optional[list[int]], device):
    """A shallow copy of the ForwardBatch restricted to `rows` (and, in an
    extend, their tokens `token_rows`), for SGLang's own backend."""
    fb = copy.copy(forward_batch)
    idx = _long(rows, device)
    fb.batch_size = len(rows)
    fb.req_pool_indices = forward_batch.req_pool_indices[idx]
    fb.seq_lens = forward_batch.seq_lens[idx]
    if forward_batch.seq_lens_cpu is not None:
        fb.seq_lens_cpu = forward_batch.seq_lens_cpu[torch.tensor(rows, dtype=torch.int64)]
        fb.seq_lens_sum = int(fb.seq_lens_cpu.sum())
    fb.rids = [forward_batch.rids[i] for i in rows]
    if forward_batch.forward_mode.is_extend():
        tokens = _long(token_rows, device)
        fb.out_cache_loc = forward_batch.out_cache_loc[tokens]
        fb.positions = forward_batch.positions[tokens]
        fb.extend_seq_lens = forward_batch.extend_seq_lens[idx]
        fb.extend_prefix_lens = forward_batch.extend_prefix_lens[idx]
        fb.extend_seq_lens_cpu = [forward_batch.extend_seq_lens_cpu[i] for i in rows]
        fb.extend_prefix_lens_cpu = [forward_batch.extend_prefix_lens_cpu[i] for i in rows]
        fb.extend_num_tokens = len(token_rows)
        if forward_batch.extend_start_loc is not None:
            starts = torch.cumsum(fb.extend_seq_lens, dim=0) - fb.extend_seq_lens
            fb.extend_start_loc = starts.to(forward_batch.extend_start_loc.dtype)
    else:
        fb.out_cache_loc = forward_batch.out_cache_loc[idx]
        fb.positions = forward_batch.positions[idx]
    return fb


def reads_step_rows(cls: type) -> bool:
    """Whether a policy class reads its rows on the host each step (its own
    step_inputs or deciding_rows); the others get no StepRow list."""
    return cls.step_inputs is not Policy.step_inputs or cls.deciding_rows is not Policy.deciding_rows


class StepBuilder:
    """Builds StepMeta for the kvsieve backend (one per backend)."""

    def __init__(self, pages, req_to_token: torch.Tensor, device, pad_rows: bool = False):
        self.pages = pages
        self.req_to_token = req_to_token
        self.device = device
        #: Pad decode steps' policy groups to row_bucket sizes (set where the
        #: compressed pass replays captured graphs: region_graphs.py).
        self.pad_rows = pad_rows
        #: The padded decode width last used (_decode_width).
        self.held_width = 0
        #: Decode steps with compressed rows take the batch's other rows
        #: (`full`, no kv_policy) into the region pass as pool-only rows
        #: instead of SGLang's backend, so the step can replay the whole
        #: decoder stack (forward_graphs.py; set where those graphs run).
        self.fold_pool_rows = False
        #: The longest `full` row a step folds (memory_plan.fold_max_tokens:
        #: its prefix table is planned at start for this width).
        self.fold_max_tokens = 0
        #: Policy class -> (its rows' params, their batch_params) of its last group (_batch_params).
        self._params_held: dict = {}
        #: Policy class -> (its params, picks -> those params gathered) (_picked_params).
        self._picks_held: dict = {}

    # ----- policy groups ----------------------------------------------------
    def _groups(self, requests: list[CompressedRequest], rows: list[int], steps: list[int],
                budgets: list[int], pool_rows: list[int], prefill: bool) -> list[GroupDraft]:
        """The step's policy groups as drafts: one a class, split by the
        decisions due (_split_by_decision); _materialize makes them groups."""
        by_class: dict[type, list[int]] = {}
        for r in rows:
            by_class.setdefault(type(requests[r].policy), []).append(r)
        groups = []
        for cls, members in by_class.items():
            if not prefill and not cls.acts_during_decode():
                continue  # in no group: its rows store and attend only (Policy.acts_during_decode)
            policy = requests[members[0]].policy
            members_requests = [requests[r] for r in members]
            try:
                # A fault here ends this class's requests; their rows still
                # store and attend this step (outputs unused), in no group.
                with faults.guard("step_inputs", policy.name, members_requests):
                    params, maxima = self._batch_params(cls, [requests[r].params for r in members])
                    # StepRows only for a policy that reads them (hundreds per step).
                    step_rows = [StepRow(requests[r].state, steps[r], pool_rows[r], budgets[r], prefill,
                                         requests[r].private_seen) for r in members] if reads_step_rows(cls) else []
                    with span(f"kvsieve.step_inputs.{policy.name}"):
                        inputs = policy.step_inputs(step_rows, HOST)
                    due = None if prefill or not step_rows else policy.deciding_rows(step_rows)
            except faults.PolicyFault:
                continue
            n = len(members)
            source = ClassRows(
                policy=policy, members=members, requests=members_requests, budgets=[budgets[r] for r in members],
                steps=[steps[r] for r in members], pool_rows=[pool_rows[r] for r in members], params=params,
                maxima=maxima, inputs=inputs,
                splittable=all(t.dim() > 0 and t.shape[0] == n for t in (*params.values(), *inputs.values())))
            whole = GroupDraft(source=source, picks=list(range(n)), members=members, requests=members_requests)
            groups += self._split_by_decision(whole, due)
        return groups

    def _materialize(self, drafts: list[GroupDraft]) -> list[PolicyGroup]:
        """The step's drafts as PolicyGroups (host tensors): every group's
        rows, budgets, steps and table rows from one host tensor; each
        parameter and input gathered once for the rows a group picks (not at
        all where it picks its class's rows in order), parameters reused
        while a class's rows and picks repeat (a steady batch)."""
        lists = []
        for d in drafts:
            src = d.source
            lists += [d.members, [src.budgets[p] for p in d.picks], [src.steps[p] for p in d.picks],
                      [PAD_POOL_ROW if req is None else src.pool_rows[p] for p, req in zip(d.picks, d.requests)]]
        columns = rows_to_device(lists, torch.int64, HOST)
        max_rows = self.req_to_token.shape[0]
        groups = []
        for i, d in enumerate(drafts):
            src = d.source
            rows_t, budget_t, step_t, pool_rows_t = columns[4 * i:4 * i + 4]
            if d.picks == list(range(len(src.members))):  # the class's rows, in order: nothing to gather
                params, inputs = dict(src.params), dict(src.inputs)
            else:
                take = RowIndex(d.picks).take
                params = self._picked_params(src, d.picks, take)
                inputs = {k: take(v) for k, v in src.inputs.items()}
            groups.append(PolicyGroup(
                policy=src.policy, rows=rows_t, budget=budget_t, step=step_t, params=params, maxima=src.maxima,
                inputs=inputs, pool_rows=pool_rows_t, max_rows=max_rows, members=d.members, action=d.action,
                requests=d.requests, width=d.width))
        return groups

    def _picked_params(self, source: ClassRows, picks: list[int], take) -> dict:
        """source.params gathered at `picks`, reused while the class's
        parameter tensors are the same objects (_batch_params keeps them
        while its rows are) and the picks repeat. Fresh dicts each time, as
        their holders replace entries (_ship)."""
        held = self._picks_held.get(type(source.policy))
        key = tuple(picks)
        if held is None or any(held[0].get(k) is not v for k, v in source.params.items()):
            held = self._picks_held[type(source.policy)] = (source.params, {})
        picked = held[1].get(key)
        if picked is None:
            if len(held[1]) >= MAX_HELD_PICKS:
                held[1].clear()
            picked = held[1][key] = {k: take(v) for k, v in source.params.items()}
        return dict(picked)

    def _batch_params(self, cls: type, rows: list) -> tuple[dict, dict]:
        """cls.batch_params of `rows` on the host, reused while a class's
        rows are the very parameter objects of its last step (PolicyParams
        are frozen): in a steady batch, every step but the first. Fresh
        dicts each time, as their holders replace entries (_ship)."""
        held = self._params_held.get(cls)
        if held is None or len(held[0]) != len(rows) or any(a is not b for a, b in zip(held[0], rows)):
            held = self._params_held[cls] = (rows, *cls.batch_params(rows, HOST))
        return dict(held[1]), dict(held[2])

    @staticmethod
    def _split_by_decision(group: PolicyGroup, due: Optional[list[bool]]) -> list[PolicyGroup]:
        """The group as it decides in this step: whole, or split into the
        rows whose decision is due and the rows that only observe (nothing
        for those when the policy observes nothing between decisions)."""
        if due is None or all(due):
            return [group]
        deciding = [i for i, d in enumerate(due) if d]
        observing = [i for i, d in enumerate(due) if not d]
        if group.policy.pads_decisions and deciding:
            # Rows not due decide too (their select_decode only observes),
            # the first ones in row order, up to the bucket.
            extra = decision_bucket(len(deciding), len(due)) - len(deciding)
            if extra == len(observing):
                return [group]
            deciding = sorted(deciding + observing[:extra])
            observing = observing[extra:]
        split = [group.subset(deciding, "decide")] if deciding else []
        if type(group.policy).observe_decode is not Policy.observe_decode:
            split.append(group.subset(observing, "observe"))
        return split

    def _decode_prefix_width(self, longest: int, pool_only: bool) -> int:
        """The prefix table's width in a decode step whose graphs replay.
        With pool-only (`full`) rows it is the planned width
        (memory_plan.fold_max_tokens), whatever their length: they grow a
        token a step, and a bucketed width restarted the captured attention
        segment and decoder stack at each bucket (4 of the 6 segment
        captures of a 575-step ten-policy batch on an H200, 2026-12-01).
        Beside a long prefix the decode kernel skips a short row's splits
        and observation blocks between its prefix and the region
        (kernels/decode_attention._dead_split): a replayed step of that
        batch took 10.76 ms at this width against 10.49 ms bucketed (12.8
        ms before the kernel skipped them). Without pool-only rows the
        prefixes are prompts, fixed while a row decodes: bucketed. Never
        wider than the planned tables by the bucket alone."""
        pool_width = self.req_to_token.shape[1]
        if not self.fold_max_tokens:
            return min(prefix_bucket(longest), pool_width)
        planned = max(longest, self.fold_max_tokens)
        if pool_only:
            return min(planned, pool_width)
        return min(prefix_bucket(longest), planned, pool_width)

    def _region_rows(self, requests, batch_rows, pool_rows, prefix_lens, steps, budgets, prefill,
                     slot_rows: Optional[torch.Tensor] = None, pad: bool = False) -> RegionRows:
        """The region rows of a step. A None in `requests` is a pool-only row
        (fold_pool_rows): in no group, its table row pool_rows[r] is
        PAD_POOL_ROW, and its prefix comes from its req_to_token row in
        `slot_rows` (the batch's req_pool_indices, on the device). `pad`:
        groups padded to row_bucket sizes and the step's rows after them
        (pad_groups), on the host lists, before any of them is a tensor."""
        dev = self.device
        real = len(requests)
        compressed = [r for r, req in enumerate(requests) if req is not None]
        # Each row's own columns (0: pool-only or no pages); the step's width covers the widest.
        columns = self.pages.columns_of_each([None if req is None else req.rid for req in requests])
        width = max(columns, default=0) or 1
        if self.pad_rows and not prefill:
            width = self._decode_width(width)
            self.pages.ensure_width(width)
        P = max(prefix_lens)
        if self.pad_rows and not prefill:
            P = self._decode_prefix_width(P, pool_only=len(compressed) < real)
        groups = self._groups(requests, compressed, steps, budgets, pool_rows, prefill)
        for group in groups:
            group.width = width if prefill else self._group_width(group, width)
        page, dim, element = self.pages.config.page_size, self.pages.config.head_dim, self.pages.k.element_size()
        heads = self.pages.table.shape[2]
        groups = chunk_key_readers(groups, lambda g: decision_rows_limit(
            heads, decision_key_slots(g.policy, g.source.inputs, g.width * page), dim, element))
        needs = later_needs = Need.NONE
        observed = 0
        observe = [0] * real
        for g in groups:
            bits = observe_bits(g.policy)
            for r in g.members:
                observe[r] |= bits
            needs |= g.policy.needs
            if not g.policy.observes_first_layer_only:
                later_needs |= g.policy.needs
            if g.policy.needs & (Need.ATTENTION | Need.PV_NORM):
                observed = max(observed, g.width)
        extra = self.pad_groups(groups, real) if pad else 0
        groups = self._materialize(groups)
        if extra:
            # Padded rows: batch row 0 (their q/k/v are read, not used), the
            # null pages' table row, no prefix, no columns, no observations.
            batch_rows, pool_rows = list(batch_rows) + [0] * extra, list(pool_rows) + [PAD_POOL_ROW] * extra
            prefix_lens = list(prefix_lens) + [0] * extra
            columns, observe = columns + [0] * extra, observe + [0] * extra
            if slot_rows is not None:
                slot_rows = torch.cat([slot_rows, slot_rows.new_full((extra,), PAD_POOL_ROW)])
        # The rows' host lists in two transfers (one per dtype), not one each.
        batch_index, pool_rows_t, prefix_lens_t = rows_to_device([batch_rows, pool_rows, prefix_lens], torch.int64, dev)
        columns_t, observe_t = rows_to_device([columns, observe], torch.int32, dev)
        tables = self.pages.table[pool_rows_t, :, :, :width]
        if P:
            cols = torch.arange(P, device=dev)
            prefix_mask = cols.unsqueeze(0) < prefix_lens_t.unsqueeze(1)
            prefix_slots = torch.where(prefix_mask, self.req_to_token[pool_rows_t if slot_rows is None else slot_rows,
                                                                      :P].long(),
                                       torch.zeros((), dtype=torch.int64, device=dev))
        else:
            prefix_mask = torch.zeros((real + extra, 0), dtype=torch.bool, device=dev)
            prefix_slots = torch.zeros((real + extra, 0), dtype=torch.int64, device=dev)
        return RegionRows(
            requests=requests, batch_index=batch_index, pool_rows=pool_rows_t, tables=tables,
            prefix_slots=prefix_slots, prefix_mask=prefix_mask, prefix_lens=prefix_lens_t,
            columns=columns_t, observe=observe_t, groups=groups,
            needs=needs, keeps_state=any(g.policy.keeps_slot_state for g in groups), later_needs=later_needs,
            later_keeps_state=any(g.policy.keeps_slot_state and not g.policy.observes_first_layer_only
                                  for g in groups), real=real, pool_only=real - len(compressed),
            observed_slots=observed * page)

    def _decode_width(self, columns: int) -> int:
        """The decode step's padded width (step_width_bucket), kept while the
        widest rows narrow by less than half: a wide row that ends then
        does not restart every captured graph (region_graphs.reset)."""
        width = step_width_bucket(columns)
        if width < self.held_width < 2 * width:
            return self.held_width
        self.held_width = width
        return width

    def _group_width(self, group: PolicyGroup, step_width: int) -> int:
        """Columns a decode group's pass reads: its own rows' widest (padded
        alike where graphs replay), not the step's. A policy's decision
        gathers keys over these, so a wide row of another policy in the
        batch (snapkv, `full`-like growth) must not widen every group's
        work, nor change its graphs' shapes."""
        columns = self.pages.width_of([r.rid for r in group.requests])
        return min(step_width, width_bucket(columns)) if self.pad_rows else columns

    def pad_groups(self, groups: list, real: int) -> int:
        """Pad the policy groups (drafts) of a decode step to row_bucket rows, so that
        requests joining and ending keep the step's shapes (and its captured
        graphs). Padded rows come after the real ones, copy their group's
        first row's budget, step, parameters and inputs, and read page-table
        row PAD_POOL_ROW: no prefix, no valid slot; the store writes nothing
        valid there (backend: the null page), a decision finds nothing to
        evict, and their outputs are never copied out. Only groups that may
        be captured (region_graphs.capturable) and whose inputs are laid out
        per row are padded.

        A policy whose rows split into deciding and observing groups is
        padded to row_bucket of all its rows together (its last group takes
        what the others leave), so the step's row count, which keys the
        attention's graphs, does not change with how many rows decide.

        The step's rows after its `real` ones: how many it grows by (the
        caller pads its own row lists)."""
        padded = [g for g in groups if region_graphs.capturable(g) and g.splittable()]
        by_class: dict[type, list] = {}
        for group in padded:
            by_class.setdefault(type(group.policy), []).append(group)
        pads_of: dict[int, int] = {}
        for groups in by_class.values():
            *first, last = groups
            for group in first:  # each to its own bucket
                pads_of[id(group)] = row_bucket(len(group.members)) - len(group.members)
            # The last fills the class up to the bucket of all its rows.
            room = row_bucket(sum(len(g.members) for g in groups)) - sum(row_bucket(len(g.members)) for g in first)
            n = len(last.members)
            pads_of[id(last)] = room - n if room >= n else row_bucket(n) - n
        # Padded rows are all alike (no request, null pages, outputs
        # dropped), so policy classes share them: the step grows by the most
        # one class needs, not by their sum (ten classes of 13 rows: 128 + 4
        # rows, not 128 + 32, for the whole decoder stack). Groups of one
        # class take distinct ones, as a class's rows are padded together.
        extra, used = 0, {}
        for group in padded:
            pads = pads_of[id(group)]
            if not pads:
                continue
            start = used.get(type(group.policy), 0)
            used[type(group.policy)] = start + pads
            extra = max(extra, start + pads)
            group.pad(list(range(real + start, real + start + pads)))
        # Rows of no group up to a multiple of ROWS_STEP: a group that is
        # not padded (one that runs eagerly) then does not change the row
        # count that keys the attention's graphs.
        extra += -(real + extra) % ROWS_STEP
        if extra:
            metrics.record_padded_rows(extra)
        return extra

    # ----- the step ---------------------------------------------------------
    def build(self, forward_batch) -> Optional[StepMeta]:
        """None when no row of the batch is a compressed request in the region."""
        if not RUNTIME.requests or forward_batch.forward_mode.is_idle():
            return None
        rids = forward_batch.rids
        if rids is None:
            return None
        if forward_batch.forward_mode.is_decode():
            meta = self._build_decode(forward_batch)
        elif forward_batch.forward_mode.is_extend():
            meta = self._build_extend(forward_batch)
        else:
            return None
        if meta is not None:
            self._ship(meta)
        return meta

    def _ship(self, meta: StepMeta) -> None:
        """The step's groups are built on the host (their rows, budgets,
        steps, parameters and inputs, split and padded there): all of them
        go to the device now in one transfer (byte_pack), not a copy or a
        kernel per tensor (hundreds a step in a mixed batch). A group keeps
        the bytes it came in (`packed`): a replayed segment's static copy
        is refilled from them in one copy (region_graphs)."""
        groups = list(meta.region.groups) if meta.region is not None else []
        if meta.extend is not None:
            groups += meta.extend.ending_groups
        whole = [g for g in groups if all(t.device.type == "cpu" for t in region_graphs.group_tensors(g))]
        # A policy input made on the device (none of ours): the group's host tensors go alone.
        partial = [g for g in groups if not any(g is w for w in whole)]
        held = [entry for g in partial for entry in g.host_tensors()]
        lists = [region_graphs.group_tensors(g) for g in whole] + [[t] for _, _, t in held]
        shipped = byte_pack.to_device(lists, self.device)
        for group, (tensors, flat) in zip(whole, shipped):
            region_graphs.set_group_tensors(group, tensors)
            group.packed = flat
        for (holder, key, _), ([moved], _) in zip(held, shipped[len(whole):]):
            if isinstance(holder, dict):
                holder[key] = moved
            else:
                setattr(holder, key, moved)

    def _build_decode(self, fb) -> Optional[StepMeta]:
        # Per-row Python runs for every row of every step (hundreds of rows):
        # one pass per loop, locals bound once, no call where none is needed.
        live = RUNTIME.requests
        region, pool, zero, requests = [], [], [], []
        for i, rid in enumerate(fb.rids):
            req = live.get(rid)
            if req is None:
                pool.append(i)
            elif req.overflowed:
                zero.append(i)
            elif req.prefix_len < 0:
                # Its prefill never ran through this backend: the shared
                # prefix it would read is unknown. End it with an error (not
                # silent zeros); the rest of the batch runs on.
                RUNTIME.fail(req, "kvsieve: compressed request decodes before its prefill was seen "
                                  "(unknown shared prefix)")
                zero.append(i)
            else:
                region.append(i)
                requests.append(req)
        if not region and not zero:
            return None
        seq_lens = fb.seq_lens_cpu.tolist()
        pool_rows = self._pool_rows(fb, requests, region)
        steps, budgets = [], []
        row_of = self.pages.row_of
        plans: dict[type, bool] = {}  # policy class -> has per-head budgets (head_pages.py)
        for req, i, pool_row in zip(requests, region, pool_rows):
            if row_of(req.rid) != pool_row:
                self._bind(req, pool_row)
            step = seq_lens[i] - 1 - req.prompt_len
            req.private_seen += 1  # this step's token, counted before the budget (budget_ratio)
            budget = req.budget_tokens(req.private_seen)
            steps.append(step)
            budgets.append(budget)
            cls = type(req.policy)
            plans_heads = plans.get(cls)
            if plans_heads is None:
                plans_heads = plans[cls] = getattr(cls, "realloc_head_budgets", None) is not None
            if plans_heads:
                try:
                    with faults.guard("budgets", req.policy.name, [req]):
                        plan_head_pages(self.pages, req, step, pool_row, budget)  # adaptive budgets
                except faults.PolicyFault:
                    pass  # the request ends; its pages stay as they were until it does
        self.pages.flush()
        rows = None
        if (region and pool and not zero and self.fold_pool_rows
                and max(seq_lens[i] for i in pool) <= self.fold_max_tokens):
            rows = self._folded_rows(fb, seq_lens, requests, region, pool_rows, steps, budgets)
            pool = []
        elif region:
            rows = self._region_rows(requests, region, pool_rows, [r.prefix_len for r in requests], steps, budgets,
                                     prefill=False, pad=self.pad_rows)
            self._flushes(rows, requests, steps)
        if rows is not None:
            index = rows.batch_index[:rows.real]
            rows.positions = _padded(fb.positions[index], rows)
            rows.out_slots = _padded(fb.out_cache_loc[index].long(), rows)  # padded rows: SGLang's dummy slot 0
        return self._meta(fb, rows, None, pool, zero, pool_tokens=None, zero_tokens=None)

    def _folded_rows(self, fb, seq_lens, requests, region, pool_rows, steps, budgets) -> RegionRows:
        """Every row of the batch as a region row, in batch order (a
        whole-stack replay reads row r of the batch as region row r): the
        compressed ones as always, the others pool-only (fold_pool_rows),
        whose prefix is every token they hold, this step's included
        (SGLang wrote its slot into req_to_token before the forward; the
        pass stores its K/V there, at out_slots, before attending)."""
        batch = len(fb.rids)
        by_row = [None] * batch
        table_rows, prefix_lens = [PAD_POOL_ROW] * batch, list(seq_lens)
        all_steps, all_budgets = [0] * batch, [0] * batch
        for req, i, pool_row, step, budget in zip(requests, region, pool_rows, steps, budgets):
            by_row[i], table_rows[i], prefix_lens[i] = req, pool_row, req.prefix_len
            all_steps[i], all_budgets[i] = step, budget
        rows = self._region_rows(by_row, list(range(batch)), table_rows, prefix_lens, all_steps, all_budgets,
                                 prefill=False, slot_rows=fb.req_pool_indices.long(), pad=self.pad_rows)
        self._flushes(rows, by_row, all_steps)
        metrics.record_pool_only_rows(rows.pool_only)
        return rows

    def _flushes(self, rows: RegionRows, requests: list, steps: list[int]) -> None:
        """TBQ rows whose group of `page_size` decode tokens is whole after
        this step, and each group's format (asked after step_inputs, which
        types the segments)."""
        size = self.pages.config.page_size
        due = []
        for r, (req, step) in enumerate(zip(requests, steps)):
            if req is not None and req.tbq and (step + 1) % size == 0 and not req.overflowed:
                try:
                    with faults.guard("tbq_format", req.policy.name, [req]):
                        due.append((r, req.policy.group_format(req.state, step + 1 - size)))
                except faults.PolicyFault:
                    pass  # no flush for a request that is ending
        if due:
            top = FP8 if self.pages.config.quant_bits >= 8 else NVFP4  # the widest format a page row holds
            rows.flush_rows = _long([r for r, _ in due], self.device)
            rows.flush_format = _long([min(f, top) for _, f in due], self.device)

    def _build_extend(self, fb) -> Optional[StepMeta]:
        region, pool, zero = [], [], []
        for i, rid in enumerate(fb.rids):
            req = RUNTIME.requests.get(rid)
            if req is None:
                pool.append(i)
            elif req.overflowed:
                zero.append(i)
            elif not req.spec.prompt_compressed:
                # Its prompt stays in the radix cache: SGLang's path, in full.
                pool.append(i)
                if req.radix_hit < 0:
                    req.radix_hit = fb.extend_prefix_lens_cpu[i]
                if fb.extend_prefix_lens_cpu[i] + fb.extend_seq_lens_cpu[i] >= req.prompt_len:
                    # From its first decode step on, the prompt is its shared prefix.
                    self._begin(req, req.prompt_len)
            else:
                region.append(i)
        if not region and not zero:
            return None
        starts = [0]
        for n in fb.extend_seq_lens_cpu:
            starts.append(starts[-1] + n)
        requests = [RUNTIME.requests[fb.rids[i]] for i in region]
        pool_rows = self._pool_rows(fb, requests, region)
        token_index, token_row, token_col, token_slot = [], [], [], []
        lengths, query_starts, ending, budgets, windows, probe = [], [], [], [], [], []
        for r, (req, i) in enumerate(zip(requests, region)):
            prefix, n = fb.extend_prefix_lens_cpu[i], fb.extend_seq_lens_cpu[i]
            if req.prefix_len < 0:
                req.radix_hit = prefix
                self._begin(req, prefix)
            self._bind(req, pool_rows[r])
            first_slot = prefix - req.prefix_len  # earlier chunks' private tokens
            token_index.extend(range(starts[i], starts[i] + n))
            token_row.extend([r] * n)
            token_col.extend(range(n))
            token_slot.extend(range(first_slot, first_slot + n))
            lengths.append(n)
            query_starts.append(prefix)
            req.private_seen = first_slot + n
            if prefix + n >= req.prompt_len:
                ending.append(r)
            # The budget counts every private token of the prompt, the last chunk's too.
            budgets.append(req.budget_tokens(req.private_seen))
            windows.append(type(req.policy).observation_window(req.params, req.prompt_len - req.prefix_len))
            if req.policy.needs & Need.LAYER0_ATTENTION:
                probe.append(ProbeRow(row=r, token_start=starts[i], count=n, first=first_slot, request=req,
                                      budget=budgets[-1]))
        self.pages.flush()
        dev = self.device
        rows = self._region_rows(requests, region, pool_rows, [r.prefix_len for r in requests],
                                 [0] * len(requests), budgets, prefill=True)
        T = max(lengths)
        col = torch.arange(T, device=dev).unsqueeze(0)
        lengths_t = _long(lengths, dev).unsqueeze(1)
        query_pos = torch.where(col < lengths_t, _long(query_starts, dev).unsqueeze(1) + col,
                                torch.full((), -1, dtype=torch.int64, device=dev))
        prompt_lens = _long([r.prompt_len for r in requests], dev).unsqueeze(1)
        observe = (query_pos >= prompt_lens - _long(windows, dev).unsqueeze(1)) & (query_pos >= 0)
        # Groups over the rows that end their prompt, indexed within `ending`
        # (built from host lists: no read back from the device).
        ending_groups = self._materialize(self._groups([requests[r] for r in ending], list(range(len(ending))),
                                                       [0] * len(ending), [budgets[r] for r in ending],
                                                       [pool_rows[r] for r in ending], prefill=True))
        extend = ExtendRows(
            token_index=_long(token_index, dev), token_row=_long(token_row, dev), token_col=_long(token_col, dev),
            token_slot=_long(token_slot, dev), query_pos=query_pos, observe=observe, max_len=T,
            ending=_long(ending, dev), ending_groups=ending_groups, probe=probe, ending_rows=ending)
        pool_tokens = [t for i in pool for t in range(starts[i], starts[i + 1])]
        zero_tokens = [t for i in zero for t in range(starts[i], starts[i + 1])]
        return self._meta(fb, rows, extend, pool, zero, pool_tokens, zero_tokens)

    def _meta(self, fb, rows, extend, pool, zero, pool_tokens, zero_tokens) -> StepMeta:
        dev = self.device
        meta = StepMeta(region=rows, extend=extend, pool_batch_index=None, pool_token_index=None, pool_batch=None)
        if pool:
            meta.pool_batch_index = _long(pool, dev)
            meta.pool_token_index = _long(pool_tokens, dev) if pool_tokens is not None else meta.pool_batch_index
            meta.pool_batch = sub_batch(fb, pool, pool_tokens, dev)
        if zero:
            meta.zero_batch_index = _long(zero, dev)
            meta.zero_token_index = _long(zero_tokens, dev) if zero_tokens is not None else meta.zero_batch_index
        return meta

    @staticmethod
    def _pool_rows(fb, requests, region) -> list[int]:
        """req_pool_idx of the rows, from SGLang's Req on the host (the
        ForwardBatch has them only on the device)."""
        rows = [getattr(r.sgl_req, "req_pool_idx", None) for r in requests]
        if any(row is None for row in rows):
            rows = [int(x) for x in fb.req_pool_indices.cpu()[torch.tensor(region)].tolist()]
        return rows

    # ----- request transitions (host, in forward order) ----------------------
    def _begin(self, req: CompressedRequest, prefix_len: int) -> None:
        if req.prefix_len < 0:
            RUNTIME.begin(req, prefix_len)

    def _bind(self, req: CompressedRequest, pool_row: int) -> None:
        if self.pages.row_of(req.rid) != pool_row:
            self.pages.bind(req.rid, pool_row)
            RUNTIME.reset_counters(pool_row)
