"""GPU memory kvsieve uses beyond SGLang's own, planned at start-up.

SGLang sizes its KV budget as what --mem-fraction-static leaves after the
weights; the rest (the slack) is for its own activations and CUDA-graph
pools. kvsieve's extras used to come out of that slack unplanned, and at the
headline's scale (640 rows, a 45 GB region on an H100) they did not fit: a
decision gathered the whole batch's keys inside a graph capture. Now they
are carved out of the KV budget before the pool/region split
(memory_split.carve_region), so the region is what is really left:

  page_table        [rows, layers, kv heads, columns] int64, columns planned
                    for KVSIEVE_PLANNED_HEAD_TOKENS tokens a head
  decision_scratch  KVSIEVE_DECISION_SCRATCH_MB of keys a decision gathers
                    at once (step_meta.chunk_key_readers), times what it
                    derives from them, in an eager and a captured pass
  pass_scratch      the per-layer pass's [rows, heads, slots] tensors (view
                    gathers, observations, evictions), bounded by the
                    region's slots per layer: one pass eager, one in the
                    graph pool every captured shape shares
  forward_graph     the decoder stack's activations at `rows`, replayed
                    from the same pool (forward_graphs.py)
  tbq_staging       a TBQ flush chunk (tbq_store.FLUSH_ROWS table rows)
  deferred_obs      each layer's observations kept until the policy groups
                    run after the decoder stack (region_graphs.RegionGraphs.
                    defer_groups): attention and |p*v| floats of `rows` rows
                    over KVSIEVE_DEFERRED_OBS_COLUMNS columns (the columns
                    its widest observing group reads: RegionRows.
                    observed_slots); a step over that runs its groups
                    inside the layers instead
  prefix_tables     a decode step's prefix tables ([rows, tokens] slots and
                    mask, 9 bytes a cell) in the live step and in each
                    region-graph entry, at KVSIEVE_FOLD_MAX_TOKENS tokens:
                    the longest `full` row a step takes into kvsieve's pass
                    (step_meta.StepBuilder.fold_pool_rows; a longer one
                    keeps the step on SGLang's backend)
  prefix_attention  the decode kernel's scratch over those tables' width (a
                    folded `full` row's prefix reaches it): fp16 logits of
                    every query head and the float partial outputs of its
                    key splits, one step eager and one in the graph pool

Rows: `--max-running-requests` (SGLang's estimate when unset) is lowered at
start, with a log line saying why, to the most rows whose plan fits in
KVSIEVE_WORKSPACE_SHARE (default 0.25) of the KV budget (radix_ext/plugin:
resolve_max_num_reqs), never discovered short mid-run. The plan is logged
with the memory split and exported as kvsieve_planned_bytes{part}.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

#: Bytes a per-layer pass holds per slot of its rows: the view's gathers
#: (valid 1, position 8, score 4, last_hit 4), observations (up to 3 x 4),
#: eviction masks (2), a policy's top-k values and indices (12), the
#: write-back's index tensors (8 x 2), rounded up for padding to buckets.
PASS_BYTES_PER_SLOT = 96
#: A decision derives about this many key-sized tensors from its keys
#: (norms, weighted products), eager and captured: the scratch bound's factor.
DECISION_SCRATCH_FACTOR = 4
#: Activation tensors of one decoder layer the captured stack keeps live at
#: once: hidden-sized and intermediate-sized (gate/up, their product).
FORWARD_HIDDEN_TENSORS, FORWARD_INTERMEDIATE_TENSORS = 4, 3
TBQ_BYTES_PER_SLOT = 40  # a flush's [rows, heads, columns x slots] ranks, orders, destinations

#: Kinds of per-slot observations a deferred step keeps per layer (attention, |p*v|), 4 bytes each.
DEFERRED_OBS_BYTES_PER_SLOT = 8
DEFERRED_OBS_COLUMNS_ENV = "KVSIEVE_DEFERRED_OBS_COLUMNS"
#: 80 columns: 1,280 tokens a head, the headline's budget 1024 with its slack.
DEFAULT_DEFERRED_OBS_COLUMNS = 80
HEAD_TOKENS_ENV = "KVSIEVE_PLANNED_HEAD_TOKENS"
DEFAULT_HEAD_TOKENS = 4096
FOLD_TOKENS_ENV = "KVSIEVE_FOLD_MAX_TOKENS"
DEFAULT_FOLD_TOKENS = 4096
#: Bytes of one prefix-table cell: its slot (int64) and its mask (bool).
PREFIX_CELL_BYTES = 9
SHARE_ENV = "KVSIEVE_WORKSPACE_SHARE"
DEFAULT_SHARE = 0.25
#: Rows planned where SGLang picks max_running_requests itself.
DEFAULT_ROWS = 1024


def _whole_number_env(name: str, default: int, unit: str, minimum: int, why: str) -> int:
    raw = os.environ.get(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: must be a whole number of {unit}") from None
    if value < minimum:
        raise ValueError(f"{name}={raw}: {why}")
    return value


def planned_head_tokens(context_len: int) -> int:
    tokens = _whole_number_env(HEAD_TOKENS_ENV, DEFAULT_HEAD_TOKENS, "tokens", 16,
                               "must be at least 16 (tokens one (layer, kv head) may hold)")
    return min(tokens, max(context_len, 16))


def fold_max_tokens(context_len: int) -> int:
    """Tokens of the longest `full` row a decode step takes into kvsieve's
    pass (0: never)."""
    tokens = _whole_number_env(FOLD_TOKENS_ENV, DEFAULT_FOLD_TOKENS, "tokens", 0,
                               "must be >= 0 (0: `full` rows always run SGLang's backend)")
    return min(tokens, max(context_len, 0))


def prefix_attention_bytes(rows: int, tokens: int, q_heads: int, head_dim: int) -> int:
    """The decode kernel's scratch for a prefix `tokens` wide
    (kernels/decode_attention.py): per key and query head an fp16 logit,
    per KEYS_PER_SPLIT keys a float partial output of head_dim; one step
    eager, one in the graph pool the captured shapes share."""
    from kvsieve.kernels.decode_attention import KEYS_PER_SPLIT

    per_token = q_heads * (2 + head_dim * 4 / KEYS_PER_SPLIT)
    return int(2 * rows * tokens * per_token)


def prefix_tables_bytes(rows: int, tokens: int) -> int:
    """The prefix tables of `rows` rows at `tokens` columns, in the live
    step and in every region-graph entry (region_graphs.MAX_SHAPES)."""
    from .region_graphs import MAX_SHAPES

    return (MAX_SHAPES + 1) * rows * tokens * PREFIX_CELL_BYTES


def deferred_obs_columns() -> int:
    return _whole_number_env(DEFERRED_OBS_COLUMNS_ENV, DEFAULT_DEFERRED_OBS_COLUMNS, "page-table columns", 0,
                             "must be >= 0 (0: groups always inside the layers)")


def deferred_obs_bytes(rows: int, num_layers: int, kv_heads: int, page_size: int) -> int:
    """Bytes planned for the observations a step keeps per layer until its
    groups run after the stack (rows as the buffers round them:
    region_graphs.deferred_rows)."""
    from .region_graphs import deferred_rows

    return deferred_rows(rows) * num_layers * kv_heads * deferred_obs_columns() * page_size * DEFERRED_OBS_BYTES_PER_SLOT


def workspace_share() -> float:
    from .memory_split import fraction_from_env

    return fraction_from_env(SHARE_ENV, DEFAULT_SHARE, "the most of SGLang's KV budget kvsieve's workspace "
                             "(page table, decision and pass scratch, graph pools) may take")


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    kv_heads: int  # on this rank
    head_dim: int
    element: int  # bytes of a K or V element
    hidden: int
    intermediate: int
    context_len: int
    page_size: int = 16
    q_heads: int = 0  # on this rank; 0: as many as kv_heads


@dataclass(frozen=True)
class Workspace:
    rows: int
    columns: int
    page_table: int
    decision_scratch: int
    pass_scratch: int
    forward_graph: int
    tbq_staging: int
    deferred_obs: int = 0
    prefix_tables: int = 0
    fold_tokens: int = 0  # the prefix_tables' width: StepBuilder.fold_max_tokens
    prefix_attention: int = 0

    @property
    def total(self) -> int:
        return (self.page_table + self.decision_scratch + self.pass_scratch + self.forward_graph + self.tbq_staging
                + self.deferred_obs + self.prefix_tables + self.prefix_attention)

    def parts(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("rows", "columns", "fold_tokens")}

    def describe(self) -> str:
        mib = {k: f"{v / 2**20:.0f}" for k, v in self.parts().items()}
        return (f"workspace {self.total / 2**20:.0f} MiB planned for {self.rows} rows (page table {mib['page_table']} "
                f"at {self.columns} columns, decision scratch {mib['decision_scratch']}, pass scratch "
                f"{mib['pass_scratch']}, forward graph {mib['forward_graph']}, TBQ staging {mib['tbq_staging']}, "
                f"deferred observations {mib['deferred_obs']}, prefix tables {mib['prefix_tables']} "
                f"and their attention scratch {mib['prefix_attention']} at {self.fold_tokens} tokens)")


def slot_bytes(shape: ModelShape) -> int:
    """Bytes of one region slot: K and V plus its state (pages.SLOT_STATE_BYTES)."""
    from .pages import PAGE_STATE_BYTES, SLOT_STATE_BYTES

    return 2 * shape.head_dim * shape.element + SLOT_STATE_BYTES + -(-PAGE_STATE_BYTES // shape.page_size)


def plan(shape: ModelShape, rows: int, kv_budget: int, region_fraction: float) -> Workspace:
    """The workspace of `rows` running rows when the region takes
    `region_fraction` of what is left of `kv_budget` bytes."""
    from .step_meta import decision_scratch_bytes
    from .tbq_store import FLUSH_ROWS

    columns = -(-planned_head_tokens(shape.context_len) // shape.page_size) + 2  # budget + a buffer's slack
    table = rows * shape.num_layers * shape.kv_heads * columns * 8
    decision = DECISION_SCRATCH_FACTOR * decision_scratch_bytes()
    slots_per_layer = int(kv_budget * region_fraction) // (slot_bytes(shape) * shape.num_layers)
    pass_scratch = 2 * PASS_BYTES_PER_SLOT * slots_per_layer
    forward = rows * (FORWARD_HIDDEN_TENSORS * shape.hidden + FORWARD_INTERMEDIATE_TENSORS * shape.intermediate) \
        * shape.element
    tbq = min(FLUSH_ROWS, rows * shape.num_layers) * shape.kv_heads * columns * shape.page_size * TBQ_BYTES_PER_SLOT
    deferred = deferred_obs_bytes(rows, shape.num_layers, shape.kv_heads, shape.page_size)
    fold = fold_max_tokens(shape.context_len)
    return Workspace(rows=rows, columns=columns, page_table=table, decision_scratch=decision,
                     pass_scratch=pass_scratch, forward_graph=forward, tbq_staging=tbq, deferred_obs=deferred,
                     prefix_tables=prefix_tables_bytes(rows, fold), fold_tokens=fold,
                     prefix_attention=prefix_attention_bytes(rows, fold, shape.q_heads or shape.kv_heads,
                                                             shape.head_dim))


def fit_rows(shape: ModelShape, rows: int, kv_budget: int, region_fraction: float) -> tuple[int, Workspace]:
    """The most rows (at most `rows`) whose workspace fits in the share of
    the KV budget, and that workspace."""
    cap = workspace_share() * kv_budget
    work = plan(shape, rows, kv_budget, region_fraction)
    if work.total <= cap:
        return rows, work
    lo, hi = 1, rows
    while lo < hi:  # the plan grows with rows
        mid = (lo + hi + 1) // 2
        if plan(shape, mid, kv_budget, region_fraction).total <= cap:
            lo = mid
        else:
            hi = mid - 1
    work = plan(shape, lo, kv_budget, region_fraction)
    if work.total > cap:
        raise ValueError(f"{SHARE_ENV}={workspace_share()}: kvsieve's workspace for one row "
                         f"({work.total / 2**20:.0f} MiB) exceeds that share of the KV budget "
                         f"({kv_budget / 2**20:.0f} MiB); raise --mem-fraction-static, "
                         f"lower KVSIEVE_DECISION_SCRATCH_MB or {HEAD_TOKENS_ENV}")
    return lo, work
