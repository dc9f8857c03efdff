"""How many decode steps replay captured graphs when requests arrive and end
at different steps (continuous batching), with the step shapes kept in
buckets and without.

The GPU headline sends every request at once, so its rows run in phase and
one batch keeps one shape for thousands of steps. Served traffic does not:
a request ends, another joins a few steps later, and rows reach their
decision cadence at different steps. Graphs are keyed by a step's shapes
(radix_ext/region_graphs.py), so what matters is how often a step's shapes
were captured before it. This measures that on the host side only: the real
step builder, page manager, policies' step inputs and the graphs' keying
and capture rule, no model and no attention (a step counts as replayed when
its shapes' entry was captured in an earlier step). Modes:

* exact: graphs keyed by exact row counts, deciding groups unpadded;
* buckets: deciding groups padded (Policy.pads_decisions) and policy groups
  padded to step_meta.row_bucket rows (KVSIEVE_GRAPH_BUCKETS, the default).
Both modes capture a shape the second time it shows up among the last 16
steps, keep region_graphs.MAX_SHAPES shapes, and round thinkv's cut-step
shapes up to powers of two (all three from 2026-11-26): "exact" is not the
engine before that day, which replayed less.

The pass is captured in segments (since 2026-11-27, radix_ext/region_graphs.py):
the attention of every row, and each policy group. Reported per run:
`replayed_share` (steps whose attention segment replays), `group_replayed_share`
(group segments that replay, of all groups in the measured steps),
`whole_step_share` (steps whose every segment replays: the decoder stack
may replay whole), `distinct_shapes` (distinct whole compositions).
`--policies a+b+c` deals the requests to several policies in turn (a mixed batch).
The group segments' cache: `group_entries` (segments made), `group_evictions`
(dropped by its bound, `--group-shapes`, the engine's
KVSIEVE_REGION_GROUP_SHAPES) and `group_recaptures` (made again after being
dropped): whether a mix's groups take turns among more shapes than it keeps.
`--first-sight 1` captures a key the first time (the engine's default since
2026-11-29); 0 the second time among the recent keys (the runs before).

`--rows-from STEPS.jsonl[.gz]` (a served step log, radix_ext/step_log.py)
replaces the steady workload below with the log's own: at each measured
step as many requests decode as the log's decode step had compressed
rows (requests join, or those nearest their end leave, to follow it), so
a traffic run's joins and ends drive the keys. Every run reports
`distinct_group_keys` and `new_group_keys_by_change`: each policy group
key seen for the first time, by what differs from the last key of the
same policy and action (its rows, its width, its maxima, its inputs'
names or shapes): which part of the key makes traffic's group captures.

Workload: `--rows` requests decoding at any time, each generating a length
drawn uniformly from [gen/2, 3 gen/2]; an ended request's successor joins
1-4 steps later (its prefill). The first requests start together with
lengths drawn from [1, 3 gen/2], and `gen` warm-up steps run before the
`--steps` measured, so rows are out of phase and past their budgets.
Prompts of 64 tokens kept in the radix cache, budget `--budget`.

    python bench/graph_buckets.py --rows 64 640 --steps 600 --out bench/results/graph-buckets-cpu.json
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import platform
import random
import time
from datetime import datetime, timezone
from types import SimpleNamespace

import torch

from kvsieve.policies import get_policy
from kvsieve.radix_ext import metrics  # noqa: F401  (the runtime records into it)
from kvsieve.radix_ext.pages import PageManager, RegionConfig
from kvsieve.radix_ext import region_graphs
from kvsieve.radix_ext.region_graphs import RegionGraphs, group_signature, signature
from kvsieve.radix_ext.runtime import RUNTIME
from kvsieve.radix_ext.step_meta import StepBuilder

LAYERS, HEADS, PROMPT = 4, 2, 64  # shapes do not enter the keys' behaviour; small keeps it fast


class DecodeMode:
    """A ForwardBatch's forward_mode in a decode step (the step builder asks only these)."""

    def is_decode(self):
        return True

    def is_extend(self):
        return False

    def is_idle(self):
        return False


def key_change(old: tuple, new: tuple) -> str:
    """Which parts of a policy group's key (region_graphs.group_signature)
    differ between two keys of the same policy and action: its rows, its
    page-table width, its parameter maxima, its inputs (names, or their
    shapes past the rows), or only which of two same-shaped groups it is."""
    (o_key, o_ordinal), (n_key, n_ordinal) = old, new
    changed = []
    if o_key[6][0][0] != n_key[6][0][0]:
        changed.append("rows")
    if o_key[2] != n_key[2]:
        changed.append("width")
    if o_key[3] != n_key[3]:
        changed.append("maxima")
    if o_key[4:6] != n_key[4:6]:
        changed.append("input names")
    elif [(s[1:], d) for s, d in o_key[6]] != [(s[1:], d) for s, d in n_key[6]]:
        changed.append("input shapes")
    if not changed and o_ordinal != n_ordinal:
        changed.append("ordinal")
    return " + ".join(changed) or "none"


