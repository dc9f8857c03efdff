"""What the host was doing while the GPU idled: the longest idle gaps of a
torch profiler trace, each with the Python frames that span it (a trace
recorded with_stack: `bench/step_profile.py ... --stack 1`) and the CUDA
runtime calls inside it that took long (a synchronization, a blocking
copy). bench/step_profile.py's summary names only the scheduler's
top-level call over a gap (`scheduler.run_batch`); this names the line.

    python bench/gap_context.py TRACE.json.gz [--gaps 12] [--least-us 500] [--out gaps.json]

Per gap: its length and start (ms from the first GPU operation), the GPU
operation before and after it, `frames`: the innermost Python functions
that cover the gap's middle, outermost first, and `runtime_calls`: the CUDA
runtime or driver calls overlapping the gap that took over 50 us.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
LONG_CALL_US = 50.0


def load(path: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def gaps_of(gpu: list, least_us: float) -> list[tuple[float, float, dict, dict]]:
    """Idle stretches of at least `least_us` between GPU operations, with the
    operation that ended last before each and the one that starts it."""
    ops = sorted(gpu, key=lambda e: e["ts"])
    out, end, last = [], None, None
    for e in ops:
        if end is not None and e["ts"] - end >= least_us:
            out.append((end, e["ts"], last, e))
        if end is None or e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e
    return out


def frames_over(python: list, at: float, depth: int = 12) -> list[str]:
    """The Python functions running at time `at`, outermost first (the last
    `depth` of them)."""
    covering = [e for e in python if e["ts"] <= at <= e["ts"] + e["dur"]]
    covering.sort(key=lambda e: (e["ts"], -e["dur"]))
    return [e["name"][:140] for e in covering][-depth:]


def describe(events: list, gaps: int, least_us: float) -> dict:
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in spans if e.get("cat") in GPU_CATS]
    python = [e for e in spans if e.get("cat") == "python_function"]
    runtime = [e for e in spans if e.get("cat") in RUNTIME_CATS]
    if not gpu:
        raise SystemExit("no GPU operations in the trace")
    origin = min(e["ts"] for e in gpu)
    found = gaps_of(gpu, least_us)
    longest = sorted(found, key=lambda g: g[0] - g[1])[:gaps]
    rows = []
    for start, stop, before, after in sorted(longest):
        calls = [e for e in runtime if e["ts"] < stop and e["ts"] + e["dur"] > start and e["dur"] >= LONG_CALL_US]
        rows.append({"gap_ms": round((stop - start) / 1000, 3), "at_ms": round((start - origin) / 1000, 3),
                     "gpu_before": before["name"][:100], "gpu_after": after["name"][:100],
                     "frames": frames_over(python, (start + stop) / 2),
                     "runtime_calls": [{"name": e["name"], "us": round(e["dur"], 1),
                                        "at_ms": round((e["ts"] - origin) / 1000, 3)} for e in calls[:8]]})
    return {"gaps_over_least": len(found), "least_us": least_us,
            "idle_ms_in_them": round(sum(b - a for a, b, _, _ in found) / 1000, 3),
            "python_frames_recorded": len(python), "gaps": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--gaps", type=int, default=12)
    parser.add_argument("--least-us", type=float, default=500.0)
    parser.add_argument("--out")
    args = parser.parse_args()
    result = describe(load(args.trace), args.gaps, args.least_us)
    result["trace"] = args.trace
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text if not args.out else f"{len(result['gaps'])} gaps -> {args.out}", file=sys.stdout)


if __name__ == "__main__":
    main()
