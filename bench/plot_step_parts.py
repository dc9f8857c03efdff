"""Where a decode step's time goes under traffic, from a KVSIEVE_STEP_LOG
file (radix_ext/step_log.py): per band of rows in the batch, the median
step's metadata build (host), decoder stack (GPU), deferred policy groups
(GPU) and the rest of the step (SGLang's scheduler, sampling, what the GPU
waits for), as stacked bars.

    python bench/plot_step_parts.py STEPS.jsonl OUT.png [--json OUT.json]

Only decode steps with compressed rows whose stack replayed from a graph
and whose parts were timed count; a step's length is the next forward's
start minus its own (steps over 1 s, a compile or capture, are left out).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvsieve.radix_ext import step_log  # noqa: E402

BANDS = ((1, 20), (20, 50), (50, 80), (80, 120), (120, 200), (200, 400), (400, 1025))
PARTS = (("meta_ms", "metadata (host)", "tab:orange"), ("gpu_stack_ms", "decoder stack (GPU)", "tab:blue"),
         ("gpu_groups_ms", "policy groups (GPU)", "tab:green"))


def replayed_steps(lines: list[dict]) -> list[dict]:
    """Decode steps whose whole stack replayed, each with its length `step_ms`."""
    out = []
    for line, after in zip(lines, lines[1:]):
        if line.get("mode") != "decode" or "region" not in line or "gpu_stack_ms" not in line:
            continue
        before, later = line.get("counters", {}), after.get("counters", {})
        if later.get("forward_replays", 0) - before.get("forward_replays", 0) != 1:
            continue
        took = 1000 * (after["t"] - line["t"])
        if took < 1000 * step_log.SLOW_S:
            out.append(dict(line, step_ms=took))
    return out


def bands(steps: list[dict]) -> list[dict]:
    rows = []
    for lo, hi in BANDS:
        inside = [s for s in steps if lo <= s["region"] < hi]
        if not inside:
            continue
        entry = {"rows": f"{lo}-{hi - 1}", "steps": len(inside),
                 "rows_mean": round(statistics.mean(s["region"] for s in inside), 1),
                 "pool_only_mean": round(statistics.mean(s.get("pool_only", 0) for s in inside), 1),
                 "step_ms": round(statistics.median(s["step_ms"] for s in inside), 1)}
        for key, _, _ in PARTS:
            entry[key] = round(statistics.median(s.get(key, 0.0) for s in inside), 1)
        entry["rest_ms"] = round(max(0.0, entry["step_ms"] - sum(entry[k] for k, _, _ in PARTS)), 1)
        rows.append(entry)
    return rows


def plot(rows: list[dict], out: str, title: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for key, label, color in (*PARTS, ("rest_ms", "rest of the step", "tab:gray")):
        values = [r[key] for r in rows]
        ax.bar(x, values, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(list(x), [f"{r['rows']}\n({r['steps']} steps)" for r in rows])
    ax.set_xlabel("rows in the batch")
    ax.set_ylabel("median ms per decode step")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("steps")
    ap.add_argument("out")
    ap.add_argument("--json", default=None, help="also write the bands as JSON")
    ap.add_argument("--title", default="kvsieve decode steps replayed whole, under traffic")
    args = ap.parse_args(argv)
    rows = bands(replayed_steps(step_log.read(args.steps)))
    if not rows:
        raise SystemExit(f"{args.steps}: no timed decode step whose stack replayed")
    plot(rows, args.out, args.title)
    if args.json:
        Path(args.json).write_text(json.dumps({"source": args.steps, "bands": rows}, indent=1) + "\n")
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