def simulate(policy: str, rows: int, steps: int, gen: int, budget: int, buckets: bool, seed: int = 0,
             group_shapes: int | None = None, first_sight: bool = False,
             rows_trace: list[int] | None = None) -> dict:
    """One run. `rows_trace`: the rows decoding at each measured step (a
    served step log's decode batch sizes, read_rows_trace): requests join
    and end to follow it, as under traffic, instead of `rows` at all
    times; the run then lasts len(rows_trace) steps."""
    rng = random.Random(seed)
    if rows_trace:
        steps, rows = len(rows_trace), max(rows_trace)
    # "a+b+c": a mixed batch, requests dealt to the policies in turn.
    names = policy.split("+")
    classes = [get_policy(n) for n in names]
    pads_decisions = [c.pads_decisions for c in classes]
    for c, pads in zip(classes, pads_decisions):
        c.pads_decisions = pads and buckets
    max_gen = gen * 3 // 2 + 1
    pages_per_request = -(-(budget + 600) // 16) + 1  # crystal_kv keeps room for its answer (512)
    max_rows = rows + 8
    RUNTIME.requests.clear()
    RUNTIME.region = PageManager(RegionConfig(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=8,
                                              num_pages=(rows + 8) * pages_per_request * LAYERS * HEADS,
                                              page_size=16, max_rows=max_rows))
    RUNTIME.counters = torch.zeros((max_rows, 2), dtype=torch.int64)
    RUNTIME.overflow_flags = torch.zeros(max_rows, dtype=torch.bool)
    req_to_token = torch.zeros((max_rows, PROMPT + max_gen + 2), dtype=torch.int32)
    builder = StepBuilder(RUNTIME.region, req_to_token, "cpu", pad_rows=buckets)
    graphs = RegionGraphs(rerun=True)
    if group_shapes is not None:
        graphs.max_group_shapes = group_shapes
    graphs.first_sight = first_sight
    free_rows = list(range(max_rows - 1, 0, -1))  # row 0: SGLang's padding row
    live = {}  # rid -> [pool row, step, length]
    pending = []  # steps at which a successor joins
    counter = 0

    def join(shortest: int) -> None:
        nonlocal counter
        rid, row = f"r{counter}", free_rows.pop()
        length = rng.randint(shortest, gen * 3 // 2)
        RUNTIME.admit(rid, {"kv_policy": {"name": names[counter % len(names)], "budget": budget}}, prompt_len=PROMPT,
                      sgl_req=SimpleNamespace(req_pool_idx=row, to_finish=None))
        counter += 1
        req = RUNTIME.requests[rid]
        RUNTIME.reserve(req, 0, max_gen)
        req.prefix_len = PROMPT
        live[rid] = [row, 0, length]

    def follow(target: int) -> None:
        """Requests join or end (those nearest their end first) until `target` decode."""
        while len(live) < target:
            join(gen // 2)
        for rid in sorted(live, key=lambda r: live[r][2] - live[r][1])[:max(len(live) - target, 0)]:
            free_rows.append(live.pop(rid)[0])
            RUNTIME.end(rid)

    for _ in range(rows_trace[0] if rows_trace else rows):
        join(1)
    replayed = eager = padded = real = groups_seen = groups_replayed = whole = 0
    seen_group_keys, last_group_key = set(), {}
    new_group_keys: collections.Counter = collections.Counter()
    build_s = []  # host time of each measured step's StepBuilder.build
    keys = set()
    started = time.perf_counter()
    try:
        for s in range(-gen, steps):  # s < 0: warm-up, not counted
            if rows_trace:
                follow(rows_trace[max(s, 0)])
            for _ in [t for t in pending if t <= s]:
                join(gen // 2)
            pending = [t for t in pending if t > s]
            rids = list(live)
            seq = torch.tensor([PROMPT + live[r][1] + 1 for r in rids])
            batch = SimpleNamespace(rids=rids, forward_mode=DecodeMode(), seq_lens_cpu=seq, seq_lens=seq,
                                    req_pool_indices=torch.tensor([live[r][0] for r in rids]), positions=seq - 1,
                                    out_cache_loc=torch.zeros(len(rids), dtype=torch.int64))
            t0 = time.perf_counter()
            step = builder.build(batch)
            if s >= 0:
                build_s.append(time.perf_counter() - t0)
            region = step.region
            captured_before = list(graphs.cache.values())
            groups_before = {id(g) for g in graphs.groups.values()}
            graphs.begin_step(step, needs_keys=False)
            entry = graphs.current
            was_captured = entry is not None and any(e is entry for e in captured_before)
            group_hits = [g is not None and id(g) in groups_before for _, g in graphs.step_groups]
            if s >= 0:
                ordinal: collections.Counter = collections.Counter()
                for group in region.groups:
                    gkey = group_signature(group)
                    if gkey is None:
                        continue
                    key = (gkey, ordinal[gkey])
                    ordinal[gkey] += 1
                    kind = (gkey[0], gkey[1])
                    if key not in seen_group_keys:
                        seen_group_keys.add(key)
                        change = key_change(last_group_key[kind], key) if kind in last_group_key else "first"
                        new_group_keys[f"{gkey[0].removesuffix('Policy')} {gkey[1]}: {change}"] += 1
                    last_group_key[kind] = key
                replayed += was_captured
                eager += not was_captured
                groups_seen += len(region.groups)
                groups_replayed += sum(group_hits) if was_captured else 0
                whole += was_captured and len(group_hits) == len(region.groups) and all(group_hits)
                keys.add(graphs.composition if graphs.composition is not None else signature(step, False))
                padded += region.pool_rows.shape[0] - region.real
                real += region.real
            for r in rids:
                live[r][1] += 1
                if live[r][1] >= live[r][2]:
                    row = live.pop(r)[0]
                    RUNTIME.end(r)
                    free_rows.append(row)
                    if not rows_trace:  # a successor joins 1-4 steps later (its prefill)
                        pending.append(s + rng.randint(1, 4))
    finally:
        for r in list(live):
            RUNTIME.end(r)
        RUNTIME.region = None
        for c, pads in zip(classes, pads_decisions):
            c.pads_decisions = pads
    return {"policy": policy, "rows": rows, "mode": "buckets" if buckets else "exact", "steps": steps,
            "replayed_share": round(replayed / steps, 4), "eager_steps": eager,
            "group_replayed_share": round(groups_replayed / max(groups_seen, 1), 4),
            "whole_step_share": round(whole / steps, 4), "groups_per_step": round(groups_seen / steps, 2),
            "distinct_shapes": len(keys), "graph_resets": graphs.resets, "group_shapes": graphs.max_group_shapes,
            "first_sight": first_sight, "group_entries": graphs.group_entries,
            "group_evictions": graphs.group_evictions, "group_recaptures": graphs.group_recaptures,
            "rows_traced": bool(rows_trace), "distinct_group_keys": len(seen_group_keys),
            "new_group_keys_by_change": dict(new_group_keys.most_common()),
            "padded_row_share": round(padded / max(real, 1), 4), "host_seconds": round(time.perf_counter() - started, 1),
            "build_ms_per_step": round(1000 * sum(build_s) / len(build_s), 2),
            "build_ms_p50": round(1000 * sorted(build_s)[len(build_s) // 2], 2)}


def read_rows_trace(path: str) -> list[int]:
    """The compressed rows of each decode step of a kvsieve step log
    (radix_ext/step_log.py), in order: a served run's joins and ends."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    trace = [line["region"] - line.get("pool_only", 0) for line in lines
             if line.get("mode") == "decode" and line.get("region")]
    if not trace:
        raise SystemExit(f"{path}: no decode step with compressed rows")
    return trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 640])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--gen", type=int, default=512, help="mean generated tokens per request")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--policies", default="streaming,h2o,rkv,skipkv,crystal_kv,thinkv")
    ap.add_argument("--modes", default="exact,buckets", help="exact, buckets or both")
    ap.add_argument("--group-shapes", type=int, nargs="+", default=[region_graphs.MAX_GROUP_SHAPES],
                    help="bounds of the group segments' cache to run (KVSIEVE_REGION_GROUP_SHAPES)")
    ap.add_argument("--first-sight", type=int, choices=(0, 1), default=0)
    ap.add_argument("--rows-from", default=None,
                    help="a served step log (.jsonl[.gz]): its decode steps' rows, in order, replace --rows/--steps")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the host side of one step: one thread, as the scheduler runs it
    trace = read_rows_trace(args.rows_from) if args.rows_from else None
    if trace:
        args.rows = [max(trace)]
    results = []
    for rows in args.rows:
        for policy in args.policies.split(","):
            for buckets in [m == "buckets" for m in args.modes.split(",")]:
                for bound in args.group_shapes:
                    r = simulate(policy, rows, args.steps, args.gen, args.budget, buckets, group_shapes=bound,
                                 first_sight=bool(args.first_sight), rows_trace=trace)
                    results.append(r)
                    print(json.dumps(r), flush=True)
    if args.out:
        doc = {"date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
               "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads (CPU; host side only)",
               "command": "python bench/graph_buckets.py " + " ".join(
                   [*([] if trace else [f"--rows {' '.join(map(str, args.rows))}", f"--steps {args.steps}"]),
                    f"--gen {args.gen}",
                    f"--budget {args.budget}", f"--policies {args.policies}", f"--modes {args.modes}",
                    f"--group-shapes {' '.join(map(str, args.group_shapes))}", f"--first-sight {args.first_sight}",
                    *([f"--rows-from {args.rows_from}"] if args.rows_from else []), f"--out {args.out}"]),
               "results": results}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
