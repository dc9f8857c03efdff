"""Where a kvsieve decode step's time goes, at the headline's shape, in one device call:

    python bench/step_profile.py MODEL_DIR OUT_DIR [--policy streaming[,rkv,...]] [--budget 1024]
        [--requests 512] [--steps 16] [--policy-params '{"crystal_kv": {...}}'] [--stack 0|1]
        [--mixed 0|1] [--mixed-only 0|1] [--mixed-first 0|1] [--device cuda|cpu] [--kv-tokens 786432]
        [--solo h2o,rkv] [--ranges 0|1] [--window-steps 64] [--gen-extra 192] [--pyspy SECONDS]
        [--activities CPU,GPU|GPU] [--warmup 1|0] [--resume 0|1] [--log-level warning|info]
        [--out step-profile.json]

Starts the kvsieve engine exactly as bench/gpu_headline.py does (dummy
weights, the same KV split). For each policy in turn, runs --requests
requests of 64-token prompts under it; once every request holds budget + 32
generated tokens (each step evicts or decides, as in the headline's window)
it measures the unprofiled throughput over 64 steps (--window-steps), then asks SGLang's
scheduler for a torch-profiler trace of --steps steps (16 covers one
decision of the policies that decide every 16 steps). The trace is
summarized on the spot: the GPU's busy share of the profiled span (union of
kernel intervals), idle gaps, the kernels by total time, and the host's
top-level operations (Python stacks with --stack 1: they slow the host
several times over, so the host share is then overstated). Writes
OUT_DIR/step-profile.json after every policy, under `runs` (the traces stay
on the device: they are large).

The engine runs with KVSIEVE_PROFILE_RANGES=1 (radix_ext/
profiling.py), so the summary splits the step by what the GPU ran inside each
named range: `split_per_step_ms` gives the attention kernel
(kvsieve.attend), the region writes (kvsieve.store + kvsieve.evict), the
slot gathers a decision reads (kvsieve.view), each policy's decision
(kvsieve.decide.<policy>), the model's own layers (every other kernel) and
the host's share (the step's span minus the GPU's busy time), with the host
ranges (step metadata, each policy's step_inputs) beside it. Ranges are not
recorded inside a CUDA-graph replay, so while the profiler records, the
region's pass runs eagerly (radix_ext/profiling.recording): the profiled
steps are slower than the unprofiled ones, whose throughput (region graphs
on, as served) is reported beside them. `--ranges 0` leaves the ranges
off: the profiled steps then replay their graphs as served, and the
trace's kernel list (`kernels`) is what a replayed step runs on the GPU,
without the split. `gap_causes` says why the GPU idled between operations
(the next one's launch came late from the host, or it had been launched
and waited on an event or stream) and names the host's blocking calls;
`--activities GPU` records no host operations, so the profiled host runs
nearly at its unprofiled speed and the gaps are the served step's.
`per_policy_ranges_ms` lists every
policy of the run with its decide and observe GPU ms per step and its host
step_inputs ms (0.0 where the trace has no such range: `full` runs
SGLang's path, snapkv decides at prefill only); `policies_without_ranges`
names those.

`--warmup 1` (default): before the recorded runs, one unrecorded batch of
the same --requests with every listed policy dealt round robin, run to its
end (recorded only as `warmup`: its members, ramp and whole-run seconds).
A fresh engine's one-off work (its first prefills, the first capture of
each policy's graph shapes) then lands in no recorded run: without it
whichever run came first paid it in its ramp (the eight-policy mix run
first: ramp 0.78x its members, run last 0.91x;
bench/results/logs/h200-2026-12-02f/README.md). What a served engine
does once in its life is not a batch's cost.

A policy's budget is --budget unless it refuses it: then the smallest
larger one it accepts (bench/gpu_smoke.py's policy_specs; crystalcache needs
at least 132), recorded in `policies`.

Mixed batch (issue #29: a mixed batch of policies as fast as its members).
`--mixed 1`: after the solo runs, ONE batch of --requests requests with the
listed policies dealt round robin (request i runs policy i mod P, each with
its own budget and --policy-params), profiled the same way (the window opens
once every request holds the largest budget + 32 tokens; every request
generates the largest budget + --gen-extra), recorded under `runs` as
`mixed:a+b+c`. `--solo a,b`: only these of the listed policies run alone
(default: each). `--mixed-only 1`: the mixed run only; the members' solo runs
are then taken from OUT_DIR's existing JSON when its budget, requests,
kv_tokens and device match (a second call after a solo one), and are
otherwise missing from the comparison. `--resume 1`: the same for any
list of runs across calls: OUT_DIR's existing JSON, when it was made with
the same budget, requests, kv_tokens, device, policy params, gen-extra and
window, keeps its runs, and a run it already holds is not run again (a
scale whose nine runs outlast one 10-minute device call runs over two or
three, the earlier JSON copied into OUT_DIR first; `resumed_from` lists
the earlier calls' commands and dates). The JSON's `comparison` block: the
mixed run's unprofiled tokens/s, each member's solo tokens/s, their
harmonic mean weighted by the member's rows in the mixed batch (the mixed
batch's speed if each row cost what it costs in its solo batch of the same
size: mixed step time = the rows' share-weighted mean of the solo step
times) and mixed / that mean (1.0: as fast as its members). `whole_run`:
the same over each run's whole generation, wall clock from its first
request to the batch's end (`tokens_per_s_whole_run`: the issue's other
method; with --steps the profiled steps are in it, named there), and
`methods_agree_within_10pct` for the two ratios.

Every run also records `graphs`: kvsieve's CUDA-graph counters
(radix_ext/metrics.py: kvsieve_decode_graph_captures and
kvsieve_decode_graph_replays, graph=region counted at layer 0 of a step's
compressed pass, graph=forward once per whole-forward replay) over the
unprofiled window, read from the scheduler process through prometheus'
multiprocess files (PROMETHEUS_MULTIPROC_DIR, set before the engine starts
as bench/gpu_smoke.py does): captures and replays in the window, steps in
the window (generated tokens / requests), `region_replays_per_step` and
`forward_replays_per_step`. A step replays either its whole forward or its
region pass per layer, so their sum near 1.0 says the run's steps replay
graphs; near 0, they run eagerly (region captures in the window: shapes
still being captured).

For #29, one call on an H100 (estimated 6-8 minutes with the device set-up:
four runs of about 1,300 steps at 320 rows; not yet run on a GPU). Build the
wheel first, `pip wheel --no-deps . -w .gpu/`, and carry `.whl` and `.gpu`
as for bench/gpu_smoke.py:

    bash .whl/device-setup.sh && python3 -m pip install -q --no-deps --target /tmp/site2 .gpu/*.whl && PYTHONPATH=/tmp/site2:/tmp/site python3 bench/step_profile.py bench/models/r1-distill-qwen-7b $OUT --policy streaming,rkv,skipkv --mixed 1 --budget 1024 --requests 320 --steps 16 --out step-profile-mixed.json

Host sampling (#29: where a mixed step's host time goes): `--pyspy S`
runs py-spy on the scheduler's process for S seconds from the unprofiled
window's start, Python frames only and without pausing it (py-spy on the
PATH or in /tmp/site2/bin); each run then records `pyspy`, the main
thread's shares by function, wait and leaf line (bench/pyspy_summary.py),
and the raw stacks stay in /tmp/kvsieve-trace. Give the batch steps to
sample: `--gen-extra` (tokens each request generates past the largest
budget, default 192) and `--window-steps` (the unprofiled window, default
64), with `--steps 0` so no profiler runs inside the sample.

On CPU (`--device cpu`; MODEL_DIR `tiny` builds tests/tiny_models.py's
Llama), the same runs without a profile (--steps 0; defaults --requests 4
--budget 16 --kv-tokens 16384): a logic check, e.g.

    python bench/step_profile.py tiny /tmp/sp --device cpu --policy streaming,h2o --mixed 1
"""

