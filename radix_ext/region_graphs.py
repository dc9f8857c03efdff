"""CUDA graphs of the compressed decode pass, per layer and in segments.

Without graphs the per-layer pass is launch-bound: ~100 small kernels per
layer (store, gathers, the policies' tensor ops, write-back), each a few
microseconds of GPU work behind tens of microseconds of Python. In steady
decode the shapes of a step stay the same for many steps, so the pass is
captured once per layer and replayed: before the forward the step's
metadata is copied into captured (static) tensors, once per step, and each
layer copies its q/k/v rows in and its output rows out around the replays.

The pass is captured in segments, so that a batch mixing policies replays
whatever its composition:
* the attention segment (store the new token, attend, observations) of all
  the step's region rows, keyed by the step's row count, page-table width
  and prefix width (an `_Entry`); its observations go to static buffers of
  RegionGraphs (`ObservationBuffers`) whose rows' addresses do not depend on
  the row count;
* one segment per policy group (decide or observe, then write back), keyed
  by the group's own shapes only (a `_GroupEntry`): it reads its rows' slots
  through its own copy of their page-table rows and its rows of the static
  observations, never the rest of the step.
A step whose whole composition (attention and every group) was captured
also replays the whole decoder stack (forward_graphs.py).

In a single-policy batch the groups change little; in a mixed one each
policy's rows reach their decisions at their own steps, so the set of groups
changes nearly every step (bench/graph_buckets.py: 53 distinct whole-step
shapes in 200 steps of eight policies at 640 rows, 2.5% of steps replayed
when a step was captured whole) while each group's own shapes recur.

A segment is captured the first time its key shows up (first_sight; with
KVSIEVE_CAPTURE_FIRST_SIGHT=0 the second time among the recent keys, the
first sight running eagerly): that step runs the segment eagerly for real
on the static tensors, then captures it (capture records, it does not
execute), so no step is applied twice. Decode steps' policy
groups are padded to bucketed row counts (step_meta.row_bucket,
StepBuilder.pad_groups), so requests joining and ending mostly keep the shapes.
Only policies marked `graph_safe` are captured (and the observing rows of
those marked `observe_graph_safe`, and the deciding rows of a step whose
inputs the policy's `decide_graph_safe` accepts: CrystalCache's keep step,
not its snapshot step): their decisions are tensor functions of
(batch, view, obs) whose host-side inputs (shapes, parameter maxima) are
part of the key; other groups run eagerly between the replayed segments.
Under tensor parallelism a group with a collective (a policy that
`crosses_heads`) runs eagerly; the others replay on every rank.
SGLang's own graphs keep running batches without compressed rows
(plugin.graphs_skip_compressed_batches).
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from kvsieve.env_flags import flag

from . import byte_pack, faults, head_parallel, metrics

logger = logging.getLogger(__name__)

#: Attention segments kept captured at once (a graph per layer, static
#: metadata: about 40 MB at 640 rows of R1-Distill-Qwen-7B, the page table
#: being most of it); the least recently used goes. 8: thinkv's cut steps
#: under traffic take turns among more shapes than 4 (bench/graph_buckets.py:
#: 73% of steps replayed at 64 rows, 42% with 4).
MAX_SHAPES = int(os.environ.get("KVSIEVE_REGION_GRAPH_SHAPES", "8"))
#: Group segments kept captured at once (a graph per layer and the group's
#: static metadata, its page-table rows most of it: ~60 KB a row): ten
#: policies, each deciding, observing and in a few bucketed sizes.
MAX_GROUP_SHAPES = int(os.environ.get("KVSIEVE_REGION_GROUP_SHAPES", "64"))
#: Whole compositions (attention + groups) whose decoder stack is kept captured.
MAX_COMPOSITIONS = 8
#: Keys seen lately (a key is captured when it comes back): steps for the
#: attention segment, groups for group segments.
RECENT_KEYS = 16
RECENT_GROUP_KEYS = 256
#: A composition's decoder stack is captured once it made COMPOSITION_REPEATS
#: of the last COMPOSITION_WINDOW steps: in a mixed batch most compositions
#: come and go (a capture of the stack costs about as much as tens of
#: steps' launches), the ones that recur pay it back.
COMPOSITION_WINDOW = 64
COMPOSITION_REPEATS = 3
#: _GroupEntry.graphs' key of the graph that runs every layer's pass of a group.
ALL_LAYERS = "all"


def defer_enabled() -> bool:
    """KVSIEVE_DEFER_GROUPS: "1" (default) runs the policy groups' passes
    after the decoder stack where whole-stack graphs exist (RegionGraphs.
    defer_groups); "0" keeps them inside each layer."""
    return flag("KVSIEVE_DEFER_GROUPS")


def eager_defer_enabled() -> bool:
    """KVSIEVE_EAGER_DEFER: "1" (default) lets a step of new shapes (no
    graph entry: it runs eagerly) defer its groups too, where groups are
    deferred at all (defer_enabled); "0" runs them inside each layer."""
    return flag("KVSIEVE_EAGER_DEFER")


def mode() -> str:
    """KVSIEVE_REGION_GRAPHS: "1" (default: CUDA graphs on a GPU), "0" (off),
    or "rerun": on any device, a "graph" whose replay runs the captured
    function again on the same static tensors. A replay executes exactly
    that, so "rerun" puts the host side of the graphs (entries, static
    metadata, the forward graphs' routing) under test on CPU."""
    value = os.environ.get("KVSIEVE_REGION_GRAPHS", "1")
    if value not in ("0", "1", "rerun"):
        raise ValueError(f"KVSIEVE_REGION_GRAPHS must be 0, 1 or rerun, not {value!r}")
    return value


def first_sight_enabled() -> bool:
    """KVSIEVE_CAPTURE_FIRST_SIGHT: "1" (default) captures an attention or
    group segment the first time its shapes show up; "0" runs a shape's
    first sighting eagerly and captures it when it comes back. Under traffic
    most new shapes came back (bench/capture_churn.py: 70 of 93 on an H200),
    so the eager step was paid on top of the capture."""
    return flag("KVSIEVE_CAPTURE_FIRST_SIGHT")


def buckets_enabled() -> bool:
    """KVSIEVE_GRAPH_BUCKETS: "1" (default) pads decode steps' policy groups
    to bucketed row counts (step_meta.row_bucket) where graphs replay; "0"
    keys graphs by exact row counts."""
    return flag("KVSIEVE_GRAPH_BUCKETS")


def enabled(device) -> bool:
    return mode() == "rerun" or (mode() == "1" and torch.device(device).type == "cuda")


class Rerun:
    """A recorded pass that replays by running again (KVSIEVE_REGION_GRAPHS=rerun)."""

    def __init__(self, fn):
        self.replay = fn


def step_tensors(step) -> list[torch.Tensor]:
    """The step metadata the attention segment reads, in a fixed order (not
    batch_index: the captured pass reads its rows from static inputs in
    order)."""
    rows = step.region
    return [rows.pool_rows, rows.tables, rows.prefix_slots, rows.prefix_mask, rows.prefix_lens, rows.columns,
            rows.observe, rows.positions, rows.out_slots]


def group_tensors(group) -> list[torch.Tensor]:
    """The metadata a group segment reads, in a fixed order."""
    out = [group.rows, group.budget, group.step, group.pool_rows]
    out += [group.params[k] for k in sorted(group.params)]
    out += [group.inputs[k] for k in sorted(group.inputs)]
    return out


def set_group_tensors(group, tensors: list) -> None:
    """The inverse of group_tensors: give `group` these tensors (same order)."""
    group.rows, group.budget, group.step, group.pool_rows = tensors[:4]
    params = tensors[4:4 + len(group.params)]
    inputs = tensors[4 + len(group.params):]
    group.params = dict(zip(sorted(group.params), params))
    group.inputs = dict(zip(sorted(group.inputs), inputs))


def capturable(group) -> bool:
    """Whether a policy group's per-layer pass may run inside a captured
    graph. Under tensor parallelism not a pass with a collective (its
    policy crosses_heads): NCCL calls inside these graphs are not captured
    or checked; the per-head policies' passes make none."""
    policy = group.policy
    if policy.crosses_heads and head_parallel.SHARDS.size > 1:
        return False
    if group.action == "observe":
        return policy.graph_safe or policy.observe_graph_safe
    return policy.decide_graph_safe(group.input_names())


def _shapes(tensors) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def signature(step, needs_keys: bool) -> Optional[tuple]:
    """The key of a decode step's attention segment, or None when the step
    runs eagerly (rows being aborted)."""
    rows = step.region
    if rows is None or step.zero_batch_index is not None:
        return None
    return (_shapes(step_tensors(step)), rows.needs, rows.later_needs, needs_keys, rows.observed_slots)


def group_signature(group) -> Optional[tuple]:
    """The key of a policy group's segment (its own shapes and host-side
    inputs only), or None when it runs eagerly."""
    if not capturable(group):
        return None
    return (type(group.policy).__qualname__, group.action, group.width, tuple(sorted(group.maxima.items())),
            tuple(sorted(group.params)), tuple(sorted(group.inputs)), _shapes(group_tensors(group)))


def observation_shape(obs) -> Optional[tuple]:
    """The shape of the observation views a pass reads (None: it reads
    none). Their rows follow the step's row count and their slots the
    step's observed columns (ObservationBuffers.view), not the group's own
    shapes, so a group segment's graphs are kept per shape: a graph replays
    the views it recorded, and a step with more rows puts a group's rows
    past them (the rate-12 crash: an out-of-bounds gather in a replayed
    group graph)."""
    if obs is None:
        return None
    for t in (obs.attention, obs.pv_norm, obs.sparsity):
        if t is not None:
            return tuple(t.shape)
    return None


def deferred_rows(rows: int) -> int:
    """Rows of a layer's own observation buffers (deferred groups): a
    multiple of 64 (the step's rows are padded to 16; the buffer grows by
    doubling, so a few rows more do not reallocate it every time)."""
    return max(64, -(-rows // 64) * 64)


class ObservationBuffers:
    """Static homes of the attention segment's observations, read by every
    group segment: per kind, a view [rows, ...] of one flat buffer whose row
    count is rounded up from the step's (a power of two; deferred_rows where
    groups run after the stack), its rows past the step's holding stale
    values no group reads. The view's rows still change with the step's, so
    a group segment keeps a graph per view shape (observation_shape). When a
    larger view than the buffer holds is needed the buffer grows and
    `generation` changes: every captured segment that wrote or read the old
    one is recaptured."""

    def __init__(self, num_layers: Optional[int] = None):
        self.flat: dict[tuple, torch.Tensor] = {}
        self.generation = 0
        #: The model's layers (set by the backend): the per-layer views of a
        #: kind are then layer-major blocks of ONE buffer, so a group's
        #: stacked pass gathers a block of layers in one index
        #: (layer_blocks.observed_block) instead of one per layer and a cat.
        self.num_layers = num_layers

    def view(self, kind: str, like: torch.Tensor, layer: Optional[int] = None) -> torch.Tensor:
        """The static view of `kind` for tensors like `like`: one per layer
        where the groups run after the decoder stack (each layer's
        observations wait there until then), else one for every layer."""
        rows = deferred_rows(like.shape[0]) if layer is not None else max(64, 1 << (like.shape[0] - 1).bit_length())
        shape = (rows, *like.shape[1:])
        layered = layer is not None and self.num_layers is not None and layer < self.num_layers
        # Every layer of a step asks for the same shape, so layer `layer`'s
        # view is block `layer` of [num_layers, *shape].
        key, count = ((kind, "layers"), self.num_layers) if layered else ((kind, layer), 1)
        need = count * math.prod(shape)
        flat = self.flat.get(key)
        if flat is None or flat.numel() < need or flat.dtype != like.dtype or flat.device != like.device:
            grown = max(need, 2 * flat.numel()) if flat is not None and flat.dtype == like.dtype else need
            self.flat[key] = flat = torch.zeros(grown, dtype=like.dtype, device=like.device)
            self.generation += 1
        return flat[:need].view(count, *shape)[layer] if layered else flat[:need].view(shape)

    def store(self, obs, layer: Optional[int] = None, slots: Optional[int] = None):
        """Copy `obs` into the static views (of `layer`: view); the
        Observations of those views. `slots`: the leading slots kept of the
        per-slot kinds (the widest group's; StepBuilder.observed_slots)."""
        from kvsieve.policies import Observations

        out = {}
        for kind in ("attention", "pv_norm", "sparsity"):
            t = getattr(obs, kind)
            if t is not None and slots is not None and kind != "sparsity":
                t = t[..., :slots]
            if t is not None:
                static = self.view(kind, t, layer)
                static[:t.shape[0]].copy_(t)
                out[kind] = static
        return Observations(**out)


@dataclass
class _Entry:
    """The attention segment of one set of step shapes."""

    step: object  # a StepMeta whose region tensors are this entry's static copies (groups: none)
    tensors: list  # step_tensors(step)
    q: Optional[torch.Tensor] = None  # static inputs/outputs of the compressed rows
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    o: Optional[torch.Tensor] = None
    graphs: dict = field(default_factory=dict)  # layer id -> CUDAGraph
    obs: dict = field(default_factory=dict)  # layer id -> Observations of the static buffers
    generation: int = 0  # ObservationBuffers.generation its graphs write
    failed: bool = False  # a capture failed: its layers run eagerly for the rest of the step


@dataclass
class _GroupEntry:
    """The segment of one policy group's shapes."""

    group: object  # a PolicyGroup whose tensors are static copies: views of `arena`
    arena: torch.Tensor  # the bytes of every static tensor (byte_pack), refilled each step
    #: (layer id, observation_shape) -> CUDAGraph; (ALL_LAYERS, shape) -> one
    #: graph of every layer's pass (groups run after the decoder stack:
    #: RegionGraphs.defer_groups)
    graphs: dict = field(default_factory=dict)
    generation: int = 0  # ObservationBuffers.generation its graphs read
    table_version: int = 0  # RegionGraphs.table_version when they were captured
    eager: bool = False  # its capture failed: it runs eagerly from then on


class RegionGraphs:
    def __init__(self, rerun: bool = False):
        self.rerun = rerun
        #: Run the policy groups' passes after the decoder stack, every layer
        #: of a group in one graph (set by the backend where whole-stack
        #: graphs call it back: forward_graphs.py). No layer of a step reads
        #: an earlier layer's region, and groups read nothing of each other,
        #: so the order (each layer's attention, then each group's layers)
        #: gives what the per-layer order gives; but the decoder stack is
        #: then keyed by the attention's shapes alone, which recur whatever
        #: the batch's composition, and a step launches one graph per group
        #: instead of one per group and layer. Costs each layer's
        #: observations kept until the groups run (ObservationBuffers per layer).
        self.defer_groups = False
        #: Whether this step defers: its layers' observations fit the planned
        #: bytes (memory_plan.deferred_obs_bytes; None: no bound, CPU).
        self.defer_step = False
        #: Slots of the step's observations the groups read (the step's
        #: RegionRows.observed_slots): what is stored of each row.
        self.observed_slots: Optional[int] = None
        #: Eager steps (shapes with no entry yet) defer too: each layer's
        #: observations go to the same planned buffers, and after the stack
        #: each group runs eagerly over blocks of layers (layer_blocks.py),
        #: not once per layer: a new composition's step cost 250-280 ms at
        #: ~50 rows on an H200 with its groups inside the layers.
        self.eager_defer = False
        #: This eager step's observations by layer id (static views), or empty.
        self.eager_obs: dict = {}
        self.observation_budget: Optional[int] = None
        #: The model's attention layers by id, as they pass (run_groups calls
        #: the groups' passes with them after the stack).
        self.layers: dict = {}
        self.cache: "OrderedDict[tuple, _Entry]" = OrderedDict()
        self.groups: "OrderedDict[tuple, _GroupEntry]" = OrderedDict()
        self.observations = ObservationBuffers()
        self.current: Optional[_Entry] = None
        #: This step's groups, each with its segment's entry (None: eager on the live group).
        self.step_groups: list = []
        #: This step's composition: (attention key, group keys), or None;
        #: whether it recurs enough to capture its decoder stack.
        self.composition: Optional[tuple] = None
        self.composition_seen = False
        self.compositions: "deque[tuple]" = deque()  # of the last COMPOSITION_WINDOW steps
        self.composition_counts: Counter = Counter()
        self.batch_index: Optional[torch.Tensor] = None
        self.real = 0
        self.table = None  # the region's page table as last seen (watch_table)
        self.width = None  # page-table columns of the captured graphs (reset)
        self.resets = 0
        #: Called on reset(): holders of graphs in this pool (forward_graphs.py) drop theirs.
        self.on_reset: list = []
        self.table_version = 0
        #: Keys seen lately: a key is captured the second time it shows up among them.
        self.recent: "OrderedDict[tuple, None]" = OrderedDict()
        self.recent_groups: "OrderedDict[tuple, None]" = OrderedDict()
        #: Capture a key at its first sighting instead of its second (set by
        #: the backend: first_sight_enabled).
        self.first_sight = False
        self.captures = 0  # attention segments (layer graphs)
        self.replays = 0
        self.group_captures = 0  # group segments (layer graphs)
        self.group_replays = 0
        #: Group segments made (one per key captured), dropped by the
        #: max_group_shapes bound, and made again for a key it had dropped
        #: (the step log: whether traffic's group captures are new shapes or
        #: a cache too small for the shapes taking turns).
        self.group_entries = 0
        #: Group segments kept (MAX_GROUP_SHAPES, KVSIEVE_REGION_GROUP_SHAPES; benches vary it).
        self.max_group_shapes = MAX_GROUP_SHAPES
        self.group_evictions = 0
        self.group_recaptures = 0
        self._evicted_groups: set = set()
        #: Group segments whose graphs were dropped because the observation
        #: buffers or the page table grew since their capture.
        self.group_stale = 0
        #: Attention keys whose capture failed: eager from then on.
        self.eager_keys: set = set()
        # One memory pool for every captured graph: graphs replay one at a
        # time and what one leaves for the next is in static tensors, so a
        # segment's temporaries may reuse another's. A pool per shape held
        # the sum of up to MAX_SHAPES passes' temporaries (skipkv at 512 rows
        # ran out of memory on an H100); a shared pool holds about the largest.
        self.pool = None

    @staticmethod
    def _seen(recent: "OrderedDict", key, limit: int) -> bool:
        """Record `key` as seen now; whether it was seen lately before."""
        seen = key in recent
        recent[key] = None
        recent.move_to_end(key)
        while len(recent) > limit:
            recent.popitem(last=False)
        return seen

    def begin_step(self, step, needs_keys: bool, table=None) -> None:
        """Before the forward: pick (or make) the entries of this step's
        attention segment and groups and copy the step's metadata into them.
        `table`: the region's page table (watch_table)."""
        self.watch_table(table)
        self.current, self.step_groups, self.composition = None, [], None
        self.eager_obs = {}
        self.observed_slots = step.region.observed_slots if step.region is not None else None
        self.defer_step = self.defer_groups and self._deferred_obs_fit(step)
        key = signature(step, needs_keys)
        if key is None or key in self.eager_keys:
            return
        width = step.region.tables.shape[3]
        if width != self.width:
            self.reset()
            self.width = width
        seen_before = self._seen(self.recent, key, RECENT_KEYS)
        entry = self.cache.get(key)
        if entry is None:
            if not (seen_before or self.first_sight):
                # Shapes change every step while requests join (prefills
                # between decodes): capture only shapes seen before, lately.
                return
            entry = self._new_entry(step)
            self.cache[key] = entry
            while len(self.cache) > MAX_SHAPES:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(key)
            for static, fresh in zip(entry.tensors, step_tensors(step)):
                static.copy_(fresh, non_blocking=True)
        self.current = entry
        self.batch_index = step.region.batch_index  # where the compressed rows are in this step's batch
        self.real = step.region.real  # this step's rows before its padded ones
        group_keys, ordinal = [], {}
        for group in step.region.groups:
            gkey = group_signature(group)
            if gkey is not None:
                # Two groups of the same shapes in one step (row chunks) are two segments.
                ordinal[gkey] = ordinal.get(gkey, -1) + 1
                gkey = (gkey, ordinal[gkey])
            group_keys.append(gkey)
            self.step_groups.append((group, self._group_entry(group, gkey)))
        # Deferred groups run after the stack: the stack depends on the attention's shapes only.
        self.composition = (key,) if self.defer_step else (key, tuple(group_keys))
        self.compositions.append(self.composition)
        self.composition_counts[self.composition] += 1
        if len(self.compositions) > COMPOSITION_WINDOW:
            old = self.compositions.popleft()
            self.composition_counts[old] -= 1
            if not self.composition_counts[old]:
                del self.composition_counts[old]
        self.composition_seen = self.composition_counts[self.composition] >= COMPOSITION_REPEATS

    def plan_observations(self, budget: int, num_layers: int, page_size: int) -> None:
        """Bound the bytes deferred steps keep in observations (memory_plan.
        deferred_obs_bytes, carved from the KV budget at start)."""
        self.observation_budget, self.num_layers, self.page_size = budget, num_layers, page_size

    def _deferred_obs_fit(self, step) -> bool:
        """Whether every layer's observations of this step fit the planned
        bytes: a step with more rows, or groups wider, than planned runs its
        groups inside the layers (memory is planned at start, never found
        short mid-run). Only the slots the groups read are kept
        (observed_slots), so one wide row that no group observes (snapkv's,
        a long prompt's) does not cost every row its width."""
        if self.observation_budget is None:
            return True
        from kvsieve.policies import Need

        rows = step.region
        R, _, H, _ = rows.tables.shape
        kinds = bool(rows.needs & Need.ATTENTION) + bool(rows.needs & Need.PV_NORM)
        return deferred_rows(R) * self.num_layers * H * rows.observed_slots * 4 * kinds <= self.observation_budget

    def _group_entry(self, group, gkey) -> Optional[_GroupEntry]:
        if gkey is None:
            return None
        seen_before = self._seen(self.recent_groups, gkey, RECENT_GROUP_KEYS)
        entry = self.groups.get(gkey)
        if entry is None or entry.eager:
            if entry is None and (seen_before or self.first_sight):
                static, arena = self._static_group(group)
                entry = self.groups[gkey] = _GroupEntry(group=static, arena=arena)
                entry.generation = self.observations.generation
                self.group_entries += 1
                if gkey in self._evicted_groups:
                    self.group_recaptures += 1
                    self._evicted_groups.discard(gkey)
                while len(self.groups) > self.max_group_shapes:
                    dropped, _ = self.groups.popitem(last=False)
                    self._evicted_groups.add(dropped)
                    self.group_evictions += 1
                return entry
            return None
        self.groups.move_to_end(gkey)
        # One copy (same shapes and dtypes: the key): from the bytes the step
        # shipped the group in, else packed from its tensors.
        if group.packed is not None:
            entry.arena.copy_(group.packed, non_blocking=True)
        else:
            byte_pack.refill(entry.arena, group_tensors(group))
        # This step's requests (a fault ends exactly these) and a fresh flag.
        entry.group.members, entry.group.requests, entry.group.failed = group.members, group.requests, False
        return entry

    @staticmethod
    def _static_group(group) -> tuple:
        """A copy of `group` whose tensors are views of one buffer (packed:
        byte_pack), and that buffer: a later step refills them with one copy."""
        import copy

        g = copy.copy(group)
        arena, static = byte_pack.pack(group_tensors(group))
        set_group_tensors(g, static)
        g.packed = None
        return g, arena

    @staticmethod
    def _new_entry(step) -> _Entry:
        import copy

        static = copy.copy(step)
        static.region = copy.copy(step.region)
        rows = static.region
        for name in ("pool_rows", "tables", "prefix_slots", "prefix_mask", "prefix_lens", "columns", "observe",
                     "positions", "out_slots"):
            setattr(rows, name, getattr(rows, name).clone())
        # The captured pass reads the compressed rows from static inputs, in
        # order, and writes every row's output (padded ones too) to static o.
        rows.batch_index = torch.arange(rows.pool_rows.shape[0], device=rows.pool_rows.device)
        rows.real = rows.pool_rows.shape[0]
        rows.groups = []
        return _Entry(step=static, tensors=step_tensors(static))

    def members(self) -> tuple:
        """The entries this step's segments use (a whole-stack capture reads
        their static tensors, so it is valid only while they are these):
        the attention's alone where groups run after the stack."""
        if self.defer_step:
            return (self.current,)
        return (self.current, *(g for _, g in self.step_groups))

    def static_step(self):
        """This step as the captured segments see it: the attention entry's
        static metadata with every group's static copy, or None when some
        group has none (it runs eagerly). Forward graphs capture the whole
        decoder stack on it."""
        entry = self.current
        if entry is None or (not self.defer_step and any(g is None for _, g in self.step_groups)):
            return None
        import copy

        step = copy.copy(entry.step)
        step.region = copy.copy(entry.step.region)
        step.region.groups = [] if self.defer_step else [g.group for _, g in self.step_groups]
        return step

    def fully_captured(self, num_layers: int) -> bool:
        """Whether every segment of this step has a graph in every layer."""
        entry = self.current
        if (entry is None or entry.failed or len(entry.graphs) < num_layers
                or entry.generation != self.observations.generation):
            return False
        if self.defer_step:
            return True  # the groups run after the stack, replayed or not
        shape = observation_shape(next(iter(entry.obs.values()), None))

        def layers_recorded(g) -> int:  # its per-layer graphs over this step's observation views
            return sum(1 for lid, seen in g.graphs if lid != ALL_LAYERS and seen == shape)
        return all(g is not None and layers_recorded(g) >= num_layers and not g.eager
                   and g.generation == self.observations.generation and g.table_version == self.table_version
                   for _, g in self.step_groups)

    def reset(self) -> None:
        """Drop every captured graph and start a new memory pool. Called when
        the page table's width changes (requests growing towards their
        budgets, the widest request ending): graphs of the old width are not
        replayed again, and every tensor of a new capture is larger than the
        last, so a pool kept across widths holds a segment per width it saw
        (an H100 ran out of memory with 15 GB in graph pools after ten
        ramps). Capture costs one step per shape, once per width."""
        if not (self.cache or self.groups):
            return
        self.cache.clear()
        self.groups.clear()
        self._evicted_groups.clear()  # every key starts over at the new width
        self.recent.clear()
        self.recent_groups.clear()
        self.compositions.clear()
        self.composition_counts.clear()
        self.eager_keys.clear()
        for drop in self.on_reset:
            drop()
        self.pool = None
        self.resets += 1
        if torch.cuda.is_available() and not self.rerun:
            torch.cuda.empty_cache()  # the old pool's memory, now that no graph holds it

    def watch_table(self, table) -> None:
        """The region's page table grows by reallocation (pages.py): graphs
        that read the old one (group segments, whole decoder stacks) must be
        captured again; `table_version` tells them."""
        if table is not None and table is not self.table:
            if self.table is not None:
                self.table_version += 1
            self.table = table

    def run(self, backend, layer, q3, k3, v3, o3) -> bool:
        """Run this layer's pass for the compressed rows through the step's
        segments (replayed where captured, eagerly on static tensors where
        not); False when the step runs eagerly as a whole (no entry)."""
        entry = self.current
        if entry is None:
            return False
        idx = self.batch_index
        if entry.q is None:
            entry.q, entry.k, entry.v = q3[idx].clone(), k3[idx].clone(), v3[idx].clone()
            entry.o = o3[idx].clone()
        entry.q.copy_(q3[idx])
        entry.k.copy_(k3[idx])
        entry.v.copy_(v3[idx])
        obs = self._attend(backend, entry, layer)
        if self.defer_step:
            self.layers[layer.layer_id] = layer
        else:
            for group, gentry in self.step_groups:
                self._group(backend, group, gentry, layer, obs)
        o3[idx[:self.real]] = entry.o[:self.real]  # padded rows' outputs stay behind
        return True

    def deferred(self) -> bool:
        """Whether this step's groups wait for run_groups (after the stack)."""
        return self.defer_step and (self.current is not None or bool(self.eager_obs))

    def defers_eagerly(self) -> bool:
        """Whether this step runs eagerly (no entry) and still defers its groups."""
        return self.current is None and self.defer_step and self.eager_defer

    def store_eager_layer(self, layer, obs) -> None:
        """An eager step's attention pass of `layer`: its observations into
        the layer's planned buffers, for run_groups after the stack."""
        self.layers[layer.layer_id] = layer
        self.eager_obs[layer.layer_id] = self.observations.store(obs, layer.layer_id, self.observed_slots)

    def store_layer(self, backend, layer, obs) -> None:
        """A whole-stack capture's attention pass of `layer`: its
        observations into the layer's static buffers, where the groups read
        them after each replay (the attention segments' entry.obs)."""
        self.layers[layer.layer_id] = layer
        self.observations.store(obs, layer.layer_id, self.observed_slots)

    def run_groups(self, backend) -> None:
        """After the decoder stack: every group's pass over every layer, in
        layer order, each group replayed as one graph where captured. The
        observations are the attention entry's static ones, written by the
        layers' segments or by the replayed stack."""
        entry = self.current
        if entry is None:  # an eager step (defers_eagerly): the live groups, eagerly
            ids = sorted(self.eager_obs)
            layers, obs = [self.layers[lid] for lid in ids], [self.eager_obs[lid] for lid in ids]
            for group in backend.step.region.groups:
                backend.decode_group_layers(group, layers, obs)
            return
        ids = sorted(entry.obs)
        layers, obs = [self.layers[lid] for lid in ids], [entry.obs[lid] for lid in ids]
        for group, gentry in self.step_groups:
            self._group_layers(backend, group, gentry, layers, obs)

    def _group_layers(self, backend, group, gentry: Optional[_GroupEntry], layers, obs) -> None:
        self._group_segment(backend, group, gentry, ALL_LAYERS, list(zip(layers, obs)))

    def _group_segment(self, backend, group, gentry: Optional[_GroupEntry], key, passes: list) -> None:
        """One group's pass over `passes` ((layer, observations) pairs):
        eagerly on the live group where it has no segment; else the
        segment's graph under `key` (a layer id, or ALL_LAYERS) and the
        observations' view shape replayed, or run on the static group and
        captured."""
        layers, obs = [layer for layer, _ in passes], [layer_obs for _, layer_obs in passes]
        key = (key, observation_shape(obs[0]))
        if gentry is None or gentry.eager:
            backend.decode_group_layers(group, layers, obs)  # eagerly, on the live group
            return
        self.watch_table(backend.pages.table)
        if gentry.generation != self.observations.generation or gentry.table_version != self.table_version:
            self.group_stale += bool(gentry.graphs)
            gentry.graphs.clear()  # they read observation buffers or a page table that have grown since
            gentry.generation, gentry.table_version = self.observations.generation, self.table_version
        graph = gentry.graphs.get(key)
        if graph is not None:
            graph.replay()
            self.group_replays += len(passes)
            return

        def group_pass():
            backend.decode_group_layers(gentry.group, layers, obs)

        faults_before = faults.count
        group_pass()
        if faults.count != faults_before:  # a pass in which the group failed is not one to replay
            return
        captured = self._try_capture(group_pass)
        if captured is None:
            gentry.eager = True
            gentry.graphs.clear()
        else:
            gentry.graphs[key] = captured
            self.group_captures += len(passes)

    def _attend(self, backend, entry: _Entry, layer):
        """The attention segment of this layer: replayed, or run eagerly on
        the static tensors and captured. Its observations, in the static
        buffers."""
        lid = layer.layer_id
        if entry.generation != self.observations.generation:
            entry.graphs.clear()  # they wrote observation buffers that have grown since
        graph = entry.graphs.get(lid)
        if graph is not None:
            graph.replay()
            self._count_replay(lid)
            return entry.obs[lid]

        def attend_pass():
            obs = backend.decode_attend(entry.q, entry.k, entry.v, entry.o, layer, entry.step)
            entry.obs[lid] = self.observations.store(obs, lid if self.defer_step else None, self.observed_slots)

        # This step for real, eagerly, on the static tensors (the static
        # observation buffers are sized here, outside any capture); then
        # capture the same pass (recorded, not executed) for the next steps.
        attend_pass()
        entry.generation = self.observations.generation
        if entry.failed:
            return entry.obs[lid]
        captured = self._try_capture(attend_pass)
        if captured is None:
            self._give_up(entry)
        else:
            entry.graphs[lid] = captured
            self._count_capture(lid)
        return entry.obs[lid]

    def _group(self, backend, group, gentry: Optional[_GroupEntry], layer, obs) -> None:
        if gentry is not None and not gentry.eager and backend.group_idle(gentry.group, layer):
            return  # nothing to run (or capture: an empty graph)
        self._group_segment(backend, group, gentry, layer.layer_id, [(layer, obs)])

    def _count_capture(self, layer_id: int) -> None:
        self.captures += 1
        if layer_id == 0:
            metrics.record_graph_capture("region")

    def _count_replay(self, layer_id: int) -> None:
        self.replays += 1
        if layer_id == 0:
            metrics.record_graph_replay("region")

    def _try_capture(self, static_pass):
        """capture(), or None when it fails (out of memory, a fault of policy
        code while recording): the step already ran eagerly, so the server
        goes on; those shapes run eagerly from now on."""
        try:
            return self.capture(static_pass)
        except Exception as exc:  # noqa: BLE001 - a failed capture costs speed, never the scheduler
            logger.warning("kvsieve: CUDA-graph capture of a decode step's compressed pass failed (%s: %s); "
                           "these shapes run eagerly", type(exc).__name__, exc)
            metrics.GRAPH_CAPTURE_FAILURES.labels("region").inc()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            return None

    def _give_up(self, entry) -> None:
        """Drop an attention entry whose capture failed and keep its shapes
        eager (this step's later layers run its segment eagerly)."""
        entry.failed = True
        entry.graphs.clear()
        for key, cached in list(self.cache.items()):
            if cached is entry:
                del self.cache[key]
                self.eager_keys.add(key)

    def capture(self, static_pass):
        """Record static_pass (it does not execute) as a CUDA graph whose
        replay() runs it again on the entry's static tensors."""
        if self.rerun:
            return Rerun(static_pass)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self.pool)
            try:
                static_pass()
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        self.pool = self.pool or graph.pool()
        return graph
