"""crystalcache's decisions driven as the engine drives them, host work
included: the prompt's end (the first layer's probe summary, S1-S6, every
layer's select_prefill), then decode steps (the region's store of the new
token in each head's first free slot, step_inputs, deciding_rows,
select_decode or observe_decode in every layer, on_forward_tokens). Rows
start together, so their breath cycles coincide: the worst case for a
cycle step.

Times are the thread's CPU time on the CPU (--threads 1), wall time with a
device sync on CUDA. Reports, per row count: the prompt's end (ms for all rows), the first
decode step (where the trunk tables built at the prompt's end are read
back), later decode steps without a decision and cycle steps (host ms,
per-layer decisions ms), and
the tokens held afterwards (at most the policy's ceiling). With --device
cuda the decisions run under torch.cuda.set_sync_debug_mode("error").

  python bench/crystalcache_decision.py --rows 1 8 32 --steps 200 --out OUT.json            (CPU)
  python bench/crystalcache_decision.py --device cuda --rows 64 640 --budget 1024 --prompt 64 --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from tqdm import tqdm

from kvsieve.policies import Observations, PolicyBatch, SlotView, get_policy
from kvsieve.policies.base import ModelInfo, StepRow
from kvsieve.radix_ext import layer0_probe

SHAPES = {"cpu": dict(model="SmolLM2-135M-Instruct", layers=30, kv_heads=3, q_heads=9, head_dim=64),
          "cuda": dict(model="R1-Distill-Qwen-7B", layers=28, kv_heads=4, q_heads=28, head_dim=128)}
DELIM = 13  # the token id that ends a sentence here


def _sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def _token_ids(rows: int, length: int, gen) -> torch.Tensor:
    """Random ids with a sentence end every ~16 tokens."""
    ids = torch.randint(100, 1100, (rows, length), generator=gen)
    return torch.where(torch.rand(rows, length, generator=gen) < 1 / 16, torch.full_like(ids, DELIM), ids)


def run(rows: int, steps: int, budget: int, prompt: int, shape: dict, dev: str, seed: int = 0) -> dict:
    L, H, HQ, D = shape["layers"], shape["kv_heads"], shape["q_heads"], shape["head_dim"]
    # On the CPU the thread's CPU time (one intra-op thread): wall time on a
    # shared machine mostly measures the other tenants.
    clock = time.thread_time if dev == "cpu" else time.perf_counter
    cls = get_policy("crystalcache")
    policy = cls()
    policy.bind_model(ModelInfo(name=shape["model"], num_layers=L, num_kv_heads=H, num_q_heads=HQ, head_dim=D,
                                delimiter_ids=frozenset({DELIM})))
    params = cls.Params()
    tensors, maxima = cls.batch_params([params] * rows, dev)
    states = [policy.begin_request(params, L, H) for _ in range(rows)]
    gen = torch.Generator().manual_seed(seed)
    ids = _token_ids(rows, prompt + steps, gen)
    S = max(policy.max_private_tokens(params, prompt, steps, budget), prompt) + 1
    # Layer 0's region (every layer applies the same keep table; the others
    # run their decisions on a copy of it).
    valid = torch.zeros(rows, H, S, dtype=torch.bool, device=dev)
    position = torch.full((rows, H, S), -1, dtype=torch.int64, device=dev)
    score = torch.zeros(rows, H, S, device=dev)
    keys = torch.randn(rows, H, S, D, generator=gen).to(dev)
    budget_t = torch.full((rows, H), budget, device=dev)
    pool_rows = torch.arange(rows, device=dev)
    out = {"rows": rows, "steps": steps, "budget": budget, "prompt": prompt, **shape}

    # ----- the prompt's end --------------------------------------------------
    if prompt:
        valid[:, :, :prompt] = True
        position[:, :, :prompt] = torch.arange(prompt, device=dev)
        for r, st in enumerate(states):  # the probe itself runs in the forward, timed elsewhere
            probe = layer0_probe.ProbeState(prompt, dev)
            layer0_probe.observe(probe, torch.randn(prompt, HQ, D, generator=gen).to(dev) * 2,
                                 keys[r, :, :prompt], torch.zeros(0, H, D, device=dev), 1 / math.sqrt(D))
            setattr(st, layer0_probe.ATTRIBUTE, probe)
        _sync(dev)
        t0 = clock()
        policy.step_inputs([StepRow(state=s, step=0, pool_row=r, budget=budget, prefill=True)
                            for r, s in enumerate(states)], dev)
        if dev == "cuda":  # the prompt's end runs inside the forward: no host sync from here
            torch.cuda.set_sync_debug_mode("error")
        summaries = layer0_probe.collect([(s, ids[r, :prompt].tolist(), 0, budget) for r, s in enumerate(states)])
        inputs = policy.prompt_attention_inputs(summaries, dev)
        for layer in range(L):
            view = SlotView(valid=valid.clone(), position=position.clone(), score=score.clone(),
                            last_hit=torch.zeros(rows, H, S, dtype=torch.int32, device=dev), keys=None)
            batch = PolicyBatch(layer=layer, budget=budget_t, step=torch.zeros(rows, dtype=torch.int64, device=dev),
                                params=tensors, maxima=maxima, inputs=inputs, pool_rows=pool_rows, max_rows=rows)
            evict = policy.select_prefill(batch, view, Observations())
            if layer == 0 and evict is not None:
                kept = valid & ~evict
        if dev == "cuda":
            torch.cuda.set_sync_debug_mode(0)
        _sync(dev)
        out["prompt_end_ms"] = 1000 * (clock() - t0)
        if "kept" in locals():
            valid, position = kept, torch.where(kept, position, -1)

    # ----- decode ---------------------------------------------------------------
    plain, cycle = {"host": [], "decide": []}, {"host": [], "decide": []}
    for s in tqdm(range(steps), desc=f"crystalcache {rows} rows", leave=False, mininterval=10):
        pos = prompt + s
        free = (~valid).int().argmax(-1, keepdim=True)
        valid.scatter_(-1, free, True)
        position.scatter_(-1, free, pos)
        score.scatter_(-1, free, 0.0)
        _sync(dev)
        h0 = clock()
        step_rows = [StepRow(state=st, step=s, pool_row=r, budget=budget, prefill=False, private_tokens=pos + 1)
                     for r, st in enumerate(states)]
        inputs = policy.step_inputs(step_rows, dev)
        due = policy.deciding_rows(step_rows)
        host_ms = 1000 * (clock() - h0)
        deciding = [r for r in range(rows) if due is None or due[r]]
        observing = [r for r in range(rows) if due is not None and not due[r]]
        attention = torch.rand(rows, H, S, generator=gen).to(dev) * valid
        decide_ms = 0.0
        for layer in range(L):
            new_valid = valid.clone()
            for members, action in ((deciding, "decide"), (observing, "observe")):
                if not members:
                    continue
                g = torch.tensor(members, device=dev)
                view = SlotView(valid=valid[g], position=position[g], score=score[g] if layer == 0 else None,
                                last_hit=torch.zeros(len(members), H, S, dtype=torch.int32, device=dev),
                                keys=keys[g] if layer == 0 else None)
                batch = PolicyBatch(layer=layer, budget=budget_t[g], step=torch.full((len(members),), s, device=dev),
                                    params={k: v[g] for k, v in tensors.items()}, maxima=maxima,
                                    inputs={k: v[g] for k, v in inputs.items()}, pool_rows=pool_rows[g],
                                    max_rows=rows)
                obs = Observations(attention=attention[g] if layer == 0 else None)
                _sync(dev)
                d0 = clock()
                if dev == "cuda":
                    torch.cuda.set_sync_debug_mode("error")
                if action == "decide":
                    evict = policy.select_decode(batch, view, obs)
                else:
                    evict = policy.observe_decode(batch, view, obs)
                if dev == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
                _sync(dev)
                decide_ms += 1000 * (clock() - d0)
                if layer == 0:
                    score[g] = view.score
                if evict is not None:
                    new_valid[g] &= ~evict
            if layer == 0:
                layer0_valid = new_valid
        valid = layer0_valid
        position = torch.where(valid, position, -1)
        h1 = clock()
        policy.on_forward_tokens([(st, r, 1) for r, st in enumerate(states)], torch.full((rows,), pos, device=dev),
                                 ids[:, pos].to(dev), None)
        host_ms += 1000 * (clock() - h1)
        if s == 0:  # reads back the trunk tables the prompt's end built (the rest of its work)
            out["first_step"] = {"host_ms": host_ms, "decisions_ms": decide_ms}
            continue
        bucket = cycle if inputs else plain  # a snapshot or a keep table this step
        bucket["host"].append(host_ms)
        bucket["decide"].append(decide_ms)
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    for name, bucket in (("plain_step", plain), ("cycle_step", cycle)):
        out[name] = {"n": len(bucket["host"]), "host_ms": mean(bucket["host"]), "decisions_ms": mean(bucket["decide"]),
                     "max_host_ms": max(bucket["host"], default=0.0)}
    total = sum(plain["host"] + plain["decide"] + cycle["host"] + cycle["decide"])
    out["mean_step_ms"] = total / max(steps - 1, 1)  # steps after the first
    held = valid[:, 0].sum(-1)
    out["held_max"] = int(held.max())
    out["ceiling"] = policy.max_private_tokens(params, prompt, steps, budget)
    assert out["held_max"] <= out["ceiling"], out
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--budget", type=int, default=132)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.device]
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "machine": torch.cuda.get_device_name() if args.device == "cuda" else "x86_64, 2 cores (shared)",
               "clock": "wall, device synced" if args.device == "cuda" else "thread CPU time, 1 intra-op thread",
               "command": "python bench/crystalcache_decision.py " + " ".join(
                   f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                   for k, v in vars(args).items() if v is not None and k != "out"),
               "runs": []}
    for rows in args.rows:
        results["runs"].append(run(rows, args.steps, args.budget, args.prompt, shape, args.device))
        print(json.dumps(results["runs"][-1]), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
