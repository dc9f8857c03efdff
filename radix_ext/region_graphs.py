"""CUDA graphs of the compressed decode pass, one per layer, keyed by the
step's shapes.

Without graphs the per-layer pass is launch-bound: ~100 small kernels per
layer (store, gathers, the policies' tensor ops, write-back), each a few
microseconds of GPU work behind tens of microseconds of Python. In steady
decode the shapes of a step (rows, page-table width, longest prefix, the
policy groups and their sizes) stay the same for many steps, so the pass is
captured once per layer for those shapes and replayed: before the forward
the new step's metadata is copied into the captured tensors (one copy per
tensor, once per step), and each layer copies its q/k/v rows in and its
output rows out around a replay.

Shapes seen for the first time run eagerly; the next step of the same
shapes among the last RECENT_KEYS steps runs the pass eagerly for real,
then captures it (capture records, it does not execute), so no step is
applied twice. Decode steps' policy groups are padded to bucketed row
counts (step_meta.row_bucket, StepBuilder.pad), so requests joining and
ending mostly keep a step's shapes.
Only policies marked `graph_safe` are captured (and the observing rows of
those marked `observe_graph_safe`): their decisions are tensor functions of
(batch, view, obs) whose host-side inputs (shapes, parameter maxima) are
part of the key. Under tensor parallelism a pass with a collective (a
policy that `crosses_heads`) runs eagerly; the others replay on every rank.
SGLang's own graphs keep running batches
without compressed rows (plugin.graphs_skip_compressed_batches).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import faults, head_parallel, metrics

logger = logging.getLogger(__name__)

#: Shapes kept captured at once (a graph per layer and one of the decoder
#: stack each, plus static metadata: about 40 MB at 640 rows of
#: R1-Distill-Qwen-7B, the page table being most of it); the least recently
#: used goes. 8: thinkv's cut steps under traffic take turns among more shapes
#: than 4 (bench/graph_buckets.py: 73% of steps replayed at 64 rows, 42% with 4).
MAX_SHAPES = int(os.environ.get("KVSIEVE_REGION_GRAPH_SHAPES", "8"))
#: Steps whose shapes count as seen lately (a shape is captured when it comes back).
RECENT_KEYS = 16


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


def buckets_enabled() -> bool:
    """KVSIEVE_GRAPH_BUCKETS: "1" (default) pads decode steps' policy groups
    to bucketed row counts (step_meta.row_bucket) where graphs replay; "0"
    keys graphs by exact row counts."""
    value = os.environ.get("KVSIEVE_GRAPH_BUCKETS", "1")
    if value not in ("0", "1"):
        raise ValueError(f"KVSIEVE_GRAPH_BUCKETS must be 0 or 1, not {value!r}")
    return value == "1"


def enabled(device) -> bool:
    return mode() == "rerun" or (mode() == "1" and torch.device(device).type == "cuda")


class Rerun:
    """A recorded pass that replays by running again (KVSIEVE_REGION_GRAPHS=rerun)."""

    def __init__(self, fn):
        self.replay = fn


def step_tensors(step) -> list[torch.Tensor]:
    """Every tensor of a decode step's metadata the per-layer pass reads, in
    a fixed order (not batch_index: the captured pass reads its rows from
    static inputs in order)."""
    rows = step.region
    out = [rows.pool_rows, rows.tables, rows.prefix_slots, rows.prefix_mask, rows.prefix_lens,
           rows.positions]
    for group in rows.groups:
        out += [group.rows, group.budget, group.step, group.pool_rows]
        out += [group.params[k] for k in sorted(group.params)]
        out += [group.inputs[k] for k in sorted(group.inputs)]
    return out


def capturable(group) -> bool:
    """Whether a policy group's per-layer pass may run inside a captured
    graph. Under tensor parallelism not a pass with a collective (its
    policy crosses_heads): NCCL calls inside these graphs are not captured
    or checked; the per-head policies' passes make none."""
    policy = group.policy
    if policy.crosses_heads and head_parallel.SHARDS.size > 1:
        return False
    return policy.graph_safe or (group.action == "observe" and policy.observe_graph_safe)


def signature(step, needs_keys: bool) -> Optional[tuple]:
    """The key of a decode step's captured graphs, or None when it must run
    eagerly (a policy not marked graph_safe, rows being aborted)."""
    rows = step.region
    if rows is None or step.zero_batch_index is not None:
        return None
    groups = []
    for group in rows.groups:
        if not capturable(group):
            return None
        groups.append((type(group.policy).__qualname__, group.action, tuple(sorted(group.maxima.items())),
                       tuple(sorted(group.inputs))))
    shapes = tuple((tuple(t.shape), t.dtype) for t in step_tensors(step))
    return (shapes, tuple(groups), rows.needs, rows.keeps_state, needs_keys)


