"""Markdown tables and PNG plots from results files (python -m bench.eval report).

Plots (PREFIX defaults to `eval`):
  PREFIX-accuracy.png   accuracy vs measured KV fraction, per task, one line per policy
  PREFIX-fidelity.png   greedy tokens to the first divergence and final-answer
                        agreement vs KV fraction, against full and the no-eviction reference
  PREFIX-<recall file>.png top-10 attended-token recall vs budget (with --recall)
  PREFIX-throughput.png (from bench/results/gpu-headline.json, when given with --throughput)
  PREFIX-presets-NAME.png accuracy vs client-side decode speed, each built-in
                        preset's cell beside its fast default's (when the file has preset cells)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from .runner import base_policy, preset_of
from .summary import speed, summarize

TASK_TITLES = {"math": "GSM-style math (math-verify)", "needle": "needle in a haystack (exact match)",
               "da": "delayed association (exact match)"}


def _budget_order(label: str) -> tuple:
    if label == "-":
        return (0, 0.0)
    if label == "ref":
        return (4, 0.0)
    if label == "preset":
        return (5, 0.0)
    kind = {"f": 1, "r": 2}.get(label[0], 3)
    return (kind, float(label[1:] if kind in (1, 2) else label))


def _pct(x: Optional[float]) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def _num(x: Optional[float], digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def load(paths: list[str]) -> list[tuple[dict, list[dict]]]:
    out = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        out.append((data, summarize(data)))
    return out


def accuracy_tables(data: dict, cells: list[dict]) -> str:
    lines = []
    tasks = [t for t in ("math", "needle", "da") if any(c["task"] == t for c in cells)]
    for task in tasks:
        rows = [c for c in cells if c["task"] == task]
        budgets = sorted({c["budget"] for c in rows if c["policy"] != "full"}, key=_budget_order)
        n_items = len(data["items"].get(task, []))
        full = next((c for c in rows if c["policy"] == "full"), None)
        lines.append(f"**{TASK_TITLES.get(task, task)}**, {n_items} items; `full`: accuracy "
                     f"{_pct(full.get('accuracy')) if full else '–'}, mean output "
                     f"{_num(full.get('completion_tokens'), 0) if full else '–'} tokens, prompt "
                     f"{_num(full.get('prompt_tokens'), 0) if full else '–'} tokens. "
                     "Each cell: accuracy (KV held at the end / full run's KV); a cell cut short names "
                     "its items and `full`'s accuracy on the same items.")
        lines.append("")
        lines.append("| policy | " + " | ".join(f"`{b}`" for b in budgets) + " |")
        lines.append("| --- |" + " --- |" * len(budgets))
        for policy in sorted({c["policy"] for c in rows if c["policy"] != "full"}):
            cols = []
            for b in budgets:
                c = next((c for c in rows if c["policy"] == policy and c["budget"] == b), None)
                if c is None or (not c["done"] and c["n"] < n_items and "accuracy" not in c):
                    cols.append("not run" if c is None or c["n"] == 0 else f"{c['n']}/{n_items} run")
                elif "accuracy" not in c:
                    cols.append("error")
                else:
                    partial = "" if c["n"] >= n_items else \
                        f" ({c['n']}/{n_items}; full {_pct(c.get('full_accuracy_same_items'))} on them)"
                    cols.append(f"{_pct(c['accuracy'])} ({_pct(c.get('kv_fraction'))}){partial}")
            lines.append(f"| {policy} | " + " | ".join(cols) + " |")
        lines.append("")
    return "\n".join(lines)


def fidelity_tables(data: dict, cells: list[dict]) -> str:
    lines = []
    tasks = [t for t in ("math", "needle", "da") if any(c["task"] == t for c in cells)]
    for task in tasks:
        rows = [c for c in cells if c["task"] == task and c["policy"] != "full" and "accuracy" in c]
        if not rows:
            continue
        lines.append(f"**{TASK_TITLES.get(task, task)}**: greedy tokens until the first divergence / identical "
                     "outputs / final-answer agreement, against the same policy with no eviction (`ref`, solo) "
                     "and against `full`.")
        lines.append("")
        lines.append("| policy | budget | KV kept | evicted tokens | prompt from radix cache | vs ref: first divergence | "
                     "identical | answer agreement | vs full: first divergence | identical | answer agreement |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for c in sorted(rows, key=lambda c: (c["policy"], _budget_order(c["budget"]))):
            r, f = c.get("vs_ref"), c.get("vs_full")
            lines.append(
                f"| {c['policy']} | `{c['budget']}` | {_pct(c.get('kv_fraction'))} | {_num(c.get('evicted_tokens'), 0)} | "
                f"{_pct(c.get('prompt_cached'))} | "
                + (f"{_num(r['first_divergence'])} | {_pct(r['identical'])} | {_pct(r['answer_agreement'])} | "
                   if r else "– | – | – | ")
                + (f"{_num(f['first_divergence'])} | {_pct(f['identical'])} | {_pct(f['answer_agreement'])} |"
                   if f else "– | – | – |"))
        lines.append("")
    return "\n".join(lines)


def _policy_styles(policies: list[str]) -> dict:
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10")
    markers = "osD^v<>ph*"
    return {p: (cmap(i % 10), markers[i % len(markers)]) for i, p in enumerate(sorted(policies))}


#: Fewest answered items for a cell cut short to be plotted (relative accuracy).
MIN_ITEMS_RELATIVE = 20


def _machine_short(meta: dict) -> str:
    machine = meta.get("machine", "")
    return machine.split("server on ", 1)[1] if "server on " in machine else machine[:60]


def plot_accuracy(cells: list[dict], meta: dict, out: Path) -> None:
    """Accuracy vs KV held, a line per policy. Where a cell was cut short
    (it holds the items that ended first), every point is accuracy over
    `full`'s on the same items, so that cells of different items compare."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in ("math", "needle", "da") if any(c["task"] == t for c in cells)]
    styles = _policy_styles(list({c["policy"] for c in cells if c["policy"] != "full"}))
    relative = any(not c["done"] and "accuracy" in c and c["policy"] != "full" for c in cells)

    def y(c: dict) -> Optional[float]:
        if not relative:
            return c["accuracy"]
        base = c.get("full_accuracy_same_items")
        if not base or c["n"] - c["errors"] < MIN_ITEMS_RELATIVE:
            return None  # a ratio over a handful of items is noise
        return c["accuracy"] / base

    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 4.4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rows = [c for c in cells if c["task"] == task and "accuracy" in c]
        full = next((c for c in rows if c["policy"] == "full"), None)
        if full:
            ax.axhline(1.0 if relative else full["accuracy"], color="black", ls="--", lw=1, label="full")
        for policy, (color, marker) in styles.items():
            pts = sorted((x, v) for x, v in ((c["kv_fraction"], y(c)) for c in rows
                                             if c["policy"] == policy and c["budget"] != "ref"
                                             and c.get("kv_fraction") is not None)
                         if v is not None)
            if pts:
                ax.plot(*zip(*pts), marker=marker, color=color, label=policy, lw=1.2, ms=5, alpha=0.85)
        _percent_log_axis(ax)
        ax.set_xlabel("KV held at the end / full run's KV (log)")
        ax.set_ylabel("accuracy / full's on the same items" if relative else "accuracy")
        ax.set_ylim(-0.03, max([1.03, *(y(c) or 0 for c in rows)]) + 0.05 if relative else 1.03)
        ax.set_title(TASK_TITLES.get(task, task), fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{meta.get('model')}: accuracy vs KV budget through kvsieve serve\n"
                 f"({_machine_short(meta)}, {meta.get('started', '')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _percent_log_axis(ax) -> None:
    """A log x axis of KV fractions labelled in percent, minor labels off:
    over less than a decade matplotlib labels every minor tick in
    scientific notation and they run into each other."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{100 * x:g}%"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot_fidelity(cells: list[dict], meta: dict, out: Path) -> None:
    """Tokens to the first greedy divergence and final-answer agreement vs
    KV fraction: solid against `full`, dashed against `ref` (the same path
    without eviction) where that cell ran; x at fraction 1: ref vs full."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in ("math", "needle", "da") if any(c["task"] == t for c in cells)]
    styles = _policy_styles(list({c["policy"] for c in cells if c["policy"] != "full"}))
    fig, axes = plt.subplots(2, len(tasks), figsize=(5.2 * len(tasks), 8), squeeze=False)
    for j, task in enumerate(tasks):
        rows = [c for c in cells if c["task"] == task and c["budget"] != "ref" and c.get("kv_fraction") is not None]
        refs = {c["policy"]: c for c in cells if c["task"] == task and c["budget"] == "ref" and c.get("vs_full")}
        for policy, (color, marker) in styles.items():
            for against, ls in (("vs_full", "-"), ("vs_ref", "--")):
                pts = sorted((c["kv_fraction"], c[against]["first_divergence"], c[against]["answer_agreement"])
                             for c in rows if c["policy"] == policy and c.get(against))
                if pts:
                    xs, div, agree = zip(*pts)
                    label = policy if against == "vs_full" else f"{policy} vs ref"
                    axes[0][j].plot(xs, div, marker=marker, color=color, label=label, lw=1.2, ms=5, ls=ls)
                    axes[1][j].plot(xs, agree, marker=marker, color=color, label=label, lw=1.2, ms=5, ls=ls)
            if policy in refs:  # the no-eviction reference against full: the numerics floor
                axes[0][j].scatter([1.0], [refs[policy]["vs_full"]["first_divergence"]], color=color,
                                   marker="x", s=30)
        axes[0][j].set_title(f"{TASK_TITLES.get(task, task)}\nfirst greedy divergence (solid: from full, "
                             "dashed: from ref)", fontsize=9)
        axes[0][j].set_ylabel("tokens until the first divergence")
        axes[1][j].set_title("final-answer agreement (solid: with full, dashed: with ref)", fontsize=9)
        axes[1][j].set_ylabel("agreement")
        axes[1][j].set_ylim(-0.03, 1.03)
        for ax in (axes[0][j], axes[1][j]):
            _percent_log_axis(ax)
            ax.set_xlabel("KV held at the end / full run's KV (log)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{meta.get('model')}: fidelity against full and against the same path without eviction "
                 f"({meta.get('started', '')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def recall_table(path: Path) -> str:
    """Top-10 attended-token recall per (task, policy, budget)."""
    d = json.loads(path.read_text())
    meta = d.get("meta", {})
    lines = [f"From `{path}`: {meta.get('model')}, {meta.get('machine')}, started {meta.get('started')}, "
             f"command `{meta.get('command')}`; recorded every {meta.get('every')} decode steps; reference: "
             f"{meta.get('reference')}.", "",
             "| task | policy | budget | requests | recorded steps (mean) | top-10 recall | KV kept (tokens, mean) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for key in sorted(d.get("cells", {}), key=lambda k: (k.split("|")[0], k.split("|")[1],
                                                        _budget_order(k.split("|")[2]))):
        c = d["cells"][key]
        ok = [r for r in c["records"].values() if r.get("recall") is not None]
        errors = len(c["records"]) - len(ok)
        steps = sum(r["steps"] for r in ok) / len(ok) if ok else None
        kept = [r["kv_usage"].get("retained_tokens") for r in ok if r.get("kv_usage", {}).get("retained_tokens")]
        lines.append(f"| {c['task']} | {c['policy']} | `{c['budget']}` | {len(ok)}"
                     + (f" (+{errors} errors)" if errors else "") + f" | {_num(steps)} | {_num(c.get('recall'), 3)} | "
                     f"{_num(sum(kept) / len(kept), 0) if kept else '–'} |")
    return "\n".join(lines) + "\n"


def plot_recall(path: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = json.loads(path.read_text())
    cells = [c for c in d.get("cells", {}).values() if c.get("recall") is not None and c["budget"] != "ref"]
    if not cells:
        return
    styles = _policy_styles(list({c["policy"] for c in cells}))
    fig, ax = plt.subplots(figsize=(6.5, 4.4))
    for policy, (color, marker) in styles.items():
        pts = sorted((int(c["budget"]), c["recall"]) for c in cells if c["policy"] == policy)
        ax.plot(*zip(*pts), marker=marker, color=color, label=policy, lw=1.2, ms=5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (tokens per layer and kv head)")
    ax.set_ylabel("top-10 attended-token recall")
    ax.set_ylim(0, 1.03)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    meta = d.get("meta", {})
    ax.set_title(f"{meta.get('model')}: top-10 recall (ThinKV §6.3), {meta.get('started')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def throughput_table(path: Path) -> str:
    d = json.loads(path.read_text())
    lines = [f"From `{path}`: {d.get('device')}, {d.get('date')}, command `{d.get('command')}`.", "",
             "| run | policy | budget | requests | context at window | tok/s | TPOT p50 ms | TPOT p99 ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for part in ("vanilla", "kvsieve"):
        for r in d.get(part, []):
            if "error" in r:
                lines.append(f"| {part} | {r.get('policy', '–')} | {r.get('budget', '–')} | – | – | "
                             f"error: {r['error'][:60]} | – | – |")
                continue
            lines.append(f"| {part} | {r.get('policy', 'full (SGLang)')} | {r.get('budget', '–')} | {r['requests']} | "
                         f"{r.get('context_at_window', '–')} | {r['tokens_per_s']:.0f} | {r['tpot_p50_ms']:.1f} | "
                         f"{r['tpot_p99_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def plot_throughput(path: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = json.loads(path.read_text())
    runs = [("vanilla\n" + str(r.get("generate", "")), r) for r in d.get("vanilla", []) if "error" not in r]
    runs += [(f"{r['policy']}\nB={r['budget']}", r) for r in d.get("kvsieve", []) if "error" not in r]
    if not runs:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    labels = [name for name, _ in runs]
    colors = ["grey" if name.startswith("vanilla") else "tab:blue" for name in labels]
    axes[0].bar(labels, [r["tokens_per_s"] for _, r in runs], color=colors)
    axes[0].set_ylabel("decode tokens/s")
    axes[1].bar(labels, [r["requests"] for _, r in runs], color=colors)
    axes[1].set_ylabel("requests running at once")
    axes[2].bar(labels, [r["tpot_p50_ms"] for _, r in runs], color=colors)
    axes[2].set_ylabel("TPOT p50 (ms)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7, rotation=60)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{d.get('device')}, {d.get('date')}: {d.get('command', '')[:120]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def preset_pairs(data: dict, cells: list[dict]) -> list[tuple[dict, dict]]:
    """(preset cell, its fast default's cell) on the items both answered:
    the base policy at the same budget; a `preset`-budget cell (its own
    budget) beside every budget of the base policy. Each side is summarized
    again over the common items, so both count the same problems."""
    from statistics import mean

    from .summary import fidelity, kv_fraction

    pairs = []
    for c in cells:
        if "accuracy" not in c or preset_of(c["policy"]) is None:
            continue
        base = base_policy(c["policy"])
        for d in cells:
            if d["task"] != c["task"] or d["policy"] != base or "accuracy" not in d or d["budget"] == "ref" \
                    or (c["budget"] != "preset" and d["budget"] != c["budget"]):
                continue
            recs = [data["cells"][f"{x['task']}|{x['policy']}|{x['budget']}"]["records"] for x in (c, d)]
            ids = sorted(i for i in recs[0] if "error" not in recs[0][i] and i in recs[1] and "error" not in recs[1][i])
            if not ids:
                continue
            full = data["cells"].get(f"{c['task']}|full|-", {}).get("records", {})
            sides = []
            for x, r in zip((c, d), recs):
                fracs = [f for f in (kv_fraction(r[i], full.get(i)) for i in ids) if f is not None]
                sides.append({**x, "n_common": len(ids), "accuracy": mean(r[i]["correct"] for i in ids),
                              "correct": sum(r[i]["correct"] for i in ids),
                              "kv_fraction": mean(fracs) if fracs else None,
                              "completion_tokens": mean(r[i]["usage"]["completion_tokens"] for i in ids),
                              "evicted_tokens": mean(r[i]["kv_usage"].get("evicted_tokens", 0) for i in ids),
                              "errors_left_out": x["errors"], "vs_full": fidelity({i: r[i] for i in ids}, full),
                              **speed([r[i] for i in ids])})
            sides[0]["full_correct"] = sum(full[i]["correct"] for i in ids if i in full and "error" not in full[i])
            pairs.append((sides[0], sides[1]))
    return pairs


#: Fewest common problems for a preset's pair to be plotted (the table lists every pair).
MIN_PAIR_ITEMS = 3


def _differing_params(preset: str) -> str:
    """The preset's settings that differ from its policy's defaults."""
    from kvsieve.policies import get_policy

    value = preset_of(preset)
    defaults = get_policy(value["name"]).Params().model_dump()
    diff = [f"{k} {json.dumps(v)}" for k, v in value.get("params", {}).items()
            if (tuple(v) if isinstance(v, list) else v) != defaults.get(k)]
    if "budget_ratio" in value:
        diff.insert(0, f"budget_ratio {value['budget_ratio']}")
    return ", ".join(diff) or "none beyond the budget"


def presets_table(data: dict, cells: list[dict]) -> str:
    pairs = preset_pairs(data, cells)
    if not pairs:
        return ""
    lines = ["Each row: a preset's cell and its fast default's on the problems both answered (`n`); accuracy as "
             "correct of n (`full`'s correct on the same n in brackets), answers as full's: final answers equal to "
             "`full`'s (right or wrong) of n, KV held at the end / full run's KV, "
             "client-side speed: output tokens / latency summed over the requests (tok/s per request) and the "
             "median latency per output token (TPOT; both include queueing and prefill, with the cell's "
             f"batch of {data['meta'].get('concurrency')} in flight).", "",
             "| preset | budget | differs from the default in | n | accuracy | answers as full's | KV held | "
             "tok/s per request | TPOT ms | fast default | budget | accuracy | answers as full's | KV held | "
             "tok/s per request | TPOT ms |",
             "| --- |" + " --- |" * 15]

    def agree(x: dict) -> str:
        vs = x.get("vs_full")
        return f"{round(vs['answer_agreement'] * vs['n'])}" if vs else "–"

    for p, d in sorted(pairs, key=lambda pd: (pd[0]["policy"], _budget_order(pd[1]["budget"]))):
        lines.append(
            f"| {p['policy']} | `{p['budget']}` | {_differing_params(p['policy'])} | {p['n_common']} | "
            f"{p['correct']} ({p['full_correct']}) | {agree(p)} | {_pct(p['kv_fraction'])} | "
            f"{_num(p.get('decode_tok_s'), 2)} | {_num(p.get('tpot_ms'), 0)} | {d['policy']} | `{d['budget']}` | "
            f"{d['correct']} | {agree(d)} | {_pct(d['kv_fraction'])} | {_num(d.get('decode_tok_s'), 2)} | "
            f"{_num(d.get('tpot_ms'), 0)} |")
    left = [f"{x['policy']} `{x['budget']}`: {x['errors_left_out']}" for p, d in pairs for x in (p, d)
            if x["errors_left_out"]]
    if left:
        lines += ["", "Requests answered with an error (left out of both sides): " + "; ".join(sorted(set(left))) + "."]
    return "\n".join(lines) + "\n"


def plot_presets(data: dict, cells: list[dict], out: Path) -> None:
    """Accuracy vs client-side decode speed: a filled marker per preset cell,
    a hollow one for its fast default on the same problems, joined, and a
    black bar at `full`'s accuracy on those problems."""
    pairs = preset_pairs(data, cells)
    if not pairs:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [(p, d) for p, d in pairs if p["n_common"] >= MIN_PAIR_ITEMS]  # the table lists the rest
    if not pairs:
        return
    styles = _policy_styles(sorted({p["policy"] for p, _ in pairs}))
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for p, d in pairs:
        color, marker = styles[p["policy"]]
        xs, ys = [p.get("decode_tok_s"), d.get("decode_tok_s")], [p["accuracy"], d["accuracy"]]
        if None in xs:
            continue
        ax.plot(xs, ys, color=color, lw=0.8, alpha=0.6, ls=":")
        ax.scatter(xs[:1], ys[:1], color=color, marker=marker, s=55,
                   label=f"{p['policy']} `{p['budget']}` (KV {_pct(p['kv_fraction'])})")
        ax.scatter(xs[1:], ys[1:], facecolors="none", edgecolors=color, marker=marker, s=55,
                   label=f"  fast {d['policy']} `{d['budget']}` (KV {_pct(d['kv_fraction'])})")
        ax.scatter([xs[0]], [p["full_correct"] / p["n_common"]], color="black", marker="_", s=120,
                   label=f"  full on the same {p['n_common']} problems: {p['full_correct']} solved")
    ax.set_xlabel("output tokens / latency per request (tok/s; queueing and prefill included)")
    ax.set_ylabel("accuracy on the pair's problems")
    ax.set_ylim(-0.03, 1.03 if max(p["accuracy"] for pair in pairs for p in pair) > 0.6 else 0.6)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    meta = data["meta"]
    ax.set_title(f"{meta.get('model')}: paper presets (filled) vs fast defaults (hollow), "
                 f"{meta.get('concurrency')} requests in flight\n"
                 "(a pair's two cells may come from different runs: their speeds compare only within one run)",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def report(args) -> int:
    sections = []
    for (data, cells), path in zip(load(args.results), args.results):
        meta = data["meta"]
        runs = meta.get("runs", [])
        sections.append(f"### {meta.get('model')} (`{path}`)\n")
        sections.append(f"Machine: {meta.get('machine')}. Started {runs[0]['started'] if runs else meta.get('started')}"
                        f", {len(runs)} run(s) of the resumable grid; concurrency {meta.get('concurrency')}. "
                        f"Command: `{runs[0]['command'] if runs else meta.get('command')}`\n")
        sections.append("#### Accuracy\n")
        sections.append(accuracy_tables(data, cells))
        sections.append("#### Fidelity\n")
        sections.append(fidelity_tables(data, cells))
        presets = presets_table(data, cells)
        if presets:
            sections.append("#### Paper presets against the fast defaults\n")
            sections.append(presets)
        if args.plots:
            plots = Path(args.plots)
            plots.mkdir(parents=True, exist_ok=True)
            name = Path(path).stem.removeprefix("eval-")
            # the presets' cells have their own plot (below); these keep the policies'
            policies = [c for c in cells if preset_of(c["policy"]) is None]
            plot_accuracy(policies, meta, plots / f"{args.prefix}-accuracy-{name}.png")
            plot_fidelity(policies, meta, plots / f"{args.prefix}-fidelity-{name}.png")
            if presets:
                plot_presets(data, cells, plots / f"{args.prefix}-presets-{name}.png")
    if getattr(args, "recall", None):
        sections.append("### Top-10 attended-token recall\n")
        sections.append(recall_table(Path(args.recall)))
        if args.plots:
            name = Path(args.recall).stem.removeprefix("eval-")
            plot_recall(Path(args.recall), Path(args.plots) / f"{args.prefix}-{name}.png")
    if getattr(args, "throughput", None):
        sections.append("### Throughput (GPU headline)\n")
        sections.append(throughput_table(Path(args.throughput)))
        if args.plots:
            plot_throughput(Path(args.throughput), Path(args.plots) / f"{args.prefix}-throughput.png")
    text = "\n".join(sections)
    if args.markdown:
        Path(args.markdown).write_text(text)
    else:
        sys.stdout.write(text)
    return 0
