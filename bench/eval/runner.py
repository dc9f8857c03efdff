"""The policy x budget grid, run through a real kvsieve server, resumable.

A results file holds one entry per cell `task|policy|budget`; each cell
holds one record per item (id, output text and token ids, grade, the budget
sent, usage and kv_usage, latency). The file is rewritten atomically after
every item, so an interrupted run loses at most the request in flight; a
rerun skips what is done, item by item.

Budgets (labels in the results):
  `N`      an absolute budget of N tokens (per layer and kv head);
  `fX`     X times the full run's KV of the same item (the tokens the budget
           governs: prompt and output when the prompt is compressed, else the
           output), floored at 16;
  `rX`     budget_ratio X (the server's: X of the private tokens so far);
  `ref`    a budget that evicts nothing (prompt + max_tokens + 64): the
           fidelity reference, the same compressed path without eviction;
  `preset` a built-in preset's own budget (or budget_ratio), nothing added:
           only preset cells run it (crystalcache-paper-b30 and -b50 are
           defined by their beta).
`full` runs once per task, budget label `-`.

A cell's policy is a policy name or a built-in preset's name
(kvsieve.service.presets, e.g. `rkv-paper`): a preset cell sends
{"preset": NAME} plus the cell's budget and compress_prompt, and its base
policy (the preset's `name`) decides compress_prompt's default and so the
tokens an `fX` budget counts.

Requests are sent one at a time by default (solo): SGLang's CPU path is not
batch-invariant, so greedy outputs of concurrent requests differ from solo
ones; `concurrency` > 1 is faster and recorded in the results.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

from .grading import final_answer, grade
from .tasks import COMPRESS_PROMPT, Item

MIN_FRACTION_BUDGET = 16
REF_SLACK = 64


def parse_budget(label: str) -> tuple[str, float]:
    """('abs'|'frac'|'ratio'|'ref'|'preset', value) of a budget label; ValueError if bad."""
    if label in ("ref", "preset"):
        return label, 0.0
    kind = {"f": "frac", "r": "ratio"}.get(label[:1])
    text = label[1:] if kind else label
    try:
        value = float(text) if kind else int(text)
    except ValueError:
        raise ValueError(f"budget {label!r}: want N (tokens), fX (fraction of the full run's KV), rX "
                         f"(budget_ratio), ref or preset") from None
    if kind and not 0 < value <= 1:
        raise ValueError(f"budget {label!r}: the fraction must be in (0, 1]")
    if not kind and value < 1:
        raise ValueError(f"budget {label!r}: must be at least 1 token")
    return kind or "abs", value


@lru_cache(maxsize=1)
def builtin_presets() -> dict[str, dict]:
    """{name: kv_policy} of the built-in presets this build serves (read
    once; callers do not change it)."""
    from kvsieve.service.presets import usable_builtins

    return usable_builtins()


def preset_of(policy: str) -> Optional[dict]:
    """The built-in preset's kv_policy when `policy` names one, else None."""
    if policy == "full":
        return None
    from kvsieve.policies import policy_names

    if policy in policy_names():
        return None
    return builtin_presets().get(policy)


def base_policy(policy: str) -> str:
    """The policy a cell runs: a preset's `name`, else the name itself."""
    preset = preset_of(policy)
    return preset["name"] if preset else policy


def cell_key(task: str, policy: str, budget: str) -> str:
    return f"{task}|{policy}|{budget}"


def machine(device: str = "cpu") -> str:
    """The host's CPU, and its GPUs where the server runs on them."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    host = f"{model}, {len(os.sched_getaffinity(0))} cores usable, {platform.system()}"
    if device != "cuda":
        return f"{host} (server on CPU)"
    return f"{host}; server on {', '.join(gpu_names()) or 'a GPU (nvidia-smi not found)'}"


def gpu_names() -> list[str]:
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def serve_device(serve_args: list[str]) -> str:
    """The device `kvsieve serve` runs on, from the harness's --serve-arg list."""
    device = "cpu"
    for i, arg in enumerate(serve_args):
        if arg.startswith("--device="):
            device = arg.split("=", 1)[1]
        elif arg == "--device" and i + 1 < len(serve_args):
            device = serve_args[i + 1]
    return device