from __future__ import annotations

import asyncio
import bisect
import glob
import gzip
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_headline as headline  # noqa: E402  (same engine setup and prompts)
import gpu_smoke as smoke  # noqa: E402  (policy_specs: budgets a policy accepts; the tiny CPU model)


#: Tokens past the budget every row holds before the window starts (each
#: step then evicts or decides, as in the headline's window).
RAMP_TOKENS = 32


def options(argv: list[str] | None = None) -> dict:
    argv = sys.argv if argv is None else argv
    opts = dict(zip(argv[3::2], argv[4::2]))
    device = opts.get("--device", "cuda")
    cuda = device == "cuda"
    mixed_only = opts.get("--mixed-only", "0") == "1"
    cfg = {"policy": opts.get("--policy", "streaming"), "budget": int(opts.get("--budget", 1024 if cuda else 16)),
           "requests": int(opts.get("--requests", 512 if cuda else 4)),
           "steps": int(opts.get("--steps", 16)) if cuda else 0,
           "kv_tokens": int(opts.get("--kv-tokens", 786432 if cuda else 16384)),
           "out": opts.get("--out", "step-profile.json"),
           "policy_params": json.loads(opts.get("--policy-params", "{}")), "stack": opts.get("--stack", "0") == "1",
           "mixed": opts.get("--mixed", "0") == "1" or mixed_only, "mixed_only": mixed_only, "device": device,
           "mixed_first": opts.get("--mixed-first", "0") == "1",
           "window_steps": int(opts.get("--window-steps", 64)), "gen_extra": int(opts.get("--gen-extra", 192)),
           "pyspy_s": int(opts.get("--pyspy", 0)), "solo": opts.get("--solo", ""),
           "ranges": opts.get("--ranges", "1") == "1",
           "activities": opts.get("--activities", "CPU,GPU").split(","),
           "warmup": opts.get("--warmup", "1") == "1", "resume": opts.get("--resume", "0") == "1",
           # info: SGLang logs each prefill batch and every 40th decode step
           # (running and queued requests): when a row was admitted, and why not sooner.
           "log_level": opts.get("--log-level", "warning")}
    if cfg["gen_extra"] <= RAMP_TOKENS:
        # Rows would end before the window's threshold (budget + 32): the ramp would wait forever.
        raise SystemExit(f"--gen-extra must be above {RAMP_TOKENS}: the window starts at budget + {RAMP_TOKENS} tokens")
    return cfg


#: The warm-up batch's prompt seed: none of the recorded runs' (7 and up),
#: so no recorded run starts on its radix cache hits.
WARMUP_SEED = 1


