"""The policy groups' pass after the decoder stack, one layer a call against
blocks of layers stacked into one call (radix_ext/layer_blocks.py):

    python bench/group_layer_blocks.py [--rows 16,64] [--blocks 1,28] [--steps 24] [--out FILE]

No model and no SGLang scheduler: the real page manager, step builder and
backend pass (tests/helpers/region_pass.py) at the 7B shape (28 layers, 4
kv heads, head_dim 128, bf16), a mixed batch of the eight decode-time
graph-safe policies dealt in turn, random q/k/v, real CUDA graphs
(RegionGraphs with the groups deferred, as under the whole-stack graphs).
Each (rows, block) runs warm-up steps until every row holds more than its
budget (each step then decides or evicts), then times --steps steps with
CUDA events: the whole step and the groups' part (after_stack), and counts
the policy calls per step. Writes the JSON after every configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from helpers.region_pass import QWEN_7B, random_qkv, region_pass  # noqa: E402

from kvsieve.policies import get_policy, policy_names  # noqa: E402
from kvsieve.radix_ext import layer_blocks  # noqa: E402
from kvsieve.radix_ext.region_graphs import RegionGraphs  # noqa: E402

DECODE_POLICIES = [n for n in policy_names() if get_policy(n).compresses and get_policy(n).graph_safe]


class Timer:
    """CUDA events on a GPU (the GPU's time), the host's clock on CPU (a smoke run)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def begin(self) -> None:
        self.start.record() if self.cuda else setattr(self, "t0", time.perf_counter())

    def stop(self) -> None:
        self.end.record() if self.cuda else setattr(self, "t1", time.perf_counter())

    def ms(self) -> float:
        return self.start.elapsed_time(self.end) if self.cuda else (self.t1 - self.t0) * 1000


def run(rows: int, block: int, budget: int, steps: int, device: str, policies: list) -> dict:
    os.environ[layer_blocks.BLOCK_ENV] = str(block)
    graphs = RegionGraphs(rerun=device != "cuda")
    graphs.defer_groups = True
    warm = budget + 24
    torch.manual_seed(0)
    run_ = region_pass("+".join(policies), rows, 8, warm + steps + 1, shapes=QWEN_7B, budget=budget,
                       device=device, dtype=torch.bfloat16, graphs=graphs)
    backend = run_.backend
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        started = time.perf_counter()
        for s in range(warm):
            run_.step(s, *random_qkv(rows, QWEN_7B, gen, device, torch.bfloat16))
        warm_s = time.perf_counter() - started
        step_ms, group_ms, calls = [], [], []
        original = backend.after_stack

        def timed_after_stack(*args, **kwargs):
            timer = Timer(device)
            timer.begin()
            out = original(*args, **kwargs)
            timer.stop()
            timed.append(timer)
            return out

        backend.after_stack = timed_after_stack
        for s in range(warm, warm + steps):
            timed: list = []
            qkv = random_qkv(rows, QWEN_7B, gen, device, torch.bfloat16)
            before_calls = backend.policy_calls
            whole = Timer(device)
            whole.begin()
            run_.step(s, *qkv)
            whole.stop()
            if device == "cuda":
                torch.cuda.synchronize()
            step_ms.append(whole.ms())
            group_ms.append(sum(t.ms() for t in timed))
            calls.append(backend.policy_calls - before_calls)
        return {"rows": rows, "block": block, "budget": budget, "steps": steps, "warm_s": round(warm_s, 1),
                "step_ms_median": round(statistics.median(step_ms), 3),
                "groups_ms_median": round(statistics.median(group_ms), 3),
                "groups_ms_mean": round(statistics.mean(group_ms), 3),
                "policy_calls_per_step_median": statistics.median(calls),
                "group_captures": graphs.group_captures, "group_replays": graphs.group_replays}
    finally:
        run_.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,64")
    ap.add_argument("--blocks", default="1,28", help="layers per stacked call (1: one layer a call, as before)")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--policies", default=",".join(DECODE_POLICIES), help="dealt to the rows in turn")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--deadline", type=float, default=None, help="seconds: start no configuration past it")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run (host clock, "
                                                                              "graphs that rerun)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    record = {"kind": "group_layer_blocks", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "policies": args.policies.split(","),
              "command": "python bench/group_layer_blocks.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "runs": []}
    for rows in [int(x) for x in args.rows.split(",")]:
        for block in [int(x) for x in args.blocks.split(",")]:
            if args.deadline is not None and time.monotonic() - t0 > args.deadline:
                record["runs"].append({"rows": rows, "block": block, "skipped": "deadline"})
                continue
            result = run(rows, block, args.budget, args.steps, args.device, args.policies.split(","))
            record["runs"].append(result)
            print(f"rows {rows:4d} block {block:2d}: step {result['step_ms_median']} ms, groups "
                  f"{result['groups_ms_median']} ms, policy calls {result['policy_calls_per_step_median']} "
                  f"(warm-up {result['warm_s']} s)", flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