class Results:
    """The results file: meta, items, cells; saved atomically."""

    def __init__(self, path: Path, meta: dict):
        self.path = Path(path)
        if self.path.exists():
            self.data = json.loads(self.path.read_text())
            old = self.data.get("meta", {})
            for key in ("model", "tasks_config"):
                if key in old and old[key] != meta.get(key):
                    raise ValueError(f"{self.path}: made with another {key} ({old[key]!r}); use another --out")
            runs = old.get("runs", [])
        else:
            self.data = {"meta": {}, "items": {}, "cells": {}}
            runs = []
        run = {k: meta[k] for k in ("command", "started", "machine", "concurrency") if k in meta}
        self.data["meta"] = {**self.data.get("meta", {}), **meta, "runs": runs + [run]}

    def cell(self, key: str) -> dict:
        return self.data["cells"].setdefault(key, {"records": {}})

    def save(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=None, separators=(",", ":")))
        os.replace(tmp, self.path)


@dataclass
class Cell:
    task: str
    policy: str
    budget: str  # label; "-" for full

    @property
    def key(self) -> str:
        return cell_key(self.task, self.policy, self.budget)


def plan(tasks: list[str], policies: list[str], budgets: list[str]) -> list[Cell]:
    """Cells in run order: `full` of every task first (fractions and
    fidelity need it), then budget by budget, every policy of it. The
    `preset` budget makes cells of the presets only."""
    cells = [Cell(t, "full", "-") for t in tasks]
    for b in budgets:
        for p in policies:
            if p == "full" or (b == "preset" and preset_of(p) is None):
                continue
            cells += [Cell(t, p, b) for t in tasks]
    return cells


def _governed_tokens(full_record: dict, prompt_compressed: bool) -> int:
    usage = full_record["usage"]
    out = usage["completion_tokens"]
    return usage["prompt_tokens"] + out if prompt_compressed else out


def kv_policy_for(cell: Cell, item: Item, full_record: Optional[dict], compress_mode: str = "task") -> dict:
    """The kv_policy object one request of `cell` sends. `compress_mode`:
    "task" (COMPRESS_PROMPT per task) or "always" (compress_prompt true on
    every task: what `kvsieve calibrate auto` measures, so that a point's
    kv_policy is one object for every task)."""
    if cell.policy == "full":
        return {"name": "full"}
    from kvsieve.policies import get_policy

    preset = preset_of(cell.policy)
    spec: dict = {"preset": cell.policy} if preset else {"name": cell.policy}
    compress = True if compress_mode == "always" else COMPRESS_PROMPT.get(item.task)
    if compress is not None:
        spec["compress_prompt"] = compress
    default = (preset or {}).get("compress_prompt")
    if default is None:
        default = get_policy(base_policy(cell.policy)).compress_prompt
    prompt_compressed = compress if compress is not None else default
    kind, value = parse_budget(cell.budget)
    if kind == "preset":
        if preset is None:
            raise ValueError(f"{cell.key}: the `preset` budget is a preset's own; {cell.policy!r} is not a preset")
    elif kind == "abs":
        spec["budget"] = int(value)
    elif kind == "ratio":
        spec["budget_ratio"] = value
    elif kind == "frac":
        if full_record is None or "usage" not in full_record:
            raise RuntimeError(f"{cell.key}: the full run of {item.id} is missing")
        spec["budget"] = max(MIN_FRACTION_BUDGET, math.ceil(value * _governed_tokens(full_record, prompt_compressed)))
    else:  # ref
        if full_record is None or "usage" not in full_record:
            raise RuntimeError(f"{cell.key}: the full run of {item.id} is missing")
        spec["budget"] = full_record["usage"]["prompt_tokens"] + item.max_tokens + REF_SLACK
    return spec


def request_item(client, cell: Cell, item: Item, full_record: Optional[dict], compress_mode: str = "task") -> tuple:
    """(kv_policy sent, response): the part of an item that may run in a thread."""
    kv_policy = kv_policy_for(cell, item, full_record, compress_mode)
    return kv_policy, client.chat(item.messages, item.max_tokens, kv_policy)


def run_item(client, cell: Cell, item: Item, full_record: Optional[dict], compress_mode: str = "task") -> dict:
    return make_record(item, *request_item(client, cell, item, full_record, compress_mode))


