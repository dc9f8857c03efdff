"""Issue #29's targets at its own scale, from one step-profile JSON (the
eight decode-time policies alone and mixed, bench/step_profile.py) and one
vanilla point (bench/gpu_headline.py --parts vanilla, the same KV memory):
each run's tokens/s as a multiple of vanilla SGLang's 16K generation, both
methods (steady window, whole run), each policy's target marked, and the
mix against its members' harmonic mean in the title (with members not
run: against the measured ones, and how fast the rest may run with the
target met). Prints the same as a markdown table (for docs/gpu-kernels.md).

    python bench/plot_scale_targets.py STEP_PROFILE.json GPU_HEADLINE.json OUT.png [--generate 16384]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_profile import mixed_label  # noqa: E402

#: The issue's targets, as multiples of vanilla's 16K generation: the seed
#: policies 3x, crystalcache 2x, streaming and longflow 5x, the mix 3x (h2o
#: has none; the mix also >= 0.9x its members' harmonic mean).
TARGETS = {"rkv": 3.0, "skipkv": 3.0, "thinkv": 3.0, "crystal_kv": 3.0, "crystalcache": 2.0,
           "streaming": 5.0, "longflow": 5.0, "mixed": 3.0}
MIX_TARGET = 0.9


def vanilla_rate(headline: dict, generate: int) -> float:
    """Vanilla's decode tokens/s for a `generate`-token generation."""
    for entry in headline.get("vanilla", []):
        if entry.get("generate") == generate:
            return entry["tokens_per_s"]
    raise SystemExit(f"no vanilla entry for --generate {generate} (have {[e.get('generate') for e in headline.get('vanilla', [])]})")


def rows_of(profile: dict, vanilla: float) -> list[dict]:
    """One row per run (members in the mix's order, then the mix)."""
    comp = profile.get("comparison") or {}
    mix = comp.get("mixed")
    if not mix or mix not in profile["runs"]:
        raise SystemExit("the step profile holds no mixed run (bench/step_profile.py --mixed 1)")
    names = mix.split(":", 1)[1].split("+")
    assert mix == mixed_label(names)
    out = []
    for name in [*names, mix]:
        run = profile["runs"].get(name)
        key = "mixed" if name == mix else name
        if run is None:  # a call cut short: named, drawn as missing (resume it: --resume 1)
            out.append({"run": name, "key": key, "missing": True, "target": TARGETS.get(key)})
            continue
        window, whole = run["tokens_per_s_unprofiled"], run["tokens_per_s_whole_run"]
        out.append({"run": "mix of " + str(len(names)) if name == mix else name, "key": key,
                    "window": window, "whole": whole, "x_window": window / vanilla, "x_whole": whole / vanilla,
                    "target": TARGETS.get(key), "window_full": run.get("window_full", True),
                    "requests": run.get("requests")})
    return out


def partial_mix(profile: dict, vanilla: float) -> list[str]:
    """With members not run: the mix against the measured members alone
    (rows-weighted harmonic mean), and how fast the missing ones could run
    together (their harmonic mean) with the mix still at MIX_TARGET of all
    its members. The mix of N rows at rate m meets the target while
    sum(rows_i / rate_i) >= MIX_TARGET * N / m; the missing members' share
    of that sum bounds their rate. Empty when every member ran."""
    comp = profile["comparison"]
    mix = profile["runs"][comp["mixed"]]
    rows = comp["member_rows"]
    missing = [n for n in rows if n not in profile["runs"]]
    if not missing:
        return []
    lines = []
    for method, key in (("steady", "tokens_per_s_unprofiled"), ("whole run", "tokens_per_s_whole_run")):
        known = {n: profile["runs"][n][key] for n in rows if n not in missing}
        windowless = [n for n in (*known, comp["mixed"]) if not profile["runs"][n].get("window_full", True)]
        if key == "tokens_per_s_unprofiled" and windowless:
            lines.append(f"{method}: not known ({', '.join(windowless)}: no steady window)")
            continue
        seconds_known = sum(rows[n] / rate for n, rate in known.items())
        measured = sum(rows[n] for n in known) / seconds_known
        room = MIX_TARGET * sum(rows.values()) / mix[key] - seconds_known
        rows_missing = sum(rows[n] for n in missing)
        bound = (f"met at any rate of {', '.join(missing)}" if room <= 0 else
                 f"met unless {', '.join(missing)} run above {rows_missing / room:,.0f} tok/s "
                 f"({rows_missing / room / vanilla:.1f}x vanilla)")
        lines.append(f"{method}: mix / the {len(known)} measured members {mix[key] / measured:.3f}; "
                     f"{MIX_TARGET} of all {len(rows)} {bound}")
    return lines