def mixed_label(names: list[str]) -> str:
    return "mixed:" + "+".join(names)


def run_label(members: list[str]) -> str:
    """A run's key under `runs`: the policy's name alone, else the mix's label."""
    return members[0] if len(members) == 1 else mixed_label(members)


def deal(names: list[str], n: int) -> list[str]:
    """The policy of each of n requests: round robin."""
    return [names[i % len(names)] for i in range(n)]


def harmonic_mean(values: list[float], weights: list[float] | None = None) -> float:
    weights = weights or [1.0] * len(values)
    return sum(weights) / sum(w / v for w, v in zip(weights, values))


def members_mean(rates: dict, names: list[str], rows: list[str]) -> float:
    """The members' tokens/s a mix as fast as them would reach: their
    harmonic mean weighted by their rows in the mixed batch."""
    return harmonic_mean([rates[n] for n in names], [rows.count(n) for n in names])


def comparison(runs: dict, names: list[str], requests: int) -> dict:
    """The mixed run of `names` against its members' solo runs (unprofiled
    tokens/s); the members' harmonic mean is weighted by their rows in the
    mixed batch."""
    label = mixed_label(names)
    mixed = runs.get(label, {}).get("tokens_per_s_unprofiled")
    solo = {n: runs.get(n, {}).get("tokens_per_s_unprofiled") for n in names}
    rows = deal(names, requests)
    out = {"mixed": label, "mixed_tokens_per_s": mixed, "members_tokens_per_s": solo,
           "member_rows": {n: rows.count(n) for n in names}}
    # A run whose batch ended inside its window measured a tail of few rows
    # (a `full` run read 2,612 tok/s so, against 12,215 when whole): named.
    partial = [n for n in [label, *names] if runs.get(n, {}).get("window_full") is False]
    if partial:
        out["window_not_full"] = partial
    # A whole-step capture inside a window costs ~0.2 s at 128 rows (1-3 ms
    # a step of a 64-128-step window): named with their counts, as a run
    # with one and a run without differ by that much (2026-11-29).
    captured = {n: runs[n]["graphs"]["forward_captures"] for n in [label, *names]
                if runs.get(n, {}).get("graphs", {}).get("forward_captures")}
    if captured:
        out["windows_with_captures"] = captured
    missing = [n for n, v in solo.items() if not v]
    if missing:
        out["missing_members"] = missing
        return out
    mean = members_mean(solo, names, rows)
    out["members_harmonic_mean_tokens_per_s"] = round(mean, 1)
    if mixed:
        out["ratio"] = round(mixed / mean, 3)
    busy = gpu_busy_comparison(runs, names, rows)
    if busy:
        out["gpu_busy"] = busy
    whole = whole_run_comparison(runs, names, rows)
    if whole:
        out["whole_run"] = whole
        if "ratio" in out and "ratio" in whole:
            # The issue asks both methods to agree within 10% (or the docs to say why).
            out["methods_agree_within_10pct"] = abs(whole["ratio"] - out["ratio"]) <= 0.1 * out["ratio"]
    return out


def gpu_busy_comparison(runs: dict, names: list[str], rows: list[str]) -> dict:
    """The same comparison over the profiled steps' GPU busy time a step
    (their kernels and copies, without the host's gaps): the members'
    windows move 5-25% call to call with the host's stalls (a window's
    GPU busy share 0.67 against 0.95 with the same GPU work, H200
    2026-12-02), while this ratio held within 2% over five calls. The
    profiled steps come after the window and the profiler lengthens small
    kernels, so a run of many small kernels (ThinKV's) reads slower here
    than in its window: a yardstick for GPU-side changes, not the
    throughput. {} where a run has no profiled steps (--steps 0).
    `busy_share`: the profiled steps' GPU busy share of their span."""
    label = mixed_label(names)
    profiles = {n: runs.get(n, {}).get("profile") or {} for n in [label, *names]}
    if not all(p.get("gpu_busy_ms") and p.get("steps") for p in profiles.values()):
        return {}
    ms = {n: p["gpu_busy_ms"] / p["steps"] for n, p in profiles.items()}
    # Every run has the batch's rows (--requests): the harmonic mean of the
    # members' rates is the rows-weighted mean of their times.
    mean_ms = sum(ms[n] * rows.count(n) for n in names) / sum(rows.count(n) for n in names)
    return {"mixed_ms_per_step": round(ms[label], 3), "members_ms_per_step": {n: round(ms[n], 3) for n in names},
            "members_harmonic_mean_ms_per_step": round(mean_ms, 3), "ratio": round(mean_ms / ms[label], 3),
            "busy_share": {n: p.get("gpu_busy_share") for n, p in profiles.items()}}


