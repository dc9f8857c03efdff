"""The slot view's gathers and what a change did to each policy's step, in
one figure: left, ms a layer for each way of gathering a group's view
(bench/view_gather.py); right, each policy's steady-window tokens/s before
and after (bench/step_profile.py JSONs), as multiples of vanilla's 16K
generation where a vanilla point is given.

    python bench/plot_view_gather.py VIEW.json BEFORE.json AFTER.json [AFTER.json ...] OUT.png [--vanilla GPU_HEADLINE.json]

A policy is drawn when BEFORE and one of the AFTER files both ran it alone
(a run an AFTER file carried over from an earlier call, `--resume`, does
not count; a later AFTER file wins for a policy in two); `--label-after`
names the change per AFTER file (default: each file's name).
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def solo_rates(profile: dict, fresh_only: bool = False) -> dict:
    """Policy -> its solo run's steady-window tokens/s; with `fresh_only`,
    not the runs a `--resume` call carried over from its earlier JSON."""
    carried = set(profile["resumed_from"][-1]["runs"]) if fresh_only and profile.get("resumed_from") else set()
    return {name: run["tokens_per_s_unprofiled"] for name, run in profile["runs"].items()
            if not name.startswith("mixed:") and name not in carried}


def pairs(before: dict, afters: list[tuple[str, dict]]) -> list[dict]:
    """One entry per policy run in BEFORE and in some AFTER (the last one
    naming it wins), in BEFORE's order."""
    old = solo_rates(before)
    new = {}
    for label, profile in afters:
        for name, rate in solo_rates(profile, fresh_only=True).items():
            new[name] = (label, rate)
    return [{"policy": name, "before": old[name], "after": new[name][1], "change": new[name][0]}
            for name in old if name in new]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="VIEW.json BEFORE.json AFTER.json [AFTER.json ...] OUT.png")
    ap.add_argument("--vanilla", help="gpu_headline JSON with vanilla's 16K point: the bars as multiples of it")
    ap.add_argument("--label-after", default="", help="comma-separated names of the AFTER files' changes")
    args = ap.parse_args(argv)
    if len(args.files) < 4:
        ap.error("give VIEW.json BEFORE.json, at least one AFTER.json, and OUT.png")
    view_path, before_path, *after_paths, out = args.files
    labels = args.label_after.split(",") if args.label_after else [os.path.basename(p) for p in after_paths]
    if len(labels) != len(after_paths):
        ap.error(f"--label-after names {len(labels)} changes for {len(after_paths)} AFTER files")
    view = json.load(open(view_path))
    rows = pairs(json.load(open(before_path)), [(label, json.load(open(p))) for label, p in zip(labels, after_paths)])
    if not rows:
        raise SystemExit("no policy ran alone in BEFORE and in an AFTER file")
    scale, unit = 1.0, "tokens/s (steady window)"
    if args.vanilla:
        entry = next(e for e in json.load(open(args.vanilla))["vanilla"] if e.get("generate") == 16384)
        scale, unit = entry["tokens_per_s"], f"x vanilla SGLang 16K ({entry['tokens_per_s']:,.0f} tok/s)"

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.4]})
    forms = view["forms"]
    bars = left.bar(list(forms), [f["ms_per_layer"] for f in forms.values()], color="tab:gray")
    for bar, f in zip(bars, forms.values()):
        left.annotate(f"{f['ms_per_layer']:.3f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                      ha="center", va="bottom", fontsize=8)
    left.set_ylabel("ms a layer")
    left.set_title(f"a group's slot view, {view['rows']} rows x {view['heads']} heads x {view['columns']} columns\n"
                   f"({view['machine']})", fontsize=9)
    x = range(len(rows))
    width = 0.38
    before = right.bar([i - width / 2 for i in x], [r["before"] / scale for r in rows], width, label="before")
    after = right.bar([i + width / 2 for i in x], [r["after"] / scale for r in rows], width, label="after")
    for group in (before, after):
        for bar in group:
            right.annotate(f"{bar.get_height():.2f}" if args.vanilla else f"{bar.get_height():,.0f}",
                           (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                           fontsize=8)
    right.set_xticks(list(x), [f"{r['policy']}\n({r['change']})" for r in rows], fontsize=8)
    right.set_ylabel(unit)
    right.set_title("each policy alone, before and after", fontsize=9)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    for r in rows:
        print(f"{r['policy']}: {r['before']:,.0f} -> {r['after']:,.0f} tok/s ({r['change']})")
    print("->", out)


if __name__ == "__main__":
    main()