@dataclass
class _Captured:
    step: object  # a StepMeta whose tensors are this entry's static copies
    tensors: list  # step_tensors(step)
    q: Optional[torch.Tensor] = None  # static inputs/outputs of the compressed rows
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    o: Optional[torch.Tensor] = None
    graphs: dict = field(default_factory=dict)  # layer id -> CUDAGraph
    forward: object = None  # the whole decoder stack's graph (forward_graphs.ForwardCapture)
    no_forward: bool = False  # its decoder-stack capture failed: per-layer replays only


class RegionGraphs:
    def __init__(self, rerun: bool = False):
        self.rerun = rerun
        self.cache: "OrderedDict[tuple, _Captured]" = OrderedDict()
        self.current: Optional[_Captured] = None
        self.batch_index: Optional[torch.Tensor] = None
        self.real = 0
        #: Keys of the last RECENT_KEYS steps: a shape is captured the second
        #: time it shows up among them.
        self.recent: "OrderedDict[tuple, None]" = OrderedDict()
        self.captures = 0
        self.replays = 0
        #: Shapes whose capture failed: eager from then on.
        self.eager_keys: set = set()
        # One memory pool for every captured shape: graphs replay one at a
        # time and their outputs are copied out right after, so a shape's
        # temporaries may reuse another's. A pool per shape held the sum of
        # up to MAX_SHAPES passes' temporaries (skipkv at 512 rows ran out of
        # memory on an H100); a shared pool holds about the largest.
        self.pool = None

    def begin_step(self, step, needs_keys: bool) -> None:
        """Before the forward: pick (or make) the captured entry of this
        step's shapes and copy the step's metadata into it."""
        self.current = None
        key = signature(step, needs_keys)
        if key is None or key in self.eager_keys:
            return
        seen_before = key in self.recent
        self.recent[key] = None
        self.recent.move_to_end(key)
        while len(self.recent) > RECENT_KEYS:
            self.recent.popitem(last=False)
        entry = self.cache.get(key)
        if entry is None:
            if not seen_before:
                # Shapes change every step while requests join (prefills
                # between decodes): capture only shapes seen before, lately.
                # (Not only in the step before: requests out of phase
                # alternate a deciding step's shapes with an observing one's.)
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

    @staticmethod
    def _new_entry(step) -> _Captured:
        import copy

        static = copy.copy(step)
        static.region = copy.copy(step.region)
        rows = static.region
        for name in ("pool_rows", "tables", "prefix_slots", "prefix_mask", "prefix_lens", "positions"):
            setattr(rows, name, getattr(rows, name).clone())
        # The captured pass reads the compressed rows from static inputs, in
        # order, and writes every row's output (padded ones too) to static o.
        rows.batch_index = torch.arange(rows.pool_rows.shape[0], device=rows.pool_rows.device)
        rows.real = rows.pool_rows.shape[0]
        groups = []
        for group in rows.groups:
            g = copy.copy(group)
            g.rows, g.budget, g.step, g.pool_rows = (group.rows.clone(), group.budget.clone(), group.step.clone(),
                                                     group.pool_rows.clone())
            g.params = {k: v.clone() for k, v in group.params.items()}
            g.inputs = {k: v.clone() for k, v in group.inputs.items()}
            groups.append(g)
        rows.groups = groups
        return _Captured(step=static, tensors=step_tensors(static))

    def run(self, run_pass, layer, q3, k3, v3, o3) -> bool:
        """Run this layer's pass for the compressed rows through the graph of
        the step's shapes; False when the step runs eagerly (no entry)."""
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
        graph = entry.graphs.get(layer.layer_id)
        if graph is None:
            # This step for real, eagerly, on the static tensors; then capture
            # the same pass (recorded, not executed) for the next steps.
            def static_pass():
                run_pass(entry.q, entry.k, entry.v, entry.o, layer, entry.step)

            faults_before = faults.count
            static_pass()
            captured = None
            if faults.count == faults_before:  # a pass in which a group failed is not one to replay
                captured = self._try_capture(static_pass, entry)
            if captured is None:
                self._give_up(entry)
            else:
                entry.graphs[layer.layer_id] = captured
                self.captures += 1
                if layer.layer_id == 0:
                    metrics.record_graph_capture("region")
        else:
            graph.replay()
            self.replays += 1
            if layer.layer_id == 0:
                metrics.record_graph_replay("region")
        o3[idx[:self.real]] = entry.o[:self.real]  # padded rows' outputs stay behind
        return True

    def _try_capture(self, static_pass, entry):
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
        """Drop an entry whose capture failed and keep its shapes eager."""
        for key, cached in list(self.cache.items()):
            if cached is entry:
                del self.cache[key]
                self.eager_keys.add(key)
        if self.current is entry:
            self.current = None

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
