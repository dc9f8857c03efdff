"""Plot of bench/cpu_tpot.py's result: bench/results/cpu-batched.json ->
docs/plots/cpu-batched-tpot.png (TPOT per policy and batch, `full` first).

    python bench/plot_cpu_tpot.py
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
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
    main()
