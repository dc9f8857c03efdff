"""Plot of issue #31's results: Ray Serve replicas one per GPU, and tensor
parallelism 2 against 1.

    python bench/plot_multi_gpu.py [--replicas bench/results/gpu-replicas.json,...] [--tp bench/results/gpu-tp.json]
        [--out docs/plots/multi-gpu.png]

Left: goodput scaling against one replica on the same host (each
gpu_replicas JSON is one host with its own N=1 baseline), the ideal N
dashed, each point labelled with its TTFT p50. Right: tokens/s at TP 1 and
TP 2 from gpu-tp.json's `tp_points` (the headline's points and the gate's
workloads, one host).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_REPLICAS = ("bench/results/gpu-replicas.json", "bench/results/gpu-replicas-n4-h200x4.json")


def scaling_points(run: dict, routing: str = "prefix") -> list[tuple[int, float, float]]:
    """(replicas, goodput / N=1 goodput, TTFT p50 s) of one host's set-ups of `routing`, by N."""
    setups = [s for s in run["setups"].values() if s.get("load") and s.get("routing") == routing]
    base = next((s["load"]["goodput_tok_s"] for s in setups if s["replicas"] == 1), None)
    if not base:
        return []
    return sorted((s["replicas"], s["load"]["goodput_tok_s"] / base, s["load"]["ttft_p50_s"]) for s in setups)


def tp_bars(tp: dict) -> list[tuple[str, float, float]]:
    """(label, TP 1 tok/s, TP 2 tok/s) of the headline's points, the mixed batch and the solos' mean."""
    one, two = tp["tp_points"]["tp1"], tp["tp_points"]["tp2"]
    bars = []
    for a, b in zip(one.get("headline") or [], two.get("headline") or []):
        bars.append((f"headline\n{a['policy']}", a["tokens_per_s"], b["tokens_per_s"]))
    w1, w2 = ({w["name"]: w for w in run["workloads"]} for run in (one, two))
    solos = [n for n in w1 if n.startswith("solo:") and n in w2]
    if solos:
        bars.append(("gate solos\n(mean)", sum(w1[n]["tokens_per_s"] for n in solos) / len(solos),
                     sum(w2[n]["tokens_per_s"] for n in solos) / len(solos)))
    if "mixed" in w1 and "mixed" in w2:
        bars.append(("gate\nmixed", w1["mixed"]["tokens_per_s"], w2["mixed"]["tokens_per_s"]))
    return bars


def plot(replica_runs: list[dict], tp: dict | None, out: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    top = 1
    for run in replica_runs:
        points = scaling_points(run)
        if not points:
            continue
        n, factor, ttft = zip(*points)
        top = max(top, *n)
        left.plot(n, factor, "o-", label=f"{run['device']} ({run['date'][:10]})")
        for x, y, t in points[1:]:  # N=1's TTFT is in the table; the labels would overlap here
            left.annotate(f"TTFT p50 {t:.2f} s", (x, y), textcoords="offset points", xytext=(6, -12), fontsize=8)
    left.plot([1, top], [1, top], "--", color="gray", label="ideal")
    left.set_xlabel("engine replicas (one per GPU)")
    left.set_ylabel("goodput / one replica's, same host")
    left.set_title("Ray Serve replicas, 16 requests/s per replica, prefix routing")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    if tp is not None and tp.get("tp_points"):
        bars = tp_bars(tp)
        xs = range(len(bars))
        right.bar([x - 0.2 for x in xs], [b[1] for b in bars], 0.4, label="TP 1")
        right.bar([x + 0.2 for x in xs], [b[2] for b in bars], 0.4, label="TP 2")
        for x, (_, a, b) in zip(xs, bars):
            right.annotate(f"{b / a:.2f}x", (x + 0.2, b), textcoords="offset points", xytext=(0, 3), ha="center",
                           fontsize=8)
        right.set_xticks(list(xs), [b[0] for b in bars], fontsize=8)
        right.set_ylabel("tokens/s")
        device = tp["tp_points"]["tp1"].get("device", "")
        right.set_title(f"TP 2 against TP 1 ({device}, one host)")
        right.legend()
        right.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", default=",".join(DEFAULT_REPLICAS))
    ap.add_argument("--tp", default="bench/results/gpu-tp.json")
    ap.add_argument("--out", default="docs/plots/multi-gpu.png")
    args = ap.parse_args(argv)
    runs = [json.loads((REPO / p).read_text()) for p in args.replicas.split(",") if p]
    tp = json.loads((REPO / args.tp).read_text()) if args.tp else None
    plot(runs, tp, REPO / args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
