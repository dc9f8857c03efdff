"""The fused region store's time a step (bench/region_store.py reports),
build against build: bars per (rows, widths), one colour per build.

    python bench/plot_region_store.py OUT.png LABEL=REPORT.json [LABEL=REPORT.json ...]

A label may name several reports (a build's uniform and --wide-columns
runs); only the fused kernel's rows are drawn.
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def fused_times(path: str) -> dict[tuple[int, int], float]:
    """{(rows, wide columns): ms a step} of the report's fused rows."""
    with open(path) as f:
        report = json.load(f)
    times = {(r["rows"], r.get("wide_columns", 0)): r["step_ms"] for r in report["results"] if r["form"] == "fused"}
    if not times:
        raise SystemExit(f"{path}: no fused rows (a CPU run times the PyTorch form only)")
    return times


def case_name(rows: int, wide: int) -> str:
    return f"{rows} rows, " + (f"1 in 8 at {wide} columns" if wide else "every row 20 columns")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("reports", nargs="+", help="LABEL=region-store.json")
    args = ap.parse_args()
    builds: dict[str, dict] = {}
    for label, path in (r.split("=", 1) for r in args.reports):
        builds.setdefault(label, {}).update(fused_times(path))
    cases = sorted({case for times in builds.values() for case in times})
    width = 0.8 / len(builds)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.9 * len(cases) + 1.5), 4.2))
    for i, (label, times) in enumerate(builds.items()):
        xs = [c + (i - (len(builds) - 1) / 2) * width for c in range(len(cases)) if cases[c] in times]
        ys = [times[case] for case in cases if case in times]
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.set_xticks(range(len(cases)), [case_name(*c).replace(", ", "\n") for c in cases], fontsize=8)
    ax.set_ylabel("ms a step (28 layers, one CUDA graph)")
    ax.set_title("The region store of one decode step, by build")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
