"""A decode step's host metadata before and after a change, from
bench/step_meta_host.py's JSON files: host ms per step and the tensor
operations it puts on the GPU, per row count, side by side.

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("out")
    args = ap.parse_args()
    results = [(json.loads(Path(p).read_text()), p) for p in (args.before, args.after)]
    rows = [run["rows"] for run in results[0][0]["runs"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.38
    for k, (result, path) in enumerate(results):
        by_rows = {run["rows"]: run for run in result["runs"]}
        xs = [i + (k - 0.5) * width for i in range(len(rows))]
        color = ("tab:gray", "tab:blue")[k]
        left.bar(xs, [by_rows[r]["host_ms_median"] for r in rows], width, label=label(result, path), color=color)
        right.bar(xs, [by_rows[r]["gpu_ops_per_step"] for r in rows], width, label=label(result, path), color=color)
    for ax, title in ((left, "host ms per step (median)"), (right, "GPU operations per step")):
        ax.set_xticks(range(len(rows)), [str(r) for r in rows])
        ax.set_xlabel("rows (ten-policy mix)")
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
