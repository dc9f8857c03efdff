"""CUDA graphs of the model's whole decoder stack, for decode steps whose
rows are all compressed.

Region graphs (region_graphs.py) replay the compressed pass of each layer,
but the model's own work around it (embedding, norms, projections, rotary,
MLP: about a dozen kernels per layer) is still launched from Python every
step, and so are the copies of q/k/v into each layer's graph and of its
output back. At the headline's 640 rows that launch work is host time the
GPU waits for. SGLang's decode graphs cannot run these batches: their
attention metadata is the token pool's, not ours
(plugin.graphs_skip_compressed_batches).

So a decode step is replayed whole when:
* every row of the batch is a row of our pass (no rows being aborted, none
  running SGLang's backend), and
* every segment of the step's region graphs (the attention and each policy
  group, region_graphs.py) has been captured in every layer, the step's
  composition (which segments) was seen lately before, and
* no steered request is live (its hooks read host state).

Rows of `full` requests (or none given) would run SGLang's backend, whose
decode graphs cannot hold our rows, and real traffic has them in almost
every batch. Where these graphs run they join our pass instead as
pool-only rows (step_meta.StepBuilder.fold_pool_rows): no region slot, all
of their KV read as the prefix from the token pool, their new token
written there first (at out_slots, inside the replay too). One kernel then
attends every row; tokens of a `full` row may differ from its run on
SGLang's backend by that kernel's rounding (batch-variant, as any
backend's split-KV is). KVSIEVE_FOLD_POOL_ROWS=0 keeps them on SGLang's
backend (such steps replay per layer).

A step with a TBQ group flush replays too: the flush (eager, its rows
change every step) runs for every layer after the stack (`after_stack`),
which is the same, as no later layer of a step reads an earlier layer's
region. Requests out of phase flush in most steps, so excluding those steps
left TBQ batches with no whole-step replays.

Then the decoder stack (`model.model.forward`: embedding through the final
norm; the logits processor and its token observers stay eager) is captured
once for that composition, reading its input ids and positions from static
buffers and the compressed pass from the segments' static step metadata
(batch_index 0..R-1: the batch's rows are the region rows, in order). The
capture records, it does not execute; the step then runs as the first
replay. MAX_COMPOSITIONS are kept (least recently used); one whose
segments' entries were replaced since is captured again. A mixed batch
whose composition changes every step replays its segments per layer
instead.

Row counts are bucketed: each policy group is padded to step_meta.row_bucket
rows (StepBuilder.pad_groups) and the stack runs on the padded rows, whose hidden
states are dropped; a request that joins or ends keeps the step's shapes
unless its group crosses a bucket (each new shape costs one eager step, one
step with region-graph capture, then one forward capture).

KVSIEVE_FORWARD_GRAPHS=0 turns this off (region graphs stay on).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch

from kvsieve.env_flags import flag
from kvsieve.policies.skipkv import steering

from . import faults, metrics, region_graphs

logger = logging.getLogger(__name__)


def enabled() -> bool:
    return flag("KVSIEVE_FORWARD_GRAPHS")


def folds_pool_rows() -> bool:
    """KVSIEVE_FOLD_POOL_ROWS: "1" (default) runs `full` rows beside
    compressed ones in our pass where whole-stack graphs run; "0" leaves
    them on SGLang's backend."""
    return flag("KVSIEVE_FOLD_POOL_ROWS")


