"""Plot the batched-path benchmarks:
bench/results/gpu-batched.json -> docs/plots/gpu-batched.png (tokens/s per engine and policy, with
kernel launches and host syncs per decode step), and bench/results/cpu-batched.json ->
docs/plots/cpu-batched-tpot.png (TPOT per policy and batch, against `full`)."""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def gpu() -> None:
    path = ROOT / "bench" / "results" / "gpu-batched.json"
    if not path.exists():
        return
    result = json.loads(path.read_text())
    summary, profiles = result["summary"], result["profiles"]
    keys = list(summary)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    bars = ax.bar(keys, [summary[k]["median_tokens_per_s"] for k in keys],
                  color=["#777" if k == "vanilla" else "#3a7" if k.endswith("/full") else "#37a" for k in keys])
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_ylabel("tokens/s (median)")
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    setup = result["setup"]
    ax.set_title(f"batch {setup['batch']} x {setup['generated_tokens']} tokens, budget {setup['budget']}, "
                 "no CUDA graphs", fontsize=9)
    names = {"vanilla": "vanilla", "kvsieve_full": "kvsieve/full"}
    labels = [names.get(k, f"kvsieve/{k}") for k in profiles]
    x = range(len(labels))
    launches = bx.bar([i - 0.2 for i in x], [p["kernel_launches_per_step"] for p in profiles.values()], 0.4,
                      label="kernel launches")
    bx.bar_label(launches, fmt="%.0f", fontsize=7)
    sx = bx.twinx()
    syncs = sx.bar([i + 0.2 for i in x], [p["host_syncs_per_step"] for p in profiles.values()], 0.4,
                   color="#c53", label="host syncs")
    sx.bar_label(syncs, fmt="%.1f", fontsize=7)
    sx.set_ylabel("host syncs per decode step")
    bx.set_ylabel("kernel launches per decode step")
    bx.set_xticks(list(x), labels, rotation=30, fontsize=8)
    bx.set_title("torch profiler, decode steps (batch 16)", fontsize=9)
    fig.suptitle(f"{result['device']}, R1-Distill-Qwen-7B architecture — {result['date']}", fontsize=10)
    fig.tight_layout()
    out = ROOT / "docs" / "plots" / "gpu-batched.png"
    fig.savefig(out, dpi=120)
    print(out)


def cpu() -> None:
    path = ROOT / "bench" / "results" / "cpu-batched.json"
    if not path.exists():
        return
    result = json.loads(path.read_text())
    tpot = result["tpot_ms"]
    batches = result["tpot_setting"]["batches"]
    policies = sorted({k.split("/")[0] for k in tpot}, key=lambda p: (p != "full", p))
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.8 / len(batches)
    for i, batch in enumerate(batches):
        values = [tpot[f"{p}/batch{batch}"] for p in policies]
        bars = ax.bar([x + (i - (len(batches) - 1) / 2) * width for x in range(len(policies))], values, width,
                      label=f"batch {batch}")
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(policies)), policies)
    ax.set_ylabel("TPOT (ms)")
    setting = result["tpot_setting"]
    ax.set_title(f"{result['model']} on CPU ({result['machine']}), budget {setting['budget']}, "
                 f"{setting['tokens']} tokens — {result['date']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = ROOT / "docs" / "plots" / "cpu-batched-tpot.png"
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    gpu()
    cpu()
