"""Quality-vs-KV points from a results file: what `kvsieve calibrate auto`
stores for `kv_policy: {"name": "auto", ...}` (service/auto_policy.py).

A point is one (policy, budget) cell set measured on every task, with a
budget a request can carry as is (`N` tokens or `rX` budget_ratio; the
per-item `fX` fractions and `ref` are not points):
- kv_fraction: the mean over tasks of the cell's KV fraction (KV held at the
  end of a request over the full run's);
- quality: the mean over tasks of the accuracy relative to `full` on that
  task; on a task where `full` scores 0 the ratio means nothing, and the
  final-answer agreement with `full` stands in for it.
A built-in preset's cells (`rkv-paper`, ...) are not points: `auto` picks
among policies.
"""

from __future__ import annotations

from statistics import mean
from typing import Optional

from .runner import parse_budget, preset_of
from .summary import summarize

QUALITY_DEFINITION = ("mean over tasks of accuracy / full's accuracy on the task; on a task where full scores 0, "
                      "final-answer agreement with full")


def task_quality(cell: dict, full: dict) -> Optional[float]:
    if "accuracy" not in cell or "accuracy" not in full:
        return None
    if full["accuracy"] > 0:
        return cell["accuracy"] / full["accuracy"]
    vs = cell.get("vs_full")
    return vs["answer_agreement"] if vs else None


def request_budget(label: str) -> Optional[dict]:
    """The kv_policy budget keys of a label, or None when it is per item."""
    kind, value = parse_budget(label)
    if kind == "abs":
        return {"budget": int(value)}
    if kind == "ratio":
        return {"budget_ratio": value}
    return None


def points(data: dict, compress_prompt: Optional[bool] = None) -> list[dict]:
    """The artifact's points (full first), from every complete (policy, budget)."""
    cells = summarize(data)
    tasks = sorted({c["task"] for c in cells})
    full = {c["task"]: c for c in cells if c["policy"] == "full"}
    groups: dict[tuple, dict] = {}
    for c in cells:
        if c["policy"] != "full" and c["budget"] != "ref" and preset_of(c["policy"]) is None:
            groups.setdefault((c["policy"], c["budget"]), {})[c["task"]] = c
    out = [{"kv_policy": {"name": "full"}, "kv_fraction": 1.0, "quality": 1.0,
            "accuracy": {t: full[t].get("accuracy") for t in tasks if t in full}}]
    for (policy, budget), by_task in sorted(groups.items()):
        keys = request_budget(budget)
        if keys is None or set(by_task) != set(tasks) or any(t not in full for t in tasks):
            continue
        quality = [task_quality(by_task[t], full[t]) for t in tasks]
        fracs = [by_task[t].get("kv_fraction") for t in tasks]
        if any(q is None for q in quality) or any(f is None for f in fracs):
            continue  # an errored or empty cell: no point
        kv_policy = {"name": policy, **keys}
        if compress_prompt is not None:
            kv_policy["compress_prompt"] = compress_prompt
        out.append({"kv_policy": kv_policy, "kv_fraction": round(mean(fracs), 4),
                    "quality": round(mean(quality), 4),
                    "accuracy": {t: by_task[t]["accuracy"] for t in tasks}})
    return out
