"""thinkv's per-layer decision on a GPU, driven as the engine drives it: the
host step_inputs, then select_decode on a simulated region (the region's
store: each head's first free slot). Rows start together, so their refresh
boundaries (and transition anneals) coincide: the worst case for a cut step.

Reports per-layer decision time (CUDA events) for steps without a cut and
steps with one, the host step_inputs time, peak memory, and checks along the
way that no head ever holds more than the budget. The decisions run under
torch.cuda.set_sync_debug_mode("error"): a host sync inside them raises.

  python bench/thinkv_decision.py --rows 64 256 --steps 1500 --out bench/results/thinkv-decision.json

Committed result: bench/results/thinkv-decision.json (H100, 2026-11-22), from this command.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvsieve.policies import Observations, PolicyBatch, SlotView, get_policy
from kvsieve.policies.base import StepRow
from kvsieve.policies.thinkv.calibration import Calibration


def run(rows: int, steps: int, budget: int, heads: int, dim: int, seed: int = 0, profile: bool = False) -> dict:
    dev = "cuda"
    cls = get_policy("thinkv")
    policy = cls()
    policy.use_calibration(Calibration(model="bench", layers=(0,), thresholds=(0.45, 0.75)))
    params = cls.Params()
    tensors, maxima = cls.batch_params([params] * rows, dev)
    states = [policy.begin_request(params, 1, heads) for _ in range(rows)]
    S = budget + 16
    gen = torch.Generator(device=dev).manual_seed(seed)
    view = SlotView(valid=torch.zeros(rows, heads, S, dtype=torch.bool, device=dev),
                    position=torch.full((rows, heads, S), -1, device=dev),
                    score=torch.zeros(rows, heads, S, device=dev),
                    last_hit=torch.zeros(rows, heads, S, dtype=torch.int32, device=dev),
                    keys=torch.zeros(rows, heads, S, dim, device=dev, dtype=torch.bfloat16))
    # Thought types per (row, segment): seeded, a transition every few segments.
    types_gen = torch.Generator().manual_seed(seed)
    sparsity_of = torch.tensor([0.2, 0.6, 0.9])[torch.randint(0, 3, (rows, steps // 128 + 2), generator=types_gen)]
    budget_t = torch.full((rows, heads), budget, device=dev)
    pool_rows = torch.arange(rows, device=dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    plain, cut, host, profiled = [], [], [], []
    torch.cuda.reset_peak_memory_stats()
    for t in range(steps):
        h0 = time.perf_counter()
        inputs = policy.step_inputs([StepRow(state=s, step=t, pool_row=r, budget=budget, prefill=False,
                                             private_tokens=t + 1) for r, s in enumerate(states)], dev)
        host.append(time.perf_counter() - h0)
        free = (~view.valid).int().argmax(-1, keepdim=True)
        view.valid.scatter_(-1, free, True)
        view.position.scatter_(-1, free, 1000 + t)
        view.keys.scatter_(2, free.unsqueeze(-1).expand(rows, heads, 1, dim),
                           torch.randn(rows, heads, 1, dim, device=dev, generator=gen).to(view.keys.dtype))
        batch = PolicyBatch(layer=0, budget=budget_t, step=torch.full((rows,), t, device=dev), params=tensors,
                            maxima=maxima, inputs=inputs, pool_rows=pool_rows, max_rows=rows)
        sparsity = sparsity_of[:, t // 128].view(rows, 1).expand(rows, 4 * heads).to(dev)
        torch.cuda.set_sync_debug_mode("error")
        prof = None
        if profile and inputs["targets"].shape[1]:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        start.record()
        evict = policy.select_decode(batch, view, Observations(sparsity=sparsity))
        if evict is not None:
            view.valid &= ~evict
            view.position.masked_fill_(~view.valid, -1)
        end.record()
        torch.cuda.set_sync_debug_mode(0)
        end.synchronize()
        if prof is not None:
            prof.__exit__(None, None, None)
            profiled.append(prof.key_averages())
        ms = start.elapsed_time(end)
        (cut if inputs["targets"].shape[1] else plain).append(ms)
        if t % 64 == 0 or inputs["targets"].shape[1]:
            assert int(view.valid.sum(-1).max()) <= budget, f"over budget at step {t}"
    if profiled:  # CUDA time per kernel over every cut step
        totals: dict = {}
        for averages in profiled:
            for e in averages:
                totals[e.key] = totals.get(e.key, 0.0) + e.device_time_total / 1000
        for key, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:15]:
            print(f"{ms:9.2f} ms  {key[:100]}")
    stats = lambda xs: {"n": len(xs), "mean_ms": sum(xs) / max(len(xs), 1), "max_ms": max(xs, default=0.0)}  # noqa: E731
    return {"rows": rows, "steps": steps, "budget": budget, "kv_heads": heads, "head_dim": dim,
            "no_cut_step": stats(plain), "cut_step": stats(cut[1:] or cut),
            "host_step_inputs": {"mean_ms": 1000 * sum(host) / len(host), "max_ms": 1000 * max(host)},
            "peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20,
            "anneal_events": sum(s.book.anneal_events for s in states),
            "budget_events": sum(s.book.budget_events for s in states)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[64])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--out")
    p.add_argument("--profile", action="store_true", help="print the kernels of the cut steps by CUDA time")
    args = p.parse_args()
    results = {"device": torch.cuda.get_device_name(), "runs": []}
    for rows in args.rows:
        results["runs"].append(run(rows, args.steps, args.budget, args.heads, args.dim, profile=args.profile))
        print(json.dumps(results["runs"][-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
