"""A mixed batch against its members alone, from `bench/step_profile.py
--mixed 1` results (their `comparison`): one bar per member's tokens/s,
the members' harmonic mean (what a mixed batch as fast as its members
would reach) and the mixed batch, per result file side by side.

    python bench/plot_members.py OUT.png LABEL=STEP_PROFILE.json [LABEL=...]
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def comparison(path: str) -> dict:
    with open(path) as f:
        doc = json.load(f)
    if "comparison" not in doc:
        raise SystemExit(f"{path}: no `comparison` (run step_profile.py with --mixed 1)")
    return doc["comparison"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+", help="LABEL=step-profile.json")
    args = ap.parse_args()
    runs = [(label, comparison(path)) for label, path in (r.split("=", 1) for r in args.runs)]
    members = list(runs[0][1]["members_tokens_per_s"])
    names = members + ["harmonic mean", "mixed"]
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(12, 4.5))
    for i, (label, c) in enumerate(runs):
        values = [c["members_tokens_per_s"].get(m, 0.0) for m in members]
        values += [c["members_harmonic_mean_tokens_per_s"], c["mixed_tokens_per_s"]]
        xs = [x + (i - (len(runs) - 1) / 2) * width for x in range(len(names))]
        bars = ax.bar(xs, values, width, label=f"{label}: mixed {c['ratio']:.2f}x the members' harmonic mean")
        ax.bar_label(bars, labels=[f"{v / 1000:.1f}k" for v in values], fontsize=7)
    top = max(max(c["members_tokens_per_s"].values()) for _, c in runs)
    ax.set_ylim(0, top * 1.3)  # room for the legend above the bars
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set_ylabel("tokens/s (steady window)")
    ax.set_title("A mixed batch against each member alone at the same row count")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("->", args.out)


if __name__ == "__main__":
    main()
