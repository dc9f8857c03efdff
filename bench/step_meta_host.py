"""A decode step's host metadata (issue #29, "host work per step"): what
`init_forward_metadata` costs the host at a serving step, without an engine.

    python bench/step_meta_host.py [--rows 16,32,64,128] [--policies ten] [--steps 200]
        [--classes 1,3,9] [--device cpu|cuda] [--out bench/results/step-meta-host-cpu.json]

Builds the region at R1-Distill-Qwen-7B's attention shapes (28 layers, 4 KV
heads, head_dim 128, page size 16), admits --rows requests with the policies
dealt round robin (budget 256, 64-token prompts held in the token pool;
streaming with `buffer` 1, a decision every step), and
runs the backend's per-step host work for --steps decode steps: the page
manager's bookkeeping, `StepBuilder.build` (groups, padding, page table) and
`RegionGraphs.begin_step` (the static copies a replay reads). Per row count
it writes the median host ms per step and the tensor operations a step
dispatches, by name: on a GPU each is a kernel launch or a host-to-device
copy of a few microseconds, which is where a serving step's 4-7 ms of
metadata went (bench/results/traffic-*-h200-*.json, `meta_ms_mean`).
On CPU the operations are cheap, so the count is the number to compare;
`--device cuda` (a device call, no engine) gives the times that matter.
`--classes 1,3,9` repeats each row count with the rows dealt over the first
1, 3 and 9 policies only (issue #29 asks for host work per step that does
not grow with the number of policy classes; each run records `classes`).
`full` among --policies deals rows that are plain requests (no kv_policy):
as in a served mixed step, the step folds them into its pass as pool-only
rows (StepBuilder.fold_pool_rows; py-spy put `_folded_rows` at a fifth of
the scheduler's samples in the ten-policy batch on an H200, 2026-11-29).
Each run also lists `new_keys`: the steps past the first whose attention
segment or policy group met shapes no earlier step had (a graph capture
each where graphs replay) and what changed, e.g. the `full` rows' prefix
table crossing a bucket as they grow, or a group's input shapes against
the last group of the same policy and action (ThinKV's cut widths halving
were found this way, 2026-12-02).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from graph_buckets import DecodeMode  # noqa: E402
from kvsieve.policies import Need, policy_names  # noqa: E402
from kvsieve.radix_ext.pages import PageManager, RegionConfig  # noqa: E402
from kvsieve.radix_ext import region_graphs  # noqa: E402
from kvsieve.radix_ext.region_graphs import RegionGraphs  # noqa: E402
from kvsieve.radix_ext.runtime import RUNTIME  # noqa: E402
from kvsieve.radix_ext.step_meta import StepBuilder  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 28, 4, 128, 16
PROMPT = 64


class OpCounter(TorchDispatchMode):
    """Counts the tensor operations dispatched inside it, by name, and
    those whose output is on a GPU and is not a view: a kernel launch or a
    host-to-device copy each."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.on_gpu = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[str(func.overloadpacket.__name__)] += 1
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if isinstance(first, torch.Tensor) and first.is_cuda and not func.is_view:
            self.on_gpu += 1
        return out


def decode_batch(rids, rows, seq_lens, device):
    lens = torch.tensor(seq_lens)
    return SimpleNamespace(rids=rids, forward_mode=DecodeMode(), seq_lens_cpu=lens, seq_lens=lens.to(device),
                           req_pool_indices=torch.tensor(rows, device=device), positions=(lens - 1).to(device),
                           out_cache_loc=torch.zeros(len(rids), dtype=torch.int64, device=device))