def whole_run_comparison(runs: dict, names: list[str], rows: list[str]) -> dict:
    """The same comparison over each run's whole generation (wall clock from
    the first request to the batch's end); {} where a run lacks it (results
    of before 2026-12-02). Runs with profiled steps in them are named: those
    steps are slower, so compare whole runs of --steps 0."""
    label = mixed_label(names)
    values = {n: runs.get(n, {}).get("tokens_per_s_whole_run") for n in [label, *names]}
    if not all(values.values()):
        return {}
    mean = members_mean(values, names, rows)
    out = {"mixed_tokens_per_s": values[label], "members_tokens_per_s": {n: values[n] for n in names},
           "members_harmonic_mean_tokens_per_s": round(mean, 1), "ratio": round(values[label] / mean, 3)}
    profiled = [n for n in [label, *names] if runs[n].get("whole_run_profiled_steps")]
    if profiled:
        out["runs_with_profiled_steps"] = profiled
    # Where the whole run loses against the window: the ramp (prefill, the
    # region filling, the first evictions' graph captures) or after it (the
    # steady steps, profiled ones and the batch's end).
    for phase in ("ramp", "after_ramp"):
        rates = {n: runs[n].get(f"tokens_per_s_{phase}") for n in [label, *names]}
        if all(rates.values()):
            phase_mean = members_mean(rates, names, rows)
            out[phase] = {"mixed_tokens_per_s": rates[label], "members_harmonic_mean_tokens_per_s": round(phase_mean, 1),
                          "ratio": round(rates[label] / phase_mean, 3)}
    return out


GRAPH_METRICS = {"kvsieve_decode_graph_captures_total": "captures", "kvsieve_decode_graph_replays_total": "replays"}


def graph_counters(path: str | None = None) -> dict:
    """kvsieve's graph counters by graph (region, forward), summed over the
    engine's processes from prometheus' multiprocess files (path, default
    PROMETHEUS_MULTIPROC_DIR); {} when they cannot be read."""
    try:
        from prometheus_client import CollectorRegistry, multiprocess

        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg, path=path)
        out: dict = {}
        for metric in reg.collect():
            for s in metric.samples:
                if s.name in GRAPH_METRICS:
                    graph = out.setdefault(s.labels.get("graph", "?"), {"captures": 0.0, "replays": 0.0})
                    graph[GRAPH_METRICS[s.name]] += s.value
        return out
    except Exception:  # noqa: BLE001 - no counters is recorded as such, not a failed run
        return {}


def graph_rates(before: dict, after: dict, steps: float) -> dict:
    """Captures and replays between two graph_counters() readings, and the
    replays per decode step of the window."""
    out = {"steps": round(steps, 1)}
    for graph in ("region", "forward"):
        for kind in ("captures", "replays"):
            out[f"{graph}_{kind}"] = after.get(graph, {}).get(kind, 0.0) - before.get(graph, {}).get(kind, 0.0)
        out[f"{graph}_replays_per_step"] = round(out[f"{graph}_replays"] / steps, 3) if steps else None
    if not after:
        out["note"] = "no kvsieve graph counters were readable (PROMETHEUS_MULTIPROC_DIR unset, or no graph ran yet)"
    return out


def policy_ranges(profile: dict, names: list[str]) -> dict:
    """Every policy of a run with its decide / observe GPU ms per step and
    its host step_inputs ms per step (0.0 where the trace has no range)."""
    gpu, host = profile["gpu_ms_per_step_by_range"], profile["host_ms_per_step_by_range"]
    out = {n: {"decide": gpu.get(f"kvsieve.decide.{n}", 0.0), "observe": gpu.get(f"kvsieve.observe.{n}", 0.0),
               "step_inputs_host": host.get(f"kvsieve.step_inputs.{n}", 0.0)} for n in names}
    return {"per_policy_ranges_ms": out,
            "policies_without_ranges": [n for n, v in out.items() if not any(v.values())]}


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def idle_gaps(intervals: list[tuple[float, float]], least_us: float) -> list[tuple[float, float]]:
    gaps, end = [], None
    for start, stop in sorted(intervals):
        if end is not None and start - end >= least_us:
            gaps.append((end, start))
        end = stop if end is None else max(end, stop)
    return gaps


def range_split(events: list, gpu: list, span_us: float, busy_us: float, steps: int) -> dict:
    """GPU kernel time inside each kvsieve.* range (gpu_user_annotation
    events mark where the kernels a range launched ran), host time of each
    kvsieve.* range, and the step split into the parts named in the
    docstring, all per step in ms."""
    ranges = [e for e in events if e.get("ph") == "X" and e.get("cat") == "gpu_user_annotation"
              and e.get("name", "").startswith("kvsieve.")]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu)
    starts = [k[0] for k in kernels]
    gpu_ms: dict[str, float] = {}
    for r in ranges:
        lo, hi = r["ts"], r["ts"] + r["dur"]
        i = bisect.bisect_left(starts, lo)
        inside = 0.0
        while i < len(kernels) and kernels[i][0] < hi:
            inside += min(kernels[i][1], hi) - kernels[i][0]
            i += 1
        gpu_ms[r["name"]] = gpu_ms.get(r["name"], 0.0) + inside / 1000
    host_ms: dict[str, float] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name", "").startswith("kvsieve."):
            host_ms[e["name"]] = host_ms.get(e["name"], 0.0) + e["dur"] / 1000
    per = lambda v: round(v / steps, 3)  # noqa: E731
    named = sum(gpu_ms.values())
    split = {"attention_kernel": per(gpu_ms.get("kvsieve.attend", 0.0)),
             "region_writes": per(gpu_ms.get("kvsieve.store", 0.0) + gpu_ms.get("kvsieve.evict", 0.0)),
             "decision_inputs_view": per(gpu_ms.get("kvsieve.view", 0.0)),
             "model_layers_and_rest": per(busy_us / 1000 - named),
             "host_gpu_idle": per((span_us - busy_us) / 1000)}
    for name, ms in gpu_ms.items():
        if name.startswith(("kvsieve.decide.", "kvsieve.observe.")):
            _, kind, policy = name.split(".", 2)
            split[("decision." if kind == "decide" else "observation.") + policy] = per(ms)
    return {"split_per_step_ms": split,
            "gpu_ms_per_step_by_range": {k: per(v) for k, v in sorted(gpu_ms.items())},
            "host_ms_per_step_by_range": {k: per(v) for k, v in sorted(host_ms.items())}}


