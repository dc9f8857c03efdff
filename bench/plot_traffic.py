"""Plot of bench/traffic.py's result: goodput and TPOT p99 against the
arrival rate, vanilla SGLang and kvsieve on one trace at equal KV memory.

    python bench/plot_traffic.py RESULTS.json OUT.png

Left: goodput (completed requests' tokens/s), with the offered load (the
trace's tokens/s) dashed. Right: TPOT p99 (ms). A rate whose requests were
cut off by --rate-timeout is drawn hollow (its goodput counts only what
completed); a rate that did not run is left out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"vanilla": ("tab:gray", "vanilla SGLang"), "kvsieve": ("tab:blue", "kvsieve (policy mix)"),
         "kvsieve-nofold": ("tab:cyan", "kvsieve, `full` rows on SGLang's backend"),
         "kvsieve-noeagerdefer": ("tab:purple", "kvsieve, new shapes' groups inside the layers")}


def series(data: dict, engine: str, key: str) -> list[tuple[float, float, bool]]:
    """(rate, value, cut off) of every rate that ran, by rate."""
    points = []
    for entry in data.get("engines", {}).get(engine, {}).get("rates", {}).values():
        if entry.get("status") == "done" and entry.get(key) is not None:
            points.append((entry["rate"], entry[key], bool(entry.get("cut_off"))))
    return sorted(points)


def draw(ax, data: dict, key: str) -> None:
    for engine, (color, label) in STYLE.items():
        points = series(data, engine, key)
        if not points:
            continue
        rates, values, cut = zip(*points)
        ax.plot(rates, values, color=color, label=label, marker="o")
        hollow = [(r, v) for r, v, c in points if c]
        if hollow:
            ax.scatter(*zip(*hollow), s=90, facecolors="white", edgecolors=color, zorder=3,
                       label=f"{engine}: requests cut off")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    data = json.loads(Path(argv[0]).read_text())
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    draw(left, data, "goodput_tok_s")
    offered = sorted((float(rate), t["offered_tok_s"]) for rate, t in data.get("trace", {}).items())
    if offered:
        left.plot(*zip(*offered), color="black", linestyle="--", linewidth=1, label="offered (trace)")
    left.set(xlabel="arrival rate (requests/s)", ylabel="goodput (completed tokens/s)", title="Goodput")
    draw(right, data, "tpot_p99_ms")
    right.set(xlabel="arrival rate (requests/s)", ylabel="TPOT p99 (ms)", title="TPOT p99")
    for ax in (left, right):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    cfg = data.get("config", {})
    fig.suptitle(f"{data.get('device', '?')}: {cfg.get('kv_tokens')} KV tokens each, generations "
                 f"{cfg.get('gen_min')}-{cfg.get('gen_max')}, prompts {cfg.get('prompt_min')}-{cfg.get('prompt_max')}, "
                 f"budget {cfg.get('budget')}, {cfg.get('duration')} s of arrivals per rate", fontsize=9)
    fig.tight_layout()
    Path(argv[1]).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(argv[1], dpi=120)
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
