"""Each decode step's time through a run, for one or more KVSIEVE_STEP_LOG
files (radix_ext/step_log.py) side by side: where a whole run loses time
against its steady steps (graph captures, a policy's host work every few
dozen steps). The legend gives each log's time budget
(bench/capture_churn.time_budget): decode seconds, the median step and
the slow steps' excess.

    python bench/plot_step_times.py OUT.png LABEL=STEPS.jsonl[.gz] [LABEL=...] [--clip-ms 150]

A step's time is the next forward's start minus its own; steps above
--clip-ms are drawn at the clip (their time is in the budget).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import capture_churn  # noqa: E402


def step_times(lines: list[dict]) -> list[float]:
    """Milliseconds of each decode step with compressed rows."""
    return [1000 * seconds for _, _, seconds in capture_churn.decode_steps(lines)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("logs", nargs="+", help="LABEL=path of a step log")
    ap.add_argument("--clip-ms", type=float, default=150.0)
    args = ap.parse_args()
    fig, ax = plt.subplots(figsize=(11, 4.8))
    for spec in args.logs:
        label, _, path = spec.partition("=")
        if not path:
            ap.error(f"{spec!r}: expected LABEL=path")
        lines = capture_churn.read_steps(path)
        times = step_times(lines)
        budget = capture_churn.time_budget(lines)
        excess = ", ".join(f"{k} {v:.2f}" for k, v in list(budget["excess_s"].items())[:3])
        ax.plot([min(t, args.clip_ms) for t in times], linewidth=0.9,
                label=f"{label}: {budget['decode_s']:.2f} s, median {budget['median_step_ms']:.2f} ms; "
                      f"excess s: {excess}")
    ax.set_xlabel("decode step")
    ax.set_ylabel(f"step time, ms (clipped at {args.clip_ms:g})")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper right")
    ax.set_title("Decode step times through a run (step log)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print("->", args.out)


if __name__ == "__main__":
    main()
