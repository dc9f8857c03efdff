"""What a mixed batch's GPU runs that its members' do not (issue #29, item 1:
"say what a mixed batch loses"), from kernel traces of replayed steps.

    python bench/mixed_kernel_parts.py MEMBERS.json MIXED.json [MIXED.json ...]
        [--out parts.json] [--plot parts.png]

MEMBERS.json: a `bench/step_profile.py --mixed 1 --ranges 0 --activities
GPU --steps N` result (every member alone and one mixed batch, the same
rows); each MIXED.json: a `step_profile.py` result whose first run is a
mixed batch (MEMBERS.json itself, or a `--mixed-only 1` run of another mix
of those members). `--ranges 0` keeps the graphs replaying as served, so a
trace's kernels are what a served step runs.

Each kernel of a trace goes to one part: `gemm` (the model's matmuls),
`attention` (kvsieve's decode kernels and region store, LongFlow's fused
kernel, SGLang's own attention for `full` alone), `model other` (norms,
activation, rotary), `copies` (memcpy / memset) and `torch ops` (every
other kernel: the policy groups' passes, gathers, the step's metadata).
Per part: the mixed batch's GPU ms per step and kernel launches per step,
against its members' weighted by their rows in the mix (the mixed batch's
if every row cost what it costs in a batch of its own policy), and the
difference. The member throughputs' harmonic mean, weighted alike, is the
issue's yardstick; `ratio` is the mixed batch's tokens/s over it.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

PARTS = ("gemm", "attention", "model other", "copies", "torch ops")
ATTENTION = ("_partial_kernel", "_observe_kernel", "_merge_kernel", "_fused_kernel", "_fwd_grouped_kernel",
             "_store_kernel")
MODEL_OTHER = ("flashinfer", "act_and_mul", "rotary", "Rotary", "rmsnorm", "RMSNorm")


def part(kernel: str) -> str:
    """The part a kernel's time counts under (by its name)."""
    lower = kernel.lower()
    if kernel.startswith(("nvjet", "sm80_xmma", "sm90_xmma")) or "gemm" in lower or "cutlass" in lower:
        return "gemm"
    if kernel.startswith(ATTENTION):
        return "attention"
    if any(name in kernel for name in MODEL_OTHER):
        return "model other"
    if "memcpy" in lower or "memset" in lower:
        return "copies"
    return "torch ops"


def parts_of(run: dict) -> dict:
    """{part: (GPU ms per step, kernels per step)} of one step_profile run."""
    profile = run.get("profile") or {}
    if not profile.get("kernels"):
        raise SystemExit(f"run {run.get('label')!r} has no kernel trace (step_profile --steps N, --ranges 0)")
    steps = profile["steps"]
    ms, count = collections.Counter(), collections.Counter()
    for k in profile["kernels"]:
        ms[part(k["name"])] += k["per_step_ms"]
        count[part(k["name"])] += k["count"] / steps
    return {p: (ms[p], count[p]) for p in PARTS}


def mixed_run(doc: dict, path: str) -> tuple[str, dict]:
    for label, run in doc["runs"].items():
        if label.startswith("mixed:"):
            return label, run
    raise SystemExit(f"{path}: no mixed run (step_profile --mixed 1 or --mixed-only 1)")


def compare(members_doc: dict, mixed_doc: dict, path: str) -> dict:
    label, mixed = mixed_run(mixed_doc, path)
    rows = mixed["member_rows"]
    missing = [m for m in rows if m not in members_doc["runs"]]
    if missing:
        raise SystemExit(f"{path}: members {missing} were not run alone in the members' result")
    total = sum(rows.values())
    expected = {p: [0.0, 0.0] for p in PARTS}
    inverse = 0.0
    busy = 0.0  # the members' GPU busy ms a step, weighted by their rows
    for member, n in rows.items():
        run = members_doc["runs"][member]
        inverse += n / total / run["tokens_per_s_unprofiled"]
        busy += run["profile"]["gpu_busy_ms"] / run["profile"]["steps"] * n / total
        for p, (ms, count) in parts_of(run).items():
            expected[p][0] += ms * n / total
            expected[p][1] += count * n / total
    observed = parts_of(mixed)
    profile = mixed["profile"]
    return {
        "mixed": label, "file": path, "rows": rows,
        "tokens_per_s": mixed["tokens_per_s_unprofiled"], "members_harmonic_mean": round(1.0 / inverse, 1),
        "ratio": round(mixed["tokens_per_s_unprofiled"] * inverse, 3),
        "step_ms_unprofiled": mixed["step_ms_unprofiled"],
        "gpu_busy_ms_per_step": round(profile["gpu_busy_ms"] / profile["steps"], 3),
        # GPU time alone (no host gaps): steadier call to call than the windows' tokens/s.
        "members_gpu_busy_ms_per_step": round(busy, 3),
        "gpu_busy_ratio": round(busy / (profile["gpu_busy_ms"] / profile["steps"]), 3),
        "parts": {p: {"mixed_ms": round(observed[p][0], 3), "members_ms": round(expected[p][0], 3),
                      "extra_ms": round(observed[p][0] - expected[p][0], 3),
                      "mixed_kernels": round(observed[p][1], 1), "members_kernels": round(expected[p][1], 1)}
                  for p in PARTS},
    }


def plot(results: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(results)
    widest = max((set(r["rows"]) for r in results), key=len)
    for i, r in enumerate(results):
        extra = [r["parts"][p]["extra_ms"] for p in PARTS]
        missing = sorted(widest - set(r["rows"]))
        label = f"{len(r['rows'])} policies" + (f" (no {', '.join(missing)})" if missing else "")
        label += f": {r['ratio']:.3f}x the members"
        ax.bar([x + i * width for x in range(len(PARTS))], extra, width, label=label)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(results) - 1) / 2 for x in range(len(PARTS))], PARTS)
    ax.set_ylabel("GPU ms per step over the members'")
    ax.set_title("A mixed decode step's GPU work over its members' (rows weighted), by part")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("members")
    ap.add_argument("mixed", nargs="+")
    ap.add_argument("--out")
    ap.add_argument("--plot")
    args = ap.parse_args()
    members_doc = json.loads(Path(args.members).read_text())
    results = [compare(members_doc, json.loads(Path(p).read_text()), p) for p in args.mixed]
    for r in results:
        print(f"{r['mixed']}: {r['tokens_per_s']:.0f} tok/s, {r['ratio']:.3f}x the members' harmonic mean "
              f"({r['members_harmonic_mean']:.0f}); GPU busy {r['gpu_busy_ms_per_step']:.2f} ms a step "
              f"(step {r['step_ms_unprofiled']:.2f} ms unprofiled), members' {r['members_gpu_busy_ms_per_step']:.2f}: "
              f"{r['gpu_busy_ratio']:.3f}x")
        for p, v in r["parts"].items():
            print(f"  {p:<12} {v['mixed_ms']:6.3f} ms ({v['mixed_kernels']:6.1f} kernels)  members "
                  f"{v['members_ms']:6.3f} ({v['members_kernels']:6.1f})  {v['extra_ms']:+.3f}")
    doc = {"members": args.members, "command": "python bench/mixed_kernel_parts.py " + " ".join(
        [args.members, *args.mixed]), "device": members_doc.get("device"), "date": members_doc.get("date"),
        "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"-> {args.out}")
    if args.plot:
        plot(results, args.plot)
        print(f"-> {args.plot}")


if __name__ == "__main__":
    main()