@dataclass
class ForwardCapture:
    """One composition's captured decoder stack: static inputs, the static
    step its compressed passes read, graph, output."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    step: object = None  # region_graphs.RegionGraphs.static_step()
    members: tuple = ()  # the region-graph entries whose static tensors `step` holds
    table_version: int = 0  # of the region's page table it reads (region_graphs.RegionGraphs.watch_table)
    generation: int = 0  # of the observation buffers it writes (region_graphs.ObservationBuffers)
    graph: object = None
    #: {"hidden": the decoder's output}: recorded once under CUDA graphs (the
    #: replay writes into that tensor), set again by each "rerun" replay.
    output: Optional[dict] = None


def decoder_of(model) -> Optional[torch.nn.Module]:
    """The decoder stack of an SGLang causal LM (`model.model` with its
    `layers`), whose forward(input_ids, positions, forward_batch) returns the
    final hidden states; None for models laid out otherwise."""
    inner = getattr(model, "model", None)
    if isinstance(inner, torch.nn.Module) and isinstance(getattr(inner, "layers", None), torch.nn.ModuleList):
        return inner
    return None


def step_is_whole(step, batch_size: int) -> bool:
    """Whether this decode step's rows are all compressed rows that the
    captured pass can run: no SGLang-backend rows, no aborted rows, no
    steered request."""
    rows = step.region if step is not None else None
    if rows is None or step.extend is not None:
        return False
    if step.pool_batch is not None or step.zero_batch_index is not None:
        return False
    table = steering.TABLE
    if table is not None and table.live:
        return False
    return rows.real == batch_size


class ForwardGraphs:
    """Wraps the decoder stack's forward; the attention backend tells it,
    once per step, which region-graph entry (if any) the step may replay."""

    def __init__(self, decoder: torch.nn.Module, region_graphs, num_layers: int, after_stack=None):
        self.decoder = decoder
        #: Called with the step after its replayed stack: the backend's
        #: per-layer work that stays eager (the TBQ flush).
        self.after_stack = after_stack
        self.step = None  # the step `active` belongs to
        self.region = region_graphs
        self.num_layers = num_layers
        self.original = decoder.forward
        decoder.forward = self._forward  # an instance attribute: nn.Module.__call__ finds it first
        self.active = None  # the composition this step replays whole
        #: The ForwardCapture being recorded (None otherwise): the backend then
        #: runs each layer's compressed pass on its static step.
        self.capturing = None
        #: composition -> ForwardCapture, least recently used first.
        self.cache: "OrderedDict[tuple, ForwardCapture]" = OrderedDict()
        #: Compositions whose capture ran out of memory: per-layer replays only.
        self.no_forward: set = set()
        self.region.on_reset.append(self._drop_all)
        self.captures = 0
        self.replays = 0
        self.replayed = False  # whether the last stack ran as a replay (after_stack)

    def _drop_all(self) -> None:
        """The region graphs start a new pool (RegionGraphs.reset): ours go too."""
        self.cache.clear()
        self.no_forward.clear()

    def begin_step(self, step, batch_size: int) -> None:
        """After the region graphs' begin_step, before the forward."""
        self.active = self.step = None
        region = self.region
        if (region.current is None or not region.composition_seen or region.composition in self.no_forward
                or not step_is_whole(step, batch_size) or not region.fully_captured(self.num_layers)):
            return
        self.active, self.step = region.composition, step

    def _forward(self, input_ids, positions, forward_batch, *args, **kwargs):
        hidden = self._stack(input_ids, positions, forward_batch, *args, **kwargs)
        if self.after_stack is not None:
            self.after_stack(self.replayed)
        return hidden

    def _eager(self, *args, **kwargs):
        self.replayed = False
        return self.original(*args, **kwargs)

    def _stack(self, input_ids, positions, forward_batch, *args, **kwargs):
        """The decoder stack's output: replayed where this step's
        composition was captured (or is captured now), else run eagerly."""
        composition, self.active = self.active, None  # one forward per step
        step, self.step = self.step, None
        # input_embeds and pp_proxy_tensors (positional or named) are None in a plain decode.
        if (composition is None or any(v is not None for v in (*args, *kwargs.values()))
                or input_ids.shape[0] != step.region.real):
            return self._eager(input_ids, positions, forward_batch, *args, **kwargs)
        rows = input_ids.shape[0]
        members = self.region.members()
        captured = self.cache.get(composition)
        if captured is not None and (not all(a is b for a, b in zip(captured.members, members))
                                     or captured.table_version != self.region.table_version
                                     or captured.generation != self.region.observations.generation):
            # Its segments' entries, the page table or (groups deferred) the
            # observation buffers it writes were replaced since.
            captured = None
        if captured is None:
            static = self.region.static_step()
            # The stack runs on the step's rows, padded ones included (their
            # ids and positions are whatever the buffers hold: outputs dropped).
            padded = static.region.pool_rows.shape[0]
            captured = ForwardCapture(input_ids=input_ids.new_zeros(padded), positions=positions.new_zeros(padded),
                                      step=static, members=members, table_version=self.region.table_version,
                                      generation=self.region.observations.generation)
            out = {}

            def decoder_pass():
                # The flag is set inside the recorded function, so a "rerun"
                # replay (region_graphs.Rerun) takes the same static path.
                self.capturing = captured
                try:
                    out["hidden"] = self.original(captured.input_ids, captured.positions, forward_batch)
                finally:
                    self.capturing = None

            try:
                captured.graph = self.region.capture(decoder_pass)  # the region graphs' memory pool
            except Exception as exc:  # noqa: BLE001 - nothing ran (a capture records only): run eagerly
                if faults.is_out_of_memory(exc) or self.captures:
                    # Out of memory, or a fault inside a pass that recorded
                    # before: these shapes keep their region graphs only.
                    logger.warning("kvsieve: the decoder stack of this step's shapes could not be captured "
                                   "(%s: %s); they replay per layer", type(exc).__name__, exc)
                    metrics.GRAPH_CAPTURE_FAILURES.labels("forward").inc()
                    self.no_forward.add(composition)
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                        torch.cuda.empty_cache()
                else:
                    # A model whose forward cannot be recorded: whole-forward
                    # graphs off for good; the region graphs stay.
                    logger.exception("kvsieve: the decoder stack could not be captured; whole-forward graphs off")
                    self.decoder.forward = self.original
                    # Nothing calls after_stack from now on: the groups go
                    # back inside the layers, from this step's on.
                    self.after_stack = None
                    self.region.defer_groups = False
                return self._eager(input_ids, positions, forward_batch, *args, **kwargs)
            captured.output = out
            self.cache[composition] = captured
            while len(self.cache) > region_graphs.MAX_COMPOSITIONS:
                self.cache.popitem(last=False)
            self.captures += 1
            metrics.record_graph_capture("forward")
            logger.info("kvsieve: decode steps of %d compressed rows replay the whole decoder stack (%d captures)",
                        input_ids.shape[0], self.captures)
        else:
            self.cache.move_to_end(composition)
        captured.input_ids[:rows].copy_(input_ids)
        captured.positions[:rows].copy_(positions)
        captured.graph.replay()
        self.replayed = True
        self.replays += 1
        metrics.record_graph_replay("forward")
        hidden = captured.output.get("hidden")
        if not isinstance(hidden, torch.Tensor):
            raise RuntimeError(f"kvsieve: the decoder stack returned {type(hidden).__name__}, not hidden states; "
                               "set KVSIEVE_FORWARD_GRAPHS=0 for this model")
        # A copy, before after_stack replays the groups' graphs: the output
        # was allocated in the region graphs' shared pool while this stack
        # was recorded, possibly in blocks that a group graph recorded
        # earlier used for its temporaries (PyTorch's allocator hands a freed
        # block to the next capture on the same stream, and captures cycle
        # through 32 pooled streams); that group's replay writes them again.
        # On an H200 under traffic every row's logits then went NaN at once
        # (docs/gpu-kernels.md, "Known failure under traffic").
        return hidden[:rows].clone()
