"""A mixed batch against its members over several device calls, two ways:
tokens/s in the steady window (against the members' harmonic mean: what
the issue's target reads) and GPU busy time a step (against the members'
weighted mean: without the host's gaps), from `bench/mixed_kernel_parts.py`
results (each file's first mix); a line at the target, 0.9x.

    python bench/plot_mix_ratios.py OUT.png LABEL=PARTS.json [LABEL=...]
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TARGET = 0.9


def ratios(path: str) -> tuple[float, float]:
    """(window ratio, GPU busy ratio) of the file's first mix."""
    with open(path) as f:
        result = json.load(f)["results"][0]
    if "gpu_busy_ratio" not in result:
        raise SystemExit(f"{path}: no `gpu_busy_ratio` (a mixed_kernel_parts.py result of before 2026-12-02e)")
    return result["ratio"], result["gpu_busy_ratio"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+", help="LABEL=mixed-kernel-parts.json")
    args = ap.parse_args()
    labels, window, busy = [], [], []
    for label, path in (r.split("=", 1) for r in args.runs):
        w, b = ratios(path)
        labels.append(label)
        window.append(w)
        busy.append(b)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(labels) + 2), 4.2))
    x = range(len(labels))
    ax.plot(x, window, "o-", label="tokens/s, steady window (members' harmonic mean)")
    ax.plot(x, busy, "s-", label="GPU busy ms a step (members' weighted mean)")
    for ys in (window, busy):
        for i, y in enumerate(ys):
            ax.annotate(f"{y:.3f}", (i, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.axhline(TARGET, color="gray", linestyle="--", linewidth=1, label=f"target {TARGET}x")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("mixed batch / its members")
    ax.set_ylim(min(window + busy + [TARGET]) - 0.03, max(window + busy + [TARGET]) + 0.03)
    ax.set_title("A mixed batch against its members, call by call")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