def gap_causes(events: list, gpu: list, gaps: list, steps: int) -> dict:
    """Why the GPU idled in each gap of `gaps`: the operation after the gap
    was launched by a CUDA runtime call (matched by its correlation id) that
    ended after the gap began (`host_late`: the GPU waited for the host to
    launch it) or before (`launched_before`: it waited on something else, an
    event or another stream). Per step, in ms, with the launching calls and
    the operations after the gaps that took longest, and the host's blocking
    runtime calls (synchronizations). Needs the trace's cuda_runtime events
    (recorded with the GPU activity, also with --activities GPU, whose
    lighter host overhead leaves the gaps closer to an unprofiled run's)."""
    launches = {}
    blocking: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("cuda_runtime", "cuda_driver"):
            continue
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            launches[corr] = e
        if "ynchronize" in e.get("name", "") or e.get("name") in ("cudaMemcpy", "cuMemcpyDtoH_v2"):
            blocking.setdefault(e["name"], []).append(e.get("dur", 0.0))
    starting = {}
    for e in gpu:
        starting.setdefault(e["ts"], e)
    per = lambda us: round(us / 1000 / steps, 3)  # noqa: E731
    kinds = {"host_late": 0.0, "launched_before": 0.0, "unmatched": 0.0}
    by_call: dict[str, float] = {}
    by_next: dict[str, float] = {}
    for start, stop in gaps:
        nxt = starting.get(stop)
        launch = launches.get(((nxt or {}).get("args") or {}).get("correlation"))
        if launch is None:
            kinds["unmatched"] += stop - start
            continue
        kind = "host_late" if launch["ts"] + launch.get("dur", 0.0) > start else "launched_before"
        kinds[kind] += stop - start
        by_call[f"{kind}: {launch['name']}"] = by_call.get(f"{kind}: {launch['name']}", 0.0) + stop - start
        by_next[nxt["name"][:80]] = by_next.get(nxt["name"][:80], 0.0) + stop - start
    top = lambda d: {k: per(v) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:10]}  # noqa: E731
    return {"gap_ms_per_step": {k: per(v) for k, v in kinds.items()},
            "gap_ms_per_step_by_launch": top(by_call), "gap_ms_per_step_by_next_op": top(by_next),
            "host_blocking_calls": {name: {"per_step_ms": per(sum(d)), "count": len(d)}
                                    for name, d in sorted(blocking.items(), key=lambda kv: -sum(kv[1]))[:8]}}


#: Kernel durations (us) the summary counts kernels under: in a replayed
#: graph a kernel of a few microseconds is mostly its launch's fixed cost.
SIZE_BOUNDS_US = (5.0, 10.0, 50.0)


def kernel_sizes(durations_us: list, steps: int) -> dict:
    """Kernels per step, and per step how many took at most each bound of
    SIZE_BOUNDS_US and the GPU ms they took together (many tiny kernels:
    launch-bound work that fusing would cut)."""
    out = {"kernels_per_step": round(len(durations_us) / steps, 1)}
    for bound in SIZE_BOUNDS_US:
        small = [d for d in durations_us if d <= bound]
        out[f"under_{bound:g}us"] = {"per_step": round(len(small) / steps, 1),
                                     "ms_per_step": round(sum(small) / 1000 / steps, 4)}
    return out


