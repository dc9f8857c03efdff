"""Plot of the end-to-end headline (bench/results/gpu-headline.json): decode
throughput of vanilla SGLang and of each kvsieve policy at equal KV memory,
per generation length, with each point's roofline, and the ratio to vanilla.

    python bench/plot_headline.py   (writes docs/plots/gpu-headline.png)
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "bench" / "results" / "gpu-headline.json"
PLOT = ROOT / "docs" / "plots" / "gpu-headline.png"


def main() -> None:
    data = json.loads(RESULT.read_text())
    vanilla = {v["generate"]: v for v in data["vanilla"] if "tokens_per_s" in v}
    policies = [k for k in data["kvsieve"] if "tokens_per_s" in k]
    lengths = sorted(vanilla)
    series = [("vanilla SGLang", [vanilla[g] for g in lengths])]
    # Past its budget a policy's step no longer depends on the generation's
    # length: one measurement stands for every length.
    series += [(f"{p['policy']} @ {p['budget']} ({p['requests']} req)", [p] * len(lengths)) for p in policies]
    colors = plt.get_cmap("tab20").colors  # one colour per series (the default cycle repeats after 10)
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 5.2))
    width = 0.8 / len(series)
    for i, (label, points) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(lengths))]
        left.bar(xs, [p["tokens_per_s"] for p in points], width, label=label, color=colors[i % len(colors)])
        roof = [p.get("roofline", {}).get("tokens_per_s") for p in points]
        left.scatter([x for x, r in zip(xs, roof) if r], [r for r in roof if r], marker="_", s=200, color="black",
                     zorder=3, label="roofline" if i == 0 else None)
    left.set_xticks(range(len(lengths)), [f"{g // 1024}K generated" for g in lengths])
    left.set_ylabel("decode tokens/s (steady window)")
    left.set_title("Equal KV memory: tokens/s and roofline")
    for i, (label, points) in enumerate(series[1:], start=1):
        ratio = [p["tokens_per_s"] / vanilla[g]["tokens_per_s"] for p, g in zip(points, lengths)]
        right.plot([g // 1024 for g in lengths], ratio, marker="o", label=label, color=colors[i % len(colors)])
    right.axhline(4.0, color="grey", linestyle="--", label="target at 16K: 4x")
    right.set_xscale("log", base=2)
    right.set_xticks([g // 1024 for g in lengths], [f"{g // 1024}K" for g in lengths])
    right.set_xlabel("generated tokens")
    right.set_ylabel("x vanilla tokens/s")
    right.set_title("Ratio to vanilla SGLang")
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    fig.suptitle(f"{data['device']}, R1-Distill-Qwen-7B shapes, {data['kv_bytes'] / 2**30:.0f} GiB of KV, "
                 f"{data['date']}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.82, 1))
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)
    print(PLOT)


if __name__ == "__main__":
    main()
