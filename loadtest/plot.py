"""PNG of TPOT and output throughput by policy over time, from a run's
request log: requests are binned by the time they ended.

    python loadtest/plot.py RESULTS_DIR/requests.jsonl OUT.png [--window 15] [--title TEXT]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from summary import read_log  # noqa: E402


def series(records: list[dict], window: float) -> dict[str, dict[str, list]]:
    """Per policy: window centres (s from the start), median TPOT (ms) and
    generated tokens per second of the requests that ended in each window."""
    done = [r for r in records if r.get("status") == 200 and not r.get("error") and r["scenario"] != "bad"]
    if not done:
        return {}
    t0 = min(r["start"] for r in records)
    n_bins = int((max(r["end"] for r in done) - t0) // window) + 1
    out: dict[str, dict[str, list]] = {}
    for policy in sorted({r["policy"] for r in done}):
        tpot_bins: list[list[float]] = [[] for _ in range(n_bins)]
        token_bins = [0] * n_bins
        for r in done:
            if r["policy"] != policy:
                continue
            b = int((r["end"] - t0) // window)
            token_bins[b] += r.get("tokens", 0)
            if "tpot" in r:
                tpot_bins[b].append(r["tpot"] * 1000)
        out[policy] = {
            "t": [(i + 0.5) * window for i in range(n_bins)],
            "tpot_ms": [statistics.median(v) if v else None for v in tpot_bins],
            "tokens_per_s": [n / window for n in token_bins],
        }
    return out


def plot(records: list[dict], out: Path, window: float = 15.0, title: str = "") -> None:
    data = series(records, window)
    fig, (ax_tpot, ax_tput) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for policy, s in data.items():
        pts = [(t, v) for t, v in zip(s["t"], s["tpot_ms"]) if v is not None]
        ax_tpot.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=policy)
        ax_tput.plot(s["t"], s["tokens_per_s"], marker="o", markersize=3, label=policy)
    ax_tpot.set_ylabel("TPOT, median (ms)")
    ax_tpot.set_title(title or "TPOT and output throughput by kv_policy")
    ax_tpot.set_ylim(bottom=0)
    ax_tput.set_ylabel("generated tokens / s")
    ax_tput.set_xlabel(f"time since start (s), {window:g} s windows by request end")
    ax_tput.set_ylim(bottom=0)
    for ax in (ax_tpot, ax_tput):
        ax.grid(alpha=0.3)
    if data:
        ax_tpot.legend(title="kv_policy", fontsize=8, ncol=5)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--window", type=float, default=15.0)
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    plot(read_log(args.log), args.out, args.window, args.title)


if __name__ == "__main__":
    main()
