"""Where a decode step's GPU time goes, policy by policy: the split of
`bench/step_profile.py --steps N --ranges 1` runs (each run's
`profile.split_per_step_ms`: attention, the slot view, each policy's
decision and observation, region writes, model layers and the rest) as
stacked bars, one per traced run, with the unprofiled step (the steady
window's ms a step) marked. The split is of the eager profiled steps; the
mark is the graph-replayed step the throughput comes from.

    python bench/plot_step_split.py OUT.png PROFILE.json [PROFILE.json ...] [--json OUT.json]

Each PROFILE.json is a step-profile file; every run in it with a
`profile` is drawn (label: its policy name, or `mixed` for a mix).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

#: Parts in drawing order (bottom first), their legend names and colours;
#: a policy's own decision and observation ranges are summed into "policy".
PARTS = (("model_layers_and_rest", "model layers and the rest", "tab:gray"),
         ("attention_kernel", "attention", "tab:blue"),
         ("decision_inputs_view", "slot view", "tab:purple"),
         ("policy", "decision and observation", "tab:green"),
         ("region_writes", "region writes", "tab:red"))


def traced_runs(paths: list[str]) -> list[dict]:
    """One entry per traced run: its label, GPU ms a step by part, and the
    unprofiled step's ms."""
    out = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        for name, run in data["runs"].items():
            split = (run.get("profile") or {}).get("split_per_step_ms")
            if not split:
                continue
            parts = {key: split.get(key, 0.0) for key, _, _ in PARTS if key != "policy"}
            parts["policy"] = sum(v for k, v in split.items() if k.startswith(("decision.", "observation.")))
            out.append({"run": "mixed" if name.startswith("mixed:") else name, "source": str(path),
                        "gpu_ms_by_part": {k: round(v, 3) for k, v in parts.items()},
                        "gpu_ms": round(sum(parts.values()), 3),
                        "unprofiled_step_ms": run.get("step_ms_unprofiled"),
                        "rows": run.get("requests"), "device": data.get("device"), "date": data.get("date")})
    if not out:
        raise SystemExit("no traced run (bench/step_profile.py --steps N --ranges 1) in " + ", ".join(paths))
    return out


def plot(runs: list[dict], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(4.5 + 1.6 * len(runs), 5))
    x = range(len(runs))
    bottom = [0.0] * len(runs)
    for key, label, colour in PARTS:
        heights = [r["gpu_ms_by_part"][key] for r in runs]
        ax.bar(x, heights, 0.6, bottom=bottom, label=label, color=colour)
        bottom = [b + h for b, h in zip(bottom, heights)]
    marks = [r["unprofiled_step_ms"] for r in runs]
    ax.scatter(x, marks, marker="_", s=900, color="black", zorder=3, label="unprofiled step (graphs)")
    for i, r in enumerate(runs):
        ax.annotate(f"{r['gpu_ms']:.1f}", (i, bottom[i]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [f"{r['run']}\n{r['date'] or ''}" for r in runs], fontsize=8)
    ax.set_ylabel("ms a decode step")
    devices = sorted({str(r["device"]) for r in runs})
    rows = sorted({str(r["rows"]) for r in runs})
    ax.set_title(f"{', '.join(devices)}: GPU time a step by part ({', '.join(rows)} rows; eager profiled steps)",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_ylim(0, max(max(bottom), max(m or 0 for m in marks)) * 1.1)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("profiles", nargs="+")
    ap.add_argument("--json", default=None, help="also write the bars' numbers here")
    args = ap.parse_args()
    runs = traced_runs(args.profiles)
    plot(runs, Path(args.out))
    for r in runs:
        print(r["run"], r["gpu_ms"], r["unprofiled_step_ms"], json.dumps(r["gpu_ms_by_part"]))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    print("->", args.out)


if __name__ == "__main__":
    main()
