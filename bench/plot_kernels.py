"""Plots of the GPU results of [gpu-kernels]: the decode kernel's share of
copy bandwidth against SGLang's triton decode kernel, and the compressed
decode step with and without CUDA graphs.

    python bench/plot_kernels.py   (reads bench/results/, writes docs/plots/)
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PLOTS = ROOT / "docs" / "plots"


def timings(name):
    return [t for t in json.loads((RESULTS / name).read_text())["timings"] if "skipped" not in t]


def kernel_plot():
    runs = {"kvsieve, round 2 (one loop)": timings("gpu-kernels.json"),
            "kvsieve, current (prefix/region loops)": timings("gpu-kernels-quick.json")}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, model in zip(axes, ("r1-distill-qwen-7b", "llama-3.1-8b")):
        for batch, marker in ((64, "o"), (128, "s"), (256, "^"), (512, "D")):
            for label, rows, style in ((*list(runs.items())[0], ":"), (*list(runs.items())[1], "-")):
                pts = sorted({t["tokens_per_row"]: t["kernel_share_of_copy_bw"] for t in rows
                              if t["model"] == model and t["batch"] == batch}.items())
                if pts:
                    ax.plot(*zip(*pts), style, marker=marker, label=f"{label}, batch {batch}")
            sg = sorted({t["tokens_per_row"]: t["sglang_triton_share_of_copy_bw"] for t in runs[list(runs)[0]]
                         if t["model"] == model and t["batch"] == batch and "sglang_triton_share_of_copy_bw" in t
                         }.items())
            if sg:
                ax.plot(*zip(*sg), "--", color="gray", marker=marker, alpha=0.6, label=f"SGLang triton, batch {batch}")
        ax.axhline(0.85, color="red", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(model)
        ax.set_xlabel("tokens per row (one layer)")
    axes[0].set_ylabel("share of device copy bandwidth")
    axes[1].legend(fontsize=6, ncol=2)
    fig.suptitle("Decode attention, H100 80GB, bf16, head_dim 128 (red: 85% target)")
    fig.tight_layout()
    fig.savefig(PLOTS / "gpu-kernels.png", dpi=120)


def graphs_plot():
    probe = json.loads((RESULTS / "gpu-graph-probe.json").read_text())["policies"]
    e2e = json.loads((RESULTS / "gpu-batched-graphs.json").read_text())["summary"]
    before = json.loads((RESULTS / "gpu-batched-kernel.json").read_text())["runs"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [p["policy"] for p in probe]
    x = range(len(names))
    a.bar([i - 0.2 for i in x], [p["eager_step_ms"] for p in probe], 0.4, label="eager")
    a.bar([i + 0.2 for i in x], [p["graph_step_ms"] for p in probe], 0.4, label="CUDA graphs")
    a.set_xticks(list(x), names)
    a.set_ylabel("ms per decode step (28 layers, 64 rows)")
    a.set_title("Compressed pass alone (graph_probe)")
    a.legend()
    pol = ["streaming", "h2o", "snapkv", "longflow"]
    eager = {r["policy"]["name"]: r["tokens_per_s"] for r in before if isinstance(r["policy"], dict)}
    b.bar([i - 0.2 for i in range(4)], [eager[p] for p in pol], 0.4, label="eager pass")
    b.bar([i + 0.2 for i in range(4)], [e2e[f"kvsieve/{p}"]["median_tokens_per_s"] for p in pol], 0.4,
          label="CUDA graphs")
    b.axhline(e2e["vanilla"]["median_tokens_per_s"], color="gray", ls="--", label="vanilla SGLang (no graphs)")
    b.set_xticks(range(4), pol)
    b.set_ylabel("tokens/s, 64 requests x 256 tokens")
    b.set_title("Engine end to end (gpu_batched)")
    b.legend(fontsize=8)
    fig.suptitle("H100 80GB, R1-Distill-Qwen-7B architecture, budget 64")
    fig.tight_layout()
    fig.savefig(PLOTS / "gpu-graphs.png", dpi=120)


if __name__ == "__main__":
    PLOTS.mkdir(parents=True, exist_ok=True)
    kernel_plot()
    graphs_plot()
