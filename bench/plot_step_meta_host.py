"""A decode step's host metadata before and after a change, from
bench/step_meta_host.py's JSON files: host ms per step and the tensor
operations it puts on the GPU (all its operations, for runs on a CPU), per
row count (and number of policy classes, for runs with --classes), side by
side.

    python bench/plot_step_meta_host.py BEFORE.json AFTER.json OUT.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def label(result: dict, path: str) -> str:
    return f"{result.get('commit') or Path(path).stem}"


def case_of(run: dict) -> tuple:
    """(rows, policy classes or None): one bar pair each."""
    return run["rows"], run.get("classes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("out")
    args = ap.parse_args()
    results = [(json.loads(Path(p).read_text()), p) for p in (args.before, args.after)]
    cases = [case_of(run) for run in results[0][0]["runs"]]
    on_gpu = any(run["gpu_ops_per_step"] for result, _ in results for run in result["runs"])
    ops = "gpu_ops_per_step" if on_gpu else "ops_per_step"
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.38
    for k, (result, path) in enumerate(results):
        by_case = {case_of(run): run for run in result["runs"]}
        xs = [i + (k - 0.5) * width for i in range(len(cases))]
        color = ("tab:gray", "tab:blue")[k]
        left.bar(xs, [by_case[c]["host_ms_median"] for c in cases], width, label=label(result, path), color=color)
        right.bar(xs, [by_case[c][ops] for c in cases], width, label=label(result, path), color=color)
    classes = any(c[1] is not None for c in cases)
    ticks = [f"{r}\n{n} cl." if n is not None else str(r) for r, n in cases]
    for ax, title in ((left, "host ms per step (median)"),
                      (right, "GPU operations per step" if on_gpu else "tensor operations per step")):
        ax.set_xticks(range(len(cases)), ticks)
        ax.set_xlabel("rows, policy classes" if classes else "rows (ten-policy mix)")
        ax.set_title(title)
        ax.set_ylim(0, 1.3 * ax.get_ylim()[1])  # room for the legend above the bars
        ax.legend(loc="upper left", ncols=2)
    first = results[0][0]
    fig.suptitle(f"A decode step's metadata on the host, {first.get('machine')} ({first.get('date', '')[:10]}): "
                 "bench/step_meta_host.py", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("->", args.out)


if __name__ == "__main__":
    main()
