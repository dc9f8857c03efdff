"""Why decode steps under traffic leave the replayed decoder stack: the slow
steps of a kvsieve step log (radix_ext/step_log.py, KVSIEVE_STEP_LOG), what
changed in each, and how many a coarser key or another capture rule would
leave (issue #29: what a mixed batch loses).

    python bench/capture_churn.py STEPS.jsonl[.gz] [--out churn.json]

A decode step replays the whole stack only where the shapes of its attention
segment (padded rows, page-table width, prefix width, observations asked,
the observed slots: region_graphs.signature) were captured before, and the
first time such shapes show up among the last RECENT_KEYS steps the step
runs eagerly; the second time it captures. Per decode step kind (the step
log's own classification: eager, segment_capture, stack_capture, ...) this
reports steps and seconds, and for each step that is not a replay which of
the attention key's fields differ from the decode step before it (none: the
second sighting of shapes first seen in an eager step, or a composition
reaching its repeats). `what_if` replays the log's sequence of attention
keys through a model of that rule (an LRU of MAX_SHAPES entries, captured
at the second sighting within RECENT_KEYS steps, all dropped when the width
changes): as logged, with the step's rows bucketed coarser, and with
capture at first sight. The model covers the attention key only (not group
segments nor the stack's composition repeats): its counts compare rules
with each other, not with the engine's. `compiles` lists the Triton
compiles the log recorded past its first decode step that took at least
SLOW_COMPILE_S (the rest are loads from Triton's cache): each is a step of
a second or so in the middle of serving.

`time_budget` splits the decode seconds into the steady part (every step
at the median step's time: what a steady-window benchmark measures) and
the excess of the slower steps, by cause: the step's kind when it is not a
replay (a capture, an eager step; `captures_after_resets_s`: the part of
those within RESET_WINDOW steps of a graph reset, which a width change
causes), else `host metadata` (its meta_ms over
HOST_SPIKE times the median: a host read waiting for the GPU, a policy's
host work such as CrystalCache's breath cycle), `host groups`
(host_groups_ms likewise: groups run eagerly after the stack) or `other`.
It says why a whole run's tokens/s and a steady window's differ (issue
#29 asks for both).

    python bench/capture_churn.py STEPS.jsonl --profile STEP_PROFILE.json

cuts a log written through a `bench/step_profile.py` call (one engine,
its runs one after another) by each run's `wall_clock`: per run, the same
analysis of its ramp and of the rest (`runs`), e.g. which captures and
compiles a mixed batch's ramp pays that its members' do not.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics
import sys
from pathlib import Path

from kvsieve.policies import Need, get_policy
from kvsieve.radix_ext import region_graphs
from kvsieve.radix_ext.step_log import _kind

#: Decode step kinds that replay what was captured before.
REPLAYS = ("stack_replay", "segments_replay")
KEY_FIELDS = ("padded", "width", "prefix", "observed_slots", "classes")
#: A compile entry this long compiled; shorter ones loaded a cached kernel (~1-10 ms).
SLOW_COMPILE_S = 0.05


def read_steps(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def attention_key(line: dict) -> dict:
    """The fields of a decode step's attention key the log records; the
    observations asked follow from the policy classes with a group."""
    classes = tuple(sorted({name for name, _ in line.get("group_widths", ())}))
    return {"padded": line["padded"], "width": line["width"], "prefix": line["prefix"],
            "observed_slots": line["observed_slots"], "classes": classes}


def needs_of(classes: tuple) -> tuple:
    needs = later = Need.NONE
    for name in classes:
        policy = get_policy(name)
        needs |= policy.needs
        if not policy.observes_first_layer_only:
            later |= policy.needs
    return needs.value, later.value


def two_per_doubling(rows: int) -> int:
    """Rows up to 32 by 16, then two buckets per power of two (48, 64, 96, 128, 192, ...)."""
    if rows <= 32:
        return -(-rows // 16) * 16
    step = 1 << ((rows - 1).bit_length() - 2)
    return -(-rows // step) * step


def power_of_two(rows: int) -> int:
    return max(16, 1 << (rows - 1).bit_length())


BUCKETS = {"as logged": lambda rows: rows, "two per doubling": two_per_doubling, "power of two": power_of_two}


def simulate(keys: list[dict], bucket, first_sight: bool) -> dict:
    """Steps the model runs eagerly, captures and replays for this sequence of keys."""
    cache: "collections.OrderedDict[tuple, None]" = collections.OrderedDict()
    recent: "collections.OrderedDict[tuple, None]" = collections.OrderedDict()
    width = None
    counts = {"eager": 0, "capture": 0, "replay": 0, "extra_rows": 0}
    for k in keys:
        rows = bucket(k["padded"])
        counts["extra_rows"] += rows - k["padded"]
        key = (rows, k["width"], k["prefix"], k["observed_slots"], needs_of(k["classes"]))
        if k["width"] != width:
            cache.clear()
            width = k["width"]
        seen = key in recent
        recent[key] = None
        recent.move_to_end(key)
        while len(recent) > region_graphs.RECENT_KEYS:
            recent.popitem(last=False)
        if key in cache:
            cache.move_to_end(key)
            counts["replay"] += 1
        elif seen or first_sight:
            cache[key] = None
            counts["capture"] += 1
            while len(cache) > region_graphs.MAX_SHAPES:
                cache.popitem(last=False)
        else:
            counts["eager"] += 1
    counts["mean_extra_rows"] = round(counts.pop("extra_rows") / max(1, len(keys)), 1)
    return counts


def compiles_while_serving(lines: list[dict]) -> list[dict]:
    """Compiles of SLOW_COMPILE_S or more recorded at or after the first
    decode step: (step index, mode, rows, kernel, seconds)."""
    first = next((i for i, x in enumerate(lines) if x.get("mode") == "decode"), len(lines))
    return [{"step": i, "mode": x.get("mode"), "bs": x.get("bs"), "kernel": c["kernel"], "s": c["s"],
             **({"key": c["key"]} if "key" in c else {})}
            for i, x in enumerate(lines[first:], start=first) for c in x.get("compiles", ())
            if c.get("s", 0) >= SLOW_COMPILE_S]


#: Decode steps after a graph reset (the page table's width changed:
#: region_graphs.reset drops every graph) whose captures time_budget
#: counts as the reset's (`captures_after_resets_s`).
RESET_WINDOW = 64

#: A replayed step whose host metadata or groups took this many times the
#: median is counted as slow for that reason (time_budget).
HOST_SPIKE = 3.0


def decode_steps(lines: list[dict]) -> list[tuple[dict, str, float]]:
    """Each decode step with compressed rows: its log line, its kind
    (step_log._kind, from the counters' change up to the next forward)
    and its seconds (the next forward's start minus its own)."""
    steps = []
    for line, after in zip(lines, lines[1:]):
        if line.get("mode") != "decode" or "region" not in line:
            continue
        before, later = line.get("counters", {}), after.get("counters", {})
        delta = {k: later.get(k, 0) - before.get(k, 0) for k in later}
        steps.append((line, _kind(line, delta), after["t"] - line["t"]))
    return steps


def time_budget(lines: list[dict]) -> dict:
    """The decode seconds as steady steps (each at the median step time)
    plus the excess of the slower ones, by cause, minus what the faster
    ones saved (`below_median_s`: under traffic a step of few rows is far
    below the median, so the steady seconds can exceed the whole);
    tokens/s of the whole run and at the median step."""
    steps = decode_steps(lines)
    if not steps:
        return {}
    median = statistics.median(s for _, _, s in steps)
    meta = statistics.median(line.get("meta_ms", 0.0) for line, _, _ in steps)
    groups = statistics.median(line.get("host_groups_ms", 0.0) for line, _, _ in steps)
    excess: dict = collections.Counter()
    after_reset = below = 0.0
    last_reset = None
    # A reset happens in a step's begin_step, before its line's counters are read.
    resets_before = {id(b): a.get("counters", {}).get("resets", 0) for a, b in zip(lines, lines[1:])}
    for i, (line, kind, seconds) in enumerate(steps):
        if line.get("counters", {}).get("resets", 0) > resets_before.get(id(line), 0):
            last_reset = i
        if seconds - median <= 1e-6:  # at or below the median, to the clock's rounding
            below += max(median - seconds, 0.0)
            continue
        if kind not in REPLAYS and last_reset is not None and i - last_reset < RESET_WINDOW:
            after_reset += seconds - median
        if kind not in REPLAYS:
            cause = kind
        elif line.get("meta_ms", 0.0) > HOST_SPIKE * max(meta, 1e-3):
            cause = "host metadata"
        elif line.get("host_groups_ms", 0.0) > HOST_SPIKE * max(groups, 1e-3):
            cause = "host groups"
        else:
            cause = "other"
        excess[cause] += seconds - median
    total = sum(s for _, _, s in steps)
    tokens = sum(line["bs"] for line, _, _ in steps)
    rows = statistics.median(line["bs"] for line, _, _ in steps)
    return {"median_step_ms": round(1000 * median, 2), "decode_s": round(total, 3),
            "steady_s": round(median * len(steps), 3),
            "excess_s": {k: round(v, 3) for k, v in excess.most_common()}, "below_median_s": round(below, 3),
            "captures_after_resets_s": round(after_reset, 3),
            "whole_run_tokens_per_s": round(tokens / total, 1) if total else None,
            "median_step_tokens_per_s": round(rows / median, 1) if median else None}


def between(lines: list[dict], start: float, end: float) -> list[dict]:
    """The log's forwards that started in [start, end) (epoch seconds)."""
    return [x for x in lines if start <= x.get("t", -1.0) < end]


def runs_of_profile(lines: list[dict], profile: dict) -> dict:
    """Each step_profile run's ramp and the rest after it, analysed apart
    (runs without `wall_clock`, older results, are left out)."""
    out = {}
    for label, run in profile.get("runs", {}).items():
        wall = run.get("wall_clock")
        if wall:
            out[label] = {"ramp": churn(between(lines, wall["start"], wall["ramp_end"])),
                          "after_ramp": churn(between(lines, wall["ramp_end"], wall["end"]))}
    return out


def churn(lines: list[dict]) -> dict:
    decode = [x for x in lines if x.get("mode") == "decode" and "region" in x]
    kinds: dict = {}
    causes: dict = collections.defaultdict(collections.Counter)
    previous = None
    for line, kind, seconds in decode_steps(lines):
        entry = kinds.setdefault(kind, {"steps": 0, "s": 0.0})
        entry["steps"] += 1
        entry["s"] += seconds
        key = attention_key(line)
        if kind not in REPLAYS and previous is not None:
            changed = [f for f in KEY_FIELDS if key[f] != previous[f]]
            causes[kind][" + ".join(changed) or "none (second sighting or composition repeats)"] += 1
        previous = key
    total = sum(k["s"] for k in kinds.values())
    for entry in kinds.values():
        entry["share_of_decode_s"] = round(entry["s"] / total, 3) if total else None
        entry["ms_per_step"] = round(1000 * entry["s"] / entry["steps"], 1)
        entry["s"] = round(entry["s"], 3)
    slow = [k for k in kinds if k not in REPLAYS]
    keys = [attention_key(x) for x in decode]
    return {
        "decode_steps": len(decode),
        "kinds": kinds,
        "slow_steps": sum(kinds[k]["steps"] for k in slow),
        "slow_share_of_decode_s": round(sum(kinds[k]["s"] for k in slow) / total, 3) if total else None,
        "what_changed": {k: dict(v.most_common()) for k, v in causes.items()},
        "what_if": {f"{name}, {'first' if first else 'second'} sight": simulate(keys, bucket, first)
                    for name, bucket in BUCKETS.items() for first in (False, True)},
        "compiles": compiles_while_serving(lines),
        "time_budget": time_budget(lines),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("steps", help="a kvsieve step log (.jsonl, or .jsonl.gz)")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    ap.add_argument("--profile", default=None,
                    help="a step_profile.py result whose runs wrote the log: each run's ramp and rest apart")
    args = ap.parse_args()
    lines = read_steps(args.steps)
    result = {"step_log": args.steps, **churn(lines)}
    if args.profile:
        result["runs"] = runs_of_profile(lines, json.loads(Path(args.profile).read_text()))
        for label, phases in result["runs"].items():
            for phase, r in phases.items():
                slow = {k: v["s"] for k, v in r["kinds"].items() if k not in REPLAYS}
                print(f"{label[:40]:40s} {phase:10s} {r['decode_steps']:5d} decode steps, "
                      f"{r['time_budget'].get('decode_s', 0):6.2f} s; not replays {slow}; "
                      f"compiles {len(r['compiles'])}")
    print(f"{result['decode_steps']} decode steps; {result['slow_steps']} not replays, "
          f"{100 * (result['slow_share_of_decode_s'] or 0):.0f}% of the decode seconds")
    for kind, entry in sorted(result["kinds"].items(), key=lambda kv: -kv[1]["s"]):
        print(f"  {kind:22s} {entry['steps']:6d} steps {entry['s']:8.2f} s {entry['ms_per_step']:7.1f} ms/step")
    for kind, changed in result["what_changed"].items():
        print(f"  {kind}: " + ", ".join(f"{n} {c}" for c, n in changed.items()))
    print("  model of the attention key's rule (eager / capture / replay, mean extra rows):")
    for rule, counts in result["what_if"].items():
        print(f"    {rule:30s} {counts['eager']:5d} {counts['capture']:5d} {counts['replay']:6d} "
              f"{counts['mean_extra_rows']:6.1f}")
    slow = result["compiles"]
    print(f"  compiles while serving (>= {SLOW_COMPILE_S} s): {len(slow)}"
          + "".join(f"\n    step {c['step']} ({c['mode']}, {c['bs']} rows): {c['kernel']} {c['s']:.2f} s" for c in slow))
    budget = result["time_budget"]
    if budget:
        print(f"  time: {budget['decode_s']:.2f} s = {budget['steady_s']:.2f} s at the median step "
              f"({budget['median_step_ms']:.2f} ms) + excess: "
              + ", ".join(f"{k} {v:.2f} s" for k, v in budget["excess_s"].items()))
        print(f"  of the excess, captures within {RESET_WINDOW} steps of a graph reset (a width change): "
              f"{budget['captures_after_resets_s']:.2f} s")
        print(f"  tokens/s: whole run {budget['whole_run_tokens_per_s']}, "
              f"at the median step {budget['median_step_tokens_per_s']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print("->", args.out)


if __name__ == "__main__":
    sys.exit(main())