def setup(rows: int, names: list[str], budget: int, device: str, steps: int):
    """The region, the builder and the graphs' bookkeeping for `rows` requests."""
    RUNTIME.requests.clear()
    pages_per_head = -(-(2 * budget + steps + 64) // PAGE)  # above every policy's ceiling at this budget
    RUNTIME.region = PageManager(RegionConfig(
        num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, num_pages=rows * LAYERS * KV_HEADS * pages_per_head,
        page_size=PAGE, dtype=torch.bfloat16, device=device, max_rows=rows + 1))
    RUNTIME.counters = torch.zeros((rows + 1, 2), dtype=torch.int64, device=device)
    RUNTIME.overflow_flags = torch.zeros(rows + 1, dtype=torch.bool, device=device)
    req_to_token = torch.arange((rows + 1) * 4096, dtype=torch.int32, device=device).view(rows + 1, 4096)
    builder = StepBuilder(RUNTIME.region, req_to_token, device, pad_rows=True)
    # Plain rows (`full`) fold into the pass, as where whole-stack graphs run (memory_plan's default width).
    builder.fold_pool_rows, builder.fold_max_tokens = "full" in names, 4096
    rids = []
    for i in range(rows):
        name = names[i % len(names)]
        rid = f"r{i}"
        if name == "full":  # a plain request: not the runtime's, its KV all in the token pool
            rids.append(rid)
            continue
        kv_policy = {"name": name, "budget": max(budget, 132 if name == "crystalcache" else budget)}
        if name == "streaming":  # rolling every step, as before its cadence: a group each step, the host's worst case
            kv_policy["params"] = {"buffer": 1}
        RUNTIME.admit(rid, {"kv_policy": kv_policy}, prompt_len=PROMPT,
                      sgl_req=SimpleNamespace(req_pool_idx=i, to_finish=None))
        req = RUNTIME.requests[rid]
        RUNTIME.reserve(req, 0, budget + steps + 64)
        req.prefix_len = PROMPT  # the prompt stays in the radix cache
        rids.append(rid)
    return builder, RegionGraphs(), rids


def one_step(builder, graphs, rids, seq_lens, device):
    RUNTIME.after_step()
    step = builder.build(decode_batch(rids, list(range(len(rids))), seq_lens, device))
    graphs.begin_step(step, needs_keys=bool(step.region.needs & Need.KEYS), table=builder.pages.table)
    return step


def step_shape(step) -> dict:
    """What keys a decode step's attention segment, in words (region_graphs.signature)."""
    rows = step.region
    return {"rows": int(rows.pool_rows.shape[0]), "width": int(rows.tables.shape[3]),
            "prefix": int(rows.prefix_slots.shape[1]), "observed_slots": rows.observed_slots,
            "needs": str(rows.needs)}


class NewKeys:
    """The steps past the first whose attention segment or policy group has
    shapes no earlier step had: a graph capture each where graphs replay
    (~15 ms for a whole-stack capture on an H200), and what changed."""

    LIMIT = 20

    def __init__(self):
        self.attention, self.groups, self.seen = set(), set(), []
        self.last = None
        self.last_group: dict = {}  # (policy, action) -> group_shape of its last group

    def see(self, n: int, step) -> None:
        key = region_graphs.signature(step, needs_keys=bool(step.region.needs & Need.KEYS))
        shape = step_shape(step)
        if key not in self.attention:
            self.attention.add(key)
            if n and len(self.seen) < self.LIMIT:
                changed = {k: [self.last[k], v] for k, v in shape.items() if self.last[k] != v}
                self.seen.append({"step": n, "segment": "attention", "changed": changed})
        self.last = shape
        for group in step.region.groups:
            gkey = region_graphs.group_signature(group)
            shape, kind = group_shape(group), (group.policy.name, group.action)
            if gkey is not None and gkey not in self.groups:
                self.groups.add(gkey)
                if n and len(self.seen) < self.LIMIT:
                    before = self.last_group.get(kind)
                    entry = {"step": n, "segment": "group", "policy": group.policy.name,
                             "action": group.action, "rows": len(group.members), "width": group.width}
                    if before is not None:
                        entry["changed"] = {k: [before.get(k), v] for k, v in shape.items() if before.get(k) != v}
                    self.seen.append(entry)
            self.last_group[kind] = shape


def group_shape(group) -> dict:
    """What keys a policy group's segment, by name (region_graphs.group_signature):
    its rows and width, each host maximum, each parameter's and input's shape."""
    out = {"rows": int(group.rows.shape[0]), "width": group.width}
    out.update({f"max {k}": v for k, v in group.maxima.items()})
    out.update({f"param {k}": list(t.shape) for k, t in group.params.items()})
    out.update({f"input {k}": list(t.shape) for k, t in group.inputs.items()})
    return out


def measure(rows: int, names: list[str], budget: int, steps: int, device: str) -> dict:
    builder, graphs, rids = setup(rows, names, budget, device, steps)
    seq_lens = [PROMPT + budget + 1] * rows  # past the budget: every step evicts or decides
    times, counts, on_gpu = [], [], []
    keys = NewKeys()
    for n in range(steps):
        counter = OpCounter() if n >= steps - 8 else None
        sync(device)
        started = time.perf_counter()
        if counter is not None:
            with counter:
                step = one_step(builder, graphs, rids, seq_lens, device)
            counts.append(counter.ops)
            on_gpu.append(counter.on_gpu)
        else:
            step = one_step(builder, graphs, rids, seq_lens, device)
        sync(device)
        if counter is None and n >= steps // 4:  # after warm-up; the counted steps are slower
            times.append(1000 * (time.perf_counter() - started))
        keys.see(n, step)  # after the clock
        seq_lens = [s + 1 for s in seq_lens]
    ops = collections.Counter()
    for c in counts:
        ops.update(c)
    per_step = {k: round(v / len(counts), 1) for k, v in ops.most_common()}
    RUNTIME.requests.clear()
    RUNTIME.region = None
    return {"rows": rows, "groups": len(step.region.groups), "padded_rows": int(step.region.pool_rows.shape[0]),
            "pool_only_rows": step.region.pool_only,
            "host_ms_median": round(statistics.median(times), 3),
            "host_ms_p90": round(sorted(times)[int(0.9 * len(times))], 3),
            "ops_per_step": round(sum(ops.values()) / len(counts), 1),
            "gpu_ops_per_step": round(sum(on_gpu) / len(on_gpu), 1), "ops_by_name": per_step,
            "graph_entries": len(graphs.cache), "group_entries": len(graphs.groups), "new_keys": keys.seen}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,32,64,128")
    ap.add_argument("--policies", default=None, help="comma list (default: every decode-time policy and snapkv)")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--classes", default=None,
                    help="comma list of class counts: each row count with the first k policies only")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    names = args.policies.split(",") if args.policies else [n for n in policy_names() if n != "full"]
    out = {"what": "host ms and tensor ops of one decode step's metadata (step_meta_host.py)",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": (torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or
                       platform.machine()),
           "command": " ".join(sys.argv), "commit": args.commit, "policies": names, "budget": args.budget,
           "runs": []}
    counts = [int(k) for k in args.classes.split(",")] if args.classes else [len(names)]
    if any(not 1 <= k <= len(names) for k in counts):
        ap.error(f"--classes: each count must be 1..{len(names)} (the policies given)")
    for rows, classes in itertools.product([int(r) for r in args.rows.split(",")], counts):
        run = {"classes": classes, **measure(rows, names[:classes], args.budget, args.steps, args.device)}
        out["runs"].append(run)
        print(f"rows {rows:4d} classes {classes:2d}: groups {run['groups']:2d} padded {run['padded_rows']:4d} "
              f"host {run['host_ms_median']:7.3f} ms (p90 {run['host_ms_p90']:.3f}) "
              f"ops {run['ops_per_step']:7.1f} (on the GPU {run['gpu_ops_per_step']:.1f})", flush=True)
        top = list(run["ops_by_name"].items())[:8]
        print("   top ops:", ", ".join(f"{name} {n}" for name, n in top), flush=True)
        for new in run["new_keys"]:
            print("   new shapes:", json.dumps(new), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print("->", args.out)


if __name__ == "__main__":
    main()
