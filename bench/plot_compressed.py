"""Plot bench/results/compressed-cpu.json as docs/plots/compressed-cpu-tpot.png."""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    result = json.loads((ROOT / "bench" / "results" / "compressed-cpu.json").read_text())
    tpot = result["tpot_ms"]
    policies = sorted({k.split("/")[0] for k in tpot}, key=lambda p: (p != "full", p))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.38
    for i, batch in enumerate((1, 8)):
        values = [tpot[f"{p}/batch{batch}"] for p in policies]
        bars = ax.bar([x + (i - 0.5) * width for x in range(len(policies))], values, width, label=f"batch {batch}")
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(policies)), policies)
    ax.set_ylabel("TPOT (ms)")
    setting = result["tpot_setting"]
    ax.set_title(f"{result['model']} on CPU ({result['machine']}), budget {setting['budget']}, "
                 f"{setting['tokens']} tokens — {result['date']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    out = ROOT / "docs" / "plots" / "compressed-cpu-tpot.png"
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main()