def summarize(trace_path: str, steps: int) -> dict:
    events = json.load(gzip.open(trace_path))["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host = [e for e in spans if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in gpu]
    first, last = min(s for s, _ in intervals), max(e for _, e in intervals)
    busy = union_length(intervals)
    gaps = idle_gaps(intervals, 50.0)
    by_kernel: dict[str, list[float]] = {}
    for e in gpu:
        by_kernel.setdefault(e["name"][:120], []).append(e["dur"])
    kernels = sorted(((name, sum(d), len(d)) for name, d in by_kernel.items()), key=lambda k: -k[1])
    # Host: an operation's own top level (not nested in another host op of the same thread).
    by_thread: dict = {}
    for e in host:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    top_level: dict[str, list[float]] = {}
    for items in by_thread.values():
        items.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_until = float("-inf")
        for e in items:
            if e["ts"] >= open_until:
                top_level.setdefault(e["name"][:120], []).append(e["dur"])
                open_until = e["ts"] + e["dur"]
    host_ops = sorted(((name, sum(d), len(d)) for name, d in top_level.items()), key=lambda k: -k[1])
    # Python functions, inclusive time (nested calls count in each caller): where the host's step goes.
    inclusive: dict[str, list[float]] = {}
    for e in host:
        if e.get("cat") == "python_function":
            inclusive.setdefault(e["name"][:120], []).append(e["dur"])
    python_functions = sorted(((name, sum(d), len(d)) for name, d in inclusive.items()), key=lambda k: -k[1])
    span_us = last - first
    # What the host was doing in the GPU's longest idle gaps.
    longest = sorted(gaps, key=lambda g: g[0] - g[1])[:8]
    in_gaps = []
    for start, stop in longest:
        inside = [e for e in host if e["ts"] < stop and e["ts"] + e["dur"] > start and e["dur"] > 0.3 * (stop - start)]
        inside.sort(key=lambda e: e["dur"])
        in_gaps.append({"gap_us": round(stop - start, 1), "host_ops_covering": [e["name"][:80] for e in inside[:6]]})
    return {**range_split(events, gpu, span_us, busy, steps),
            "span_ms": round(span_us / 1000, 3), "steps": steps, "span_per_step_ms": round(span_us / 1000 / steps, 3),
            "gpu_busy_ms": round(busy / 1000, 3), "gpu_busy_share": round(busy / span_us, 3),
            "idle_gaps_over_50us": {"count": len(gaps), "total_ms": round(sum(b - a for a, b in gaps) / 1000, 3)},
            "longest_gaps": in_gaps,
            "gap_causes": gap_causes(events, gpu, idle_gaps(intervals, 5.0), steps),
            "kernels": [{"name": n, "total_ms": round(t / 1000, 3), "per_step_ms": round(t / 1000 / steps, 3), "count": c}
                        for n, t, c in kernels[:80]],
            "kernel_sizes": kernel_sizes([e["dur"] for e in gpu if e.get("cat") == "kernel"], steps),
            "host_top_level": [{"name": n, "total_ms": round(t / 1000, 3), "count": c} for n, t, c in host_ops[:40]],
            "python_inclusive": [{"name": n, "per_step_ms": round(t / 1000 / steps, 3), "count": c}
                                 for n, t, c in python_functions[:80]]}


async def profile_batch(engine, cfg, names: list[str], specs: dict, seed: int, trace_dir: str) -> dict:
    """One batch of --requests requests, the policies of `names` dealt round
    robin (one name: a solo run): they ramp to the largest budget + 32
    tokens, the unprofiled throughput and graph counters over the next 64
    steps, then --steps profiled steps (none with --steps 0); the batch then
    runs to its end before the next one starts."""
    from sglang.srt.managers.io_struct import ProfileReq

    n = cfg["requests"]
    policies = {}
    for name in names:
        policies[name] = dict(specs[name]["kv_policy"])
        if cfg["policy_params"].get(name):
            policies[name]["params"] = cfg["policy_params"][name]
    budget = max(specs[name]["budget"] or cfg["budget"] for name in names)
    rows = deal(names, n)
    counts = [0] * n
    first_token_s = [None] * n  # when each row's first chunk came: a row admitted late shows here
    started = time.perf_counter()
    wall = {"start": round(time.time(), 3)}  # epoch seconds: the step log's clock (capture_churn --profile)

    async def one(i, ids):
        sampling = headline.params(budget + cfg["gen_extra"], policies[rows[i]])
        async for chunk in await engine.async_generate(input_ids=ids, sampling_params=sampling, stream=True):
            counts[i] = chunk["meta_info"]["completion_tokens"]
            if first_token_s[i] is None:
                first_token_s[i] = time.perf_counter() - started

    tasks = [asyncio.ensure_future(one(i, ids)) for i, ids in enumerate(headline.prompts(n, headline.SHORT_PROMPT, seed))]
    while min(counts) < budget + RAMP_TOKENS:
        if any(t.done() and t.exception() for t in tasks):
            await asyncio.gather(*tasks)  # raises the request's error
        await asyncio.sleep(0.05)
    ramp_s = time.perf_counter() - started
    ramp_tokens = sum(counts)
    wall["ramp_end"] = round(time.time(), 3)
    # Chunks arrive every STREAM_INTERVAL tokens per request: a window of
    # 64 steps holds 8 of them, so the count moves smoothly through it.
    before = (time.perf_counter(), sum(counts))
    graphs_before = graph_counters()
    label = run_label(names)
    sampler = start_pyspy(cfg, trace_dir, label)
    # Rows that ran ahead may finish first (a retracted row restarts late):
    # the window then ends with the batch instead of waiting forever.
    window = cfg["window_steps"] * n
    while sum(counts) < before[1] + window and not all(t.done() for t in tasks):
        await asyncio.sleep(0.02)
    after = (time.perf_counter(), sum(counts))
    window_full = after[1] >= before[1] + window  # False: the batch ended inside the window
    graphs_after = graph_counters()
    unprofiled = (after[1] - before[1]) / (after[0] - before[0])
    profile_id = "kvsieve-step-" + ("mixed" if len(names) > 1 else names[0])
    if cfg["steps"]:
        await engine.tokenizer_manager.start_profile(ProfileReq(output_dir=trace_dir, num_steps=cfg["steps"],
                                                                activities=cfg["activities"], with_stack=cfg["stack"],
                                                                record_shapes=False, profile_id=profile_id))
    await asyncio.gather(*tasks)
    whole_s = time.perf_counter() - started
    wall["end"] = round(time.time(), 3)
    result = {("policy" if len(names) == 1 else "policies"): policies[names[0]] if len(names) == 1 else policies,
              "requests": n,
              "ramp_s": round(ramp_s, 1), "tokens_per_s_unprofiled": round(unprofiled, 1),
              "step_ms_unprofiled": round(1000 * n / unprofiled, 2),
              # The other method: the whole generation, wall clock
              # (prefill, ramp and the batch's end included; with --steps the
              # profiled steps too, which the comparison says).
              "tokens_per_s_whole_run": round(sum(counts) / whole_s, 1), "whole_run_s": round(whole_s, 1),
              "whole_run_profiled_steps": cfg["steps"],
              "tokens_per_s_ramp": round(ramp_tokens / ramp_s, 1),
              "tokens_per_s_after_ramp": round((sum(counts) - ramp_tokens) / max(whole_s - ramp_s, 1e-9), 1),
              "window_full": window_full, "wall_clock": wall, "first_tokens": late_rows(first_token_s, rows),
              "graphs": graph_rates(graphs_before, graphs_after, (after[1] - before[1]) / n)}
    if sampler is not None:
        result["pyspy"] = finish_pyspy(*sampler)
    if len(names) > 1:
        result.update(label=label, members=names, member_rows={m: rows.count(m) for m in names}, window_budget=budget)
    traces = sorted(glob.glob(os.path.join(trace_dir, f"{profile_id}*.trace.json.gz"))) if cfg["steps"] else []
    if traces:
        result["profile"] = summarize(traces[-1], cfg["steps"])
        result["profile"].update(policy_ranges(result["profile"], names))
    return result


#: A row whose first token came this many seconds after the batch's median
#: first token is named in `first_tokens.late` (admitted after the others).
LATE_ROW_S = 2.0


def late_rows(first_token_s: list, rows: list[str]) -> dict:
    """When the batch's rows got their first token: the median, the last, and
    the rows that came LATE_ROW_S or more after the median (row, policy, s)."""
    seen = sorted(s for s in first_token_s if s is not None)
    if not seen:
        return {"median_s": None, "last_s": None, "late": []}
    median = seen[len(seen) // 2]
    late = [{"row": i, "policy": rows[i], "first_token_s": round(s, 2)}
            for i, s in enumerate(first_token_s) if s is not None and s >= median + LATE_ROW_S]
    return {"median_s": round(median, 2), "last_s": round(seen[-1], 2), "late": late}


def start_pyspy(cfg: dict, out_dir: str, label: str):
    """--pyspy S: py-spy samples the scheduler's main thread for S seconds
    from the window's start (Python frames only, without pausing the
    process: the blocking native sampler slowed a traffic run ~10x on
    2026-11-29). Returns (process, raw path) or None."""
    if not cfg["pyspy_s"]:
        return None
    import shutil
    import subprocess

    import psutil

    beside_python = os.path.join(os.path.dirname(sys.executable), "py-spy")
    spy = shutil.which("py-spy") or (beside_python if os.path.exists(beside_python) else "/tmp/site2/bin/py-spy")
    schedulers = [p for p in psutil.Process().children(recursive=True) if "scheduler" in " ".join(p.cmdline())]
    if not schedulers:
        raise SystemExit("--pyspy: no scheduler process among this process's children")
    raw = os.path.join(out_dir, "pyspy-" + label.replace(":", "-").replace("+", "-") + ".txt")
    os.makedirs(out_dir, exist_ok=True)
    proc = subprocess.Popen([spy, "record", "--pid", str(schedulers[0].pid), "--duration", str(int(cfg["pyspy_s"])),
                             "--rate", "250", "--format", "raw", "--idle", "--threads", "--nonblocking", "-o", raw],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, raw


def finish_pyspy(proc, raw: str) -> dict:
    """The sampler's summary (bench/pyspy_summary.py), the scheduler's main
    thread only; waits for the sampler's duration to end."""
    import pyspy_summary

    err = proc.communicate()[1]
    if not os.path.exists(raw):
        return {"error": err[-500:]}
    return dict(pyspy_summary.summarize(pyspy_summary.read(raw, "MainThread"), 40), raw=raw)


def report(name: str, result: dict) -> None:
    print(name, json.dumps({k: v for k, v in result.items() if k not in ("profile", "pyspy")}))
    for part in ("inclusive", "waits", "leaves") if "inclusive" in result.get("pyspy", {}) else ():
        for row in result["pyspy"][part][:25]:
            print(f"pyspy {part} {100 * row['share']:5.1f}%  {row['name']}")
    if "profile" not in result:
        return
    prof = result["profile"]
    print(json.dumps({k: prof[k] for k in ("span_per_step_ms", "gpu_busy_share", "idle_gaps_over_50us")}))
    print("split", json.dumps(prof["split_per_step_ms"]))
    print("per policy", json.dumps(prof.get("per_policy_ranges_ms")))
    print("host ranges", json.dumps(prof["host_ms_per_step_by_range"]))
    for k in prof["kernels"][:12]:
        print("kernel", k["per_step_ms"], k["count"], k["name"])
    for h in prof["python_inclusive"][:30]:
        print("py", h["per_step_ms"], h["count"], h["name"])


#: What must match for an earlier JSON's runs to stand beside this call's
#: (--mixed-only: the batch's scale; --resume: also how each run is made).
SAME_SCALE = ("budget", "requests", "kv_tokens", "device")
SAME_RUNS = SAME_SCALE + ("policy_params", "gen_extra", "window_steps")


def earlier_runs(path: str, cfg: dict, keys: tuple[str, ...] = SAME_SCALE) -> tuple[dict, dict | None]:
    """The runs of OUT's existing JSON and the JSON itself when it was made
    with the same `keys` of the config; ({}, None) otherwise."""
    try:
        previous = json.load(open(path))
    except (OSError, ValueError):
        return {}, None
    old = previous.get("config", {})
    if any(old.get(k, "cuda" if k == "device" else None) != cfg[k] for k in keys):
        return {}, None
    return previous.get("runs", {}), previous


def main() -> None:
    model, out_dir = sys.argv[1], sys.argv[2]
    cfg = options()
    from kvsieve.service.engine import prepare_process_environment

    # SGLANG_USE_CPU_ENGINE on cpu; prometheus' multiprocess dir, which the
    # scheduler inherits: its kvsieve graph counters are read from there.
    prepare_process_environment(cfg["device"])
    model = str(smoke.model_dir(model))
    shape = smoke.model_shape(Path(model))
    vocab = shape["vocab"]
    headline.VOCAB_IDS = (min(1000, vocab // 4), min(100000, vocab))
    names = cfg["policy"].split(",")
    if cfg["mixed"] and (len(names) < 2 or cfg["requests"] < len(names)):
        raise SystemExit("--mixed needs two policies or more and at least one request per policy")
    specs = smoke.policy_specs(names, cfg["budget"])
    invalid = {n: s["invalid"] for n, s in specs.items() if "invalid" in s}
    if invalid:
        raise SystemExit(f"no budget accepted: {invalid}")
    import torch
    import sglang as sgl

    if cfg["ranges"]:
        os.environ["KVSIEVE_PROFILE_RANGES"] = "1"  # the named ranges of radix_ext/profiling.py
    pool_tokens = int(cfg["kv_tokens"] * headline.POOL_SHARE)
    region_tokens = cfg["kv_tokens"] - pool_tokens
    os.environ["KVSIEVE_REGION_PAGES"] = str(region_tokens * shape["layers"] * shape["kv_heads"] // headline.PAGE)
    device_kwargs = dict(cuda_graph_max_bs_decode=128) if cfg["device"] == "cuda" else \
        dict(device="cpu", disable_cuda_graph=True)
    engine = sgl.Engine(model_path=model, load_format="dummy", skip_tokenizer_init=True, sampling_backend="pytorch",
                        log_level=cfg["log_level"], mem_fraction_static=0.85, stream_interval=headline.STREAM_INTERVAL,
                        attention_backend="kvsieve", max_total_tokens=pool_tokens, max_running_requests=cfg["requests"],
                        **device_kwargs)
    trace_dir = os.path.join("/tmp", "kvsieve-trace")
    out_path = os.path.join(out_dir, cfg["out"])
    os.makedirs(out_dir, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(0) if cfg["device"] == "cuda" else "cpu",
              "command": "python bench/step_profile.py " + " ".join(sys.argv[1:]),
              "config": cfg, "policies": specs, "runs": {}}
    if cfg["resume"]:
        result["runs"], earlier = earlier_runs(out_path, cfg, SAME_RUNS)
        if earlier:
            result["resumed_from"] = earlier.get("resumed_from", []) + [
                {"command": earlier.get("command"), "date": earlier.get("date"), "runs": sorted(earlier["runs"])}]
    elif cfg["mixed_only"]:
        result["runs"], earlier = earlier_runs(out_path, cfg)
        if result["runs"]:
            result["solo_runs_from"] = earlier.get("command")

    def save() -> None:
        result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        if cfg["mixed"]:
            result["comparison"] = comparison(result["runs"], names, cfg["requests"])
        with open(out_path, "w") as f:  # after every run: a call cut short keeps what ran
            json.dump(result, f, indent=1)

    # (members, prompt seed): the solo runs' seeds as before; the mixed run's
    # the same with --mixed and --mixed-only.
    solo = [] if cfg["mixed_only"] else cfg["solo"].split(",") if cfg["solo"] else names
    batches = [([name], names.index(name) + 7) for name in solo]
    if cfg["mixed"]:
        # --mixed-first 1: the mixed batch before the solo runs (a call cut short keeps it).
        batches.insert(0 if cfg["mixed_first"] else len(batches), (names, len(names) + 7))
    # --resume: what an earlier call ran is not run again.
    batches = [(members, seed) for members, seed in batches if run_label(members) not in result["runs"]]
    try:
        if cfg["warmup"] and batches:
            warm = engine.loop.run_until_complete(profile_batch(
                engine, dict(cfg, steps=0, pyspy_s=0), names, specs, WARMUP_SEED, trace_dir))
            result["warmup"] = {"members": names, "ramp_s": warm["ramp_s"], "whole_run_s": warm["whole_run_s"],
                                "wall_clock": warm["wall_clock"]}
            print(f"warm-up: {len(names)} policies, {warm['whole_run_s']} s", flush=True)
        for members, seed in batches:
            run = engine.loop.run_until_complete(profile_batch(engine, cfg, members, specs, seed, trace_dir))
            label = run_label(members)
            result["runs"][label] = run
            save()
            report(label, run)
        if cfg["mixed"]:
            print("comparison", json.dumps(result["comparison"]))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
