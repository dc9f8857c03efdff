"""Plot of bench/kernel_check.py's decode timings (bench/results/gpu-kernels-quick.json):
the Triton decode kernel's share of the device's copy bandwidth against
SGLang's own triton decode kernel over the same tokens, per model, batch and
tokens per row.

    python bench/plot_kernels.py   (writes docs/plots/gpu-kernels.png)
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "bench" / "results" / "gpu-kernels-quick.json"
PLOT = ROOT / "docs" / "plots" / "gpu-kernels.png"


def main() -> None:
    data = json.loads(RESULT.read_text())
    rows = [t for t in data["timings"] if "skipped" not in t]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, model in zip(axes, ("r1-distill-qwen-7b", "llama-3.1-8b")):
        for batch, marker in ((64, "o"), (128, "s"), (256, "^"), (512, "D")):
            mine = sorted((t["tokens_per_row"], t["kernel_share_of_copy_bw"]) for t in rows
                          if t["model"] == model and t["batch"] == batch)
            if mine:
                ax.plot(*zip(*mine), "-", marker=marker, label=f"kvsieve, batch {batch}")
            sglang = sorted((t["tokens_per_row"], t["sglang_triton_share_of_copy_bw"]) for t in rows
                            if t["model"] == model and t["batch"] == batch and "sglang_triton_share_of_copy_bw" in t)
            if sglang:
                ax.plot(*zip(*sglang), "--", color="gray", marker=marker, alpha=0.6,
                        label=f"SGLang triton, batch {batch}")
        ax.axhline(0.85, color="red", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(model)
        ax.set_xlabel("tokens per row (one layer)")
    axes[0].set_ylabel("share of device copy bandwidth")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"Decode attention, {data['device']}, bf16, head_dim 128 (red: 85% target)")
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=120)


if __name__ == "__main__":
    main()
