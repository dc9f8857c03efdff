"""One layer's decode attention of a mixed step against its members', by
kernel, from `bench/mixed_attention_ab.py` results (their
`kernels_ms_per_launch`): one stacked bar a case (partial, observation,
merge, the rest), the cases of each file side by side under its label.

    python bench/plot_mixed_attention.py OUT.png LABEL=AB.json [LABEL=...]
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PARTS = [("_partial_kernel", "split-KV attention (_partial_kernel)"),
         ("_observe_kernel", "observations (_observe_kernel)"), ("_merge_kernel", "merge (_merge_kernel)"),
         ("_fused_kernel", "LongFlow's fused kernel")]


def breakdown(path: str) -> dict:
    with open(path) as f:
        doc = json.load(f)
    if "kernels_ms_per_launch" not in doc:
        raise SystemExit(f"{path}: no `kernels_ms_per_launch` (an older mixed_attention_ab.py result)")
    return doc["kernels_ms_per_launch"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+", help="LABEL=mixed-attention-ab.json")
    args = ap.parse_args()
    bars = []  # (label, {part: ms})
    for label, path in (r.split("=", 1) for r in args.runs):
        for case, kernels in breakdown(path).items():
            parts = {name: kernels.get(key, 0.0) for key, name in PARTS}
            parts["other kernels"] = sum(kernels.values()) - sum(parts.values())
            bars.append((f"{label}: {case}", parts))
    fig, ax = plt.subplots(figsize=(14, max(3.0, 1.2 + 0.3 * len(bars))))  # a readable row a bar
    left = [0.0] * len(bars)
    for name in [n for _, n in PARTS] + ["other kernels"]:
        values = [parts[name] * 1000 for _, parts in bars]
        ax.barh(range(len(bars)), values, left=left, label=name)
        left = [a + b for a, b in zip(left, values)]
    for i, total in enumerate(left):
        ax.text(total + 0.5, i, f"{total:.1f}", va="center", fontsize=8)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GPU µs per layer (128 rows, R1-Distill-Qwen-7B shapes; a step runs 28)")
    ax.set_title("A mixed step's decode attention against its members', by kernel")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