def table(rows: list[dict], vanilla: float) -> str:
    lines = [f"| run | steady tok/s | whole run tok/s | x vanilla 16K ({vanilla:,.0f} tok/s), steady / whole | target | met |",
             "| --- | ---: | ---: | --- | ---: | --- |"]
    for r in rows:
        target = r["target"]
        if r.get("missing"):
            lines.append(f"| {r['run']} | not run | not run | | {'' if target is None else f'{target:g}x'} | |")
            continue
        if not r["window_full"]:  # the batch ended inside its window: the whole run alone is judged
            met = "" if target is None else "whole run (no window)" if r["x_whole"] >= target else "no"
            lines.append(f"| {r['run']} | no window | {r['whole']:,.0f} | – / {r['x_whole']:.2f} | "
                         f"{'' if target is None else f'{target:g}x'} | {met} |")
            continue
        met = "" if target is None else ("yes" if min(r["x_window"], r["x_whole"]) >= target else
                                         "whole run only" if r["x_whole"] >= target else
                                         "window only" if r["x_window"] >= target else "no")
        lines.append(f"| {r['run']} | {r['window']:,.0f} | {r['whole']:,.0f} | {r['x_window']:.2f} / "
                     f"{r['x_whole']:.2f} | {'' if target is None else f'{target:g}x'} | {met} |")
    return "\n".join(lines)


def plot(rows: list[dict], comp: dict, vanilla: float, title: str, out: str, partial: list[str]) -> None:
    fig, ax = plt.subplots(figsize=(1.0 * len(rows) + 3, 4.6))
    x = list(range(len(rows)))
    # A run without a steady window (its batch ended inside it) or not run has no bar of that kind.
    window = [r["x_window"] if not r.get("missing") and r["window_full"] else 0.0 for r in rows]
    whole = [0.0 if r.get("missing") else r["x_whole"] for r in rows]
    ax.bar([i - 0.2 for i in x], window, 0.4, label="steady window")
    ax.bar([i + 0.2 for i in x], whole, 0.4, label="whole run")
    first_target = min((j for j, q in enumerate(rows) if q["target"] is not None), default=None)
    for i, r in enumerate(rows):
        if r["target"] is not None:
            ax.hlines(r["target"], i - 0.45, i + 0.45, colors="black", linestyles="--", linewidth=1.2,
                      label="target" if i == first_target else None)
        if r.get("missing"):
            ax.annotate("not run", (i, 0.05), ha="center", fontsize=7, rotation=90)
            continue
        for dx, v, shown in ((-0.2, r["x_window"], r["window_full"]), (0.2, r["x_whole"], True)):
            ax.annotate(f"{v:.2f}" if shown else "no window", (i + dx, v if shown else 0.05),
                        textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7,
                        rotation=0 if shown else 90)
    ax.set_xticks(x, [r["run"] for r in rows], fontsize=8, rotation=20)
    ax.set_ylabel(f"x vanilla SGLang 16K ({vanilla:,.0f} tok/s)")
    ratio, whole = comp.get("ratio"), comp.get("whole_run", {}).get("ratio")
    if ratio is not None and whole is not None:
        against = f"\nmix / members' harmonic mean: {ratio} steady, {whole} whole run (target {MIX_TARGET})"
    else:
        against = "".join("\n" + line for line in partial)
    ax.set_title(title + against, fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile")
    ap.add_argument("headline")
    ap.add_argument("out")
    ap.add_argument("--generate", type=int, default=16384)
    args = ap.parse_args()
    profile, headline = json.load(open(args.profile)), json.load(open(args.headline))
    vanilla = vanilla_rate(headline, args.generate)
    rows = rows_of(profile, vanilla)
    cfg = profile["config"]
    title = (f"{profile['device']}: {cfg['requests']} rows, budget {cfg['budget']}, "
             f"{cfg['kv_tokens']:,} KV tokens (vanilla {headline['device']})")
    partial = partial_mix(profile, vanilla)
    plot(rows, profile["comparison"], vanilla, title, args.out, partial)
    print(table(rows, vanilla))
    for line in partial:
        print(line)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
