"""A log of every forward of the compressed path, to find where a serving
run's time goes: prefills against decodes, decode steps replayed whole,
replayed per segment, capturing or eager, and how often the region graphs
start over (bench/traffic.py summarises it per arrival rate).

Off unless KVSIEVE_STEP_LOG names a file. Each forward appends one JSON
line when its metadata is built, before it runs:

    t        wall clock (s) at the forward's start
    mode     "decode", "extend" or "other"
    bs       rows of the batch; tokens: tokens it computes (extend)
    region   compressed rows in the region (before padding); padded: after
    width    page-table columns of the step (decode)
    groups   policy groups of the step; eager_groups: those with no graph
    counters cumulative region/forward graph counters at the forward's start
    meta_ms  host time spent building the step's metadata (init_forward_metadata)
    host_stack_ms, host_groups_ms  host time in the decoder stack's call and
             in the deferred groups and TBQ flush after it (where whole-stack
             graphs run: forward_graphs.after_stack)
    gpu_stack_ms, gpu_groups_ms  GPU time of the same two parts (CUDA events,
             read when the next forward starts; absent on CPU)
    compiles Triton kernels compiled during the forward, [{kernel, s}]
             (radix_ext/compile_watch.py; absent where none compiled)

A line is written when the next forward starts (its times are known then).
A forward's duration is the next line's t minus its own (the scheduler
starts the next forward once this one's tokens are sampled), and what the
graphs did in it is the next line's counters minus its own. Summaries are
meant for windows in which the server is busy (a rate's arrivals while
requests are in flight): a gap while idle would count as a step. Batches
SGLang replays from its own graphs (no compressed row) log nothing; their
time goes to the forward before them.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import torch

from .compile_watch import CompileWatch

ENV = "KVSIEVE_STEP_LOG"
#: Forwards slower than this are counted apart (a Triton compile, an eager
#: pass over new shapes, a capture).
SLOW_S = 1.0
COUNTERS = ("captures", "replays", "group_captures", "group_replays", "resets", "group_entries", "group_evictions",
            "group_recaptures", "group_stale", "table_version")
#: The per-part times a line may carry (record, _write_pending).
TIMED = ("meta_ms", "host_stack_ms", "host_groups_ms", "gpu_stack_ms", "gpu_groups_ms")


class StepLog:
    def __init__(self, path: str):
        # Line-buffered: a reader sees every finished forward (a write per
        # forward costs microseconds against steps of milliseconds); a
        # scheduler killed at shutdown loses only the forward in flight.
        self.file = open(path, "a", buffering=1)
        self.pending: Optional[dict] = None  # this forward's line, written when the next one starts
        self.marks: dict = {}  # name -> (host perf_counter, CUDA event or None)
        self.compiles = CompileWatch().install()

    @classmethod
    def from_env(cls) -> Optional["StepLog"]:
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def mark(self, name: str) -> None:
        """A point of this forward: "forward" (its metadata built), "stack"
        (the decoder stack returned), "end" (the groups after it ran)."""
        if self.pending is None:
            return
        event = None
        if torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks[name] = (time.perf_counter(), event)

    def _write_pending(self) -> None:
        line, marks = self.pending, self.marks
        self.pending, self.marks = None, {}
        if line is None:
            return
        for field, start, end in (("stack", "forward", "stack"), ("groups", "stack", "end")):
            if start in marks and end in marks:
                (t0, e0), (t1, e1) = marks[start], marks[end]
                line[f"host_{field}_ms"] = round(1000 * (t1 - t0), 3)
                if e0 is not None and e1 is not None and e1.query():
                    line[f"gpu_{field}_ms"] = round(e0.elapsed_time(e1), 3)
        compiled = self.compiles.take()
        if compiled:
            line["compiles"] = compiled
        self.file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def record(self, forward_batch, step, graphs, forward_graphs, meta_ms: Optional[float] = None) -> None:
        self._write_pending()
        mode = forward_batch.forward_mode
        line = {"t": round(time.time(), 6),
                "mode": "decode" if mode.is_decode() else "extend" if mode.is_extend() else "other",
                "bs": int(forward_batch.batch_size)}
        if mode.is_extend():
            lens = getattr(forward_batch, "extend_seq_lens_cpu", None)
            if lens is not None:
                line["tokens"] = int(sum(lens))
        region = step.region if step is not None else None
        if region is not None:
            line.update(region=region.real, padded=int(region.pool_rows.shape[0]),
                        width=int(region.tables.shape[3]), groups=len(region.groups), pool_only=region.pool_only,
                        prefix=int(region.prefix_slots.shape[1]), observed_slots=region.observed_slots,
                        group_widths=sorted({(g.policy.name, g.width) for g in region.groups}))
            if graphs is not None:
                line["deferred"] = graphs.defer_step
        if graphs is not None:
            line["counters"] = {name: getattr(graphs, name) for name in COUNTERS}
            if graphs.current is not None:
                line["eager_groups"] = sum(entry is None for _, entry in graphs.step_groups)
            if forward_graphs is not None:
                line["counters"].update(forward_captures=forward_graphs.captures,
                                        forward_replays=forward_graphs.replays)
        if meta_ms is not None:
            line["meta_ms"] = round(meta_ms, 3)
        self.pending = line

    def close(self) -> None:
        self._write_pending()
        self.file.close()


def read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _kind(line: dict, delta: dict) -> str:
    """What the graphs did in one decode step of compressed rows."""
    if delta.get("forward_captures", 0):
        return "stack_capture"
    if delta.get("forward_replays", 0):
        # Groups deferred past the replayed stack capture their segments
        # when their shape is new (e.g. a policy's first decision).
        return "group_capture" if delta.get("group_captures", 0) else "stack_replay"
    if delta.get("captures", 0) or delta.get("group_captures", 0):
        return "segment_capture"
    if delta.get("replays", 0):
        return "segments_partly_eager" if line.get("eager_groups") else "segments_replay"
    return "eager"


def summarize(lines: list[dict], start: float | None = None, end: float | None = None) -> dict:
    """Where the time of the forwards between wall-clock `start` and `end`
    went: per mode and, for decode steps with compressed rows, per kind of
    graph use (seconds, steps, ms per step), with the region graphs' resets
    and the widths seen."""
    lines = [x for x in lines if (start is None or x["t"] >= start) and (end is None or x["t"] < end)]
    out = {"forwards": len(lines), "modes": {}, "decode_kinds": {}}
    widths, regions = set(), []
    compiles = {"count": 0, "s": 0.0, "kernels": {}}
    for line in lines:
        for c in line.get("compiles", ()):
            compiles["count"] += 1
            compiles["s"] += c.get("s") or 0.0
            compiles["kernels"][c["kernel"]] = compiles["kernels"].get(c["kernel"], 0) + 1
    compiles["s"] = round(compiles["s"], 3)
    out["compiles"] = compiles

    def add(groups: dict, name: str, took: float) -> dict:
        group = groups.setdefault(name, {"steps": 0, "s": 0.0, "max_ms": 0.0, "slow": 0})
        group["steps"] += 1
        group["s"] += took
        group["max_ms"] = max(group["max_ms"], round(1000 * took, 1))
        group["slow"] += took > SLOW_S
        return group

    for line, after in zip(lines, lines[1:]):
        took = after["t"] - line["t"]
        mode = add(out["modes"], line["mode"], took)
        mode["tokens"] = mode.get("tokens", 0) + line.get("tokens", 0)
        if line["mode"] == "decode" and "region" in line:
            before, later = line.get("counters", {}), after.get("counters", {})
            delta = {k: later.get(k, 0) - before.get(k, 0) for k in later}
            kind = add(out["decode_kinds"], _kind(line, delta), took)
            for field in TIMED:
                if field in line:
                    kind.setdefault("_sums", {}).setdefault(field, [0.0, 0])
                    kind["_sums"][field][0] += line[field]
                    kind["_sums"][field][1] += 1
            widths.add(line["width"])
            regions.append(line["region"])
    for group in (*out["modes"].values(), *out["decode_kinds"].values()):
        group["ms_per_step"] = round(1000 * group["s"] / group["steps"], 2) if group["steps"] else None
        # Where a step's time went, per part (means over the steps that logged it).
        for field, (total, n) in group.pop("_sums", {}).items():
            group[f"{field}_mean"] = round(total / n, 2)
        group["s"] = round(group["s"], 3)
    if len(lines) >= 2:
        first, last = lines[0].get("counters", {}), lines[-1].get("counters", {})
        out["graph_counters"] = {k: last.get(k, 0) - first.get(k, 0) for k in last}
    out["decode_widths"] = sorted(widths)
    out["decode_region_rows_mean"] = round(sum(regions) / len(regions), 1) if regions else None
    return out