def make_record(item: Item, kv_policy: dict, resp: dict) -> dict:
    """The item's record, graded. In the main thread: math-verify's parse
    times out with signal.alarm, which only the main thread may use."""
    record: dict = {"id": item.id, "kv_policy": kv_policy, "latency_s": round(resp["latency_s"], 3)}
    if "error" in resp:
        record.update(status=resp["status"], error=resp["error"])
        return record
    choice = resp["choices"][0]
    text = choice["message"]["content"]
    record.update(
        text=text, token_ids=choice.get("token_ids", []), finish_reason=choice["finish_reason"],
        usage=resp["usage"], kv_usage=resp["kv_usage"],
        answer=final_answer(item.task, text), correct=grade(item.task, text, item.answer),
    )
    return record


def run_grid(client, results: Results, items: dict[str, list[Item]], cells: list[Cell],
             concurrency: int = 1, progress: Optional[Callable[[int], None]] = None,
             on_cell: Optional[Callable[[Cell], None]] = None, compress_mode: str = "task",
             all_items: Optional[dict[str, list[Item]]] = None) -> dict[str, int]:
    """Run every missing (cell, item); returns counts {ran, skipped, errors}.
    `all_items`: the task's whole item list, recorded in the file when
    `items` is a slice of it (a slice's cells stay not done).
    Solo (concurrency 1), cell after cell; otherwise every cell's items go
    to one queue in grid order, so a GPU batch holds several cells at once
    and a cell's slowest item does not idle the others."""
    fulls = [c for c in cells if c.policy == "full"]
    if concurrency > 1 and fulls and len(fulls) < len(cells):
        # `full` first, to the end: fractions and `ref` budgets read its records.
        first = run_grid(client, results, items, fulls, concurrency, progress, on_cell, compress_mode, all_items)
        rest = run_grid(client, results, items, [c for c in cells if c.policy != "full"], concurrency,
                        progress, on_cell, compress_mode, all_items)
        return {k: first[k] + rest[k] for k in first}
    counts = {"ran": 0, "skipped": 0, "errors": 0}
    results.data["items"] = {t: [i.to_json() for i in its] for t, its in (all_items or items).items()}
    whole = {t: len(its) for t, its in (all_items or items).items()}
    work: list[tuple[Cell, Item]] = []
    left: dict[str, int] = {}  # cell key -> items not yet recorded
    for cell in cells:
        entry = results.cell(cell.key)
        entry.update(task=cell.task, policy=cell.policy, budget=cell.budget)
        todo = [i for i in items[cell.task] if i.id not in entry["records"]]
        counts["skipped"] += len(items[cell.task]) - len(todo)
        if progress:
            progress(len(items[cell.task]) - len(todo))
        if not todo and len(entry["records"]) >= whole[cell.task]:
            entry["done"] = True
        left[cell.key] = len(todo)
        work += [(cell, i) for i in todo]

    def one(job: tuple[Cell, Item]) -> tuple:
        cell, item = job
        full = results.cell(cell_key(cell.task, "full", "-"))["records"].get(item.id)
        return request_item(client, cell, item, full, compress_mode)

    def record(cell: Cell, item: Item, kv_policy: dict, resp: dict) -> None:
        entry = results.cell(cell.key)
        rec = make_record(item, kv_policy, resp)
        entry["records"][item.id] = rec
        counts["ran"] += 1
        counts["errors"] += "error" in rec
        left[cell.key] -= 1
        if left[cell.key] == 0 and len(entry["records"]) >= whole[cell.task]:
            entry["done"] = True
        results.save()
        if progress:
            progress(1)

    if concurrency <= 1:
        current = None
        for cell, item in work:
            if on_cell and cell.key != current:
                current = cell.key
                on_cell(cell)
            record(cell, item, *one((cell, item)))
        results.save()
        return counts
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        futures = {pool.submit(one, job): job for job in work}
        for future in as_completed(futures):
            cell, item = futures[future]
            if on_cell:
                on_cell(cell)
            record(cell, item, *future.result())  # graded here, in the main thread
    except BaseException:
        # stopping (SIGTERM, an error): leave the requests in flight behind
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    results.save()
    return counts


def total_items(items: dict[str, list[Item]], cells: list[Cell]) -> int:
    return sum(len(items[c.task]) for c in cells)


def new_meta(model: str, model_dir: Optional[str], tasks_config: dict, command: str, concurrency: int,
             device: str = "cpu") -> dict:
    return {
        "model": model, "model_dir": model_dir, "tasks_config": tasks_config, "command": command,
        "concurrency": concurrency, "machine": machine(device),
        "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "greedy": True, "time": time.time(),
    }
