"""PNG of TPOT and output throughput by policy over time, from a run's
request log: requests are binned by the time they ended. With the run's
replicas.jsonl (loadtest/run.py --replicas-every) a third panel shows the
engine replicas (Serve's RUNNING and STARTING counts, and those reporting
metrics) and locust's users over time.

    python loadtest/plot.py RESULTS_DIR/requests.jsonl OUT.png [--window 15] [--title TEXT]
        [--replicas RESULTS_DIR/replicas.jsonl --users RESULTS_DIR/locust_stats_history.csv]
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


def plot(records: list[dict], out: Path, window: float = 15.0, title: str = "",
         replicas: list[dict] | None = None, users: list[tuple[float, int]] | None = None) -> None:
    data = series(records, window)
    if replicas:
        fig, (ax_tpot, ax_tput, ax_rep) = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
        _replica_panel(ax_rep, replicas, users or [], min(r["start"] for r in records) if records else 0.0)
    else:
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


def _replica_panel(ax, rows: list[dict], users: list[tuple[float, int]], t0: float) -> None:
    rows = [r for r in rows if "error" not in r]
    t = [r["t"] - t0 for r in rows]
    ax.step(t, [r["serve"].get("RUNNING", 0) for r in rows], where="post", lw=2, label="Serve: RUNNING")
    ax.step(t, [r["serve"].get("STARTING", 0) for r in rows], where="post", ls="--", label="Serve: STARTING")
    ax.step(t, [r["serve"].get("STOPPING", 0) for r in rows], where="post", ls=":", label="Serve: STOPPING")
    ax.step(t, [r["reporting"] for r in rows], where="post", alpha=0.6, label="reporting metrics")
    ax.set_ylabel("engine replicas")
    ax.set_ylim(bottom=0, top=max([r["serve"].get("RUNNING", 0) for r in rows] + [r["reporting"] or 0 for r in rows]
                                  + [1]) + 1)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if users:
        twin = ax.twinx()
        line = twin.step([u[0] - t0 for u in users], [u[1] for u in users], where="post", color="grey", alpha=0.5,
                         label="locust users")[0]
        twin.set_ylabel("users")
        twin.set_ylim(bottom=0)
        handles, labels = handles + [line], labels + ["locust users"]
    ax.legend(handles, labels, fontsize=8, loc="upper right")
    ax.set_xlabel("time since start (s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--window", type=float, default=15.0)
    ap.add_argument("--title", default="")
    ap.add_argument("--replicas", type=Path, help="the run's replicas.jsonl")
    ap.add_argument("--users", type=Path, help="the run's locust_stats_history.csv")
    args = ap.parse_args()
    from replica_watch import read_watch
    from run import users_over_time

    plot(read_log(args.log), args.out, args.window, args.title,
         replicas=read_watch(args.replicas) if args.replicas else None,
         users=users_over_time(args.users) if args.users else None)


if __name__ == "__main__":
    main()
