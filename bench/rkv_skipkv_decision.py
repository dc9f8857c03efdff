"""rkv's and skipkv's per-layer decisions on a GPU, driven as the engine drives
them: (skipkv) host step_inputs, the store of the new token in each head's
first free slot, select_decode, then (skipkv) on_tokens with the step's
token and a last-layer hidden state. Heads start full (budget tokens) and
the policies decide every step (`--buffer 1`, the default here; served
requests default to 16), so every measured step evicts: the worst case.

skipkv's hidden states come from a few base directions plus noise, so later
sentences repeat earlier ones (cosine > tau); delimiters come 1 token in 12.

Reports the decision time per layer (CUDA events), on_tokens host time per
step (all rows), the sentence book's fold (flush) and the rest of
step_inputs (with the read-backs every `refresh` steps), peak memory; the
decisions, on_tokens and the fold run under
torch.cuda.set_sync_debug_mode("error"), so a host sync inside them raises;
every 16 steps it checks that no head is over budget. Also: how far the
16-bit key products of the redundancy are from float32.

  python bench/rkv_skipkv_decision.py --rows 64 256 --steps 200 --out bench/results/rkv-skipkv-decision.json

Committed result: bench/results/rkv-skipkv-decision.json (H100, 2026-11-22), from this command.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvsieve.policies import Observations, PolicyBatch, SlotView, get_policy
from kvsieve.policies.base import ModelInfo, StepRow

DELIMITER = 0


def run(name: str, rows: int, steps: int, budget: int, heads: int, dim: int, hidden: int, seed: int = 0,
        profile: bool = False, buffer: int = 1) -> dict:
    dev = "cuda"
    cls = get_policy(name)
    policy = cls()
    policy.bind_model(ModelInfo(name="bench", num_layers=1, num_kv_heads=heads, num_q_heads=4 * heads,
                                head_dim=dim, delimiter_ids=frozenset({DELIMITER})))
    params = cls.Params(refresh=16, buffer=buffer) if name == "skipkv" else cls.Params(buffer=buffer)
    tensors, maxima = cls.batch_params([params] * rows, dev)
    if name == "skipkv":
        policy._delimiter_table(dev)  # once per process: its copy to the GPU syncs
    states = [policy.begin_request(params, 1, heads) for _ in range(rows)]
    S = -(-(budget + 1) // 16) * 16
    gen = torch.Generator(device=dev).manual_seed(seed)
    valid = torch.zeros(rows, heads, S, dtype=torch.bool, device=dev)
    valid[..., :budget] = True
    position = torch.where(valid, torch.arange(S, device=dev).expand(rows, heads, S), -1)
    view = SlotView(valid=valid, position=position, score=torch.rand(rows, heads, S, device=dev, generator=gen),
                    last_hit=torch.full((rows, heads, S), 8, dtype=torch.int32, device=dev),
                    keys=torch.randn(rows, heads, S, dim, device=dev, generator=gen).to(torch.bfloat16))
    budget_t = torch.full((rows, heads), budget, device=dev)
    bases = torch.randn(6, hidden, device=dev, generator=gen)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    decide, host_inputs, host_tokens, host_flush, spans, totals = [], [], [], [], [], {}
    torch.cuda.reset_peak_memory_stats()
    for t in range(steps):
        pos = budget + t
        h0 = time.perf_counter()
        if name == "skipkv" and policy.book is not None:  # step_inputs' fold, alone: it must not sync either
            torch.cuda.set_sync_debug_mode("error")
            policy.book.flush()
            torch.cuda.set_sync_debug_mode(0)
        host_flush.append(time.perf_counter() - h0)
        h0 = time.perf_counter()
        rows_in = [StepRow(state=s, step=t, pool_row=r, budget=budget, prefill=False, private_tokens=pos + 1)
                   for r, s in enumerate(states)]
        inputs = policy.step_inputs(rows_in, dev)
        host_inputs.append(time.perf_counter() - h0)
        if inputs:
            spans.append(inputs["span_starts"].shape[1])
        free = (~view.valid).int().argmax(-1, keepdim=True)
        view.valid.scatter_(-1, free, True)
        view.position.scatter_(-1, free, pos)
        view.score.scatter_(-1, free, 0.0)
        view.last_hit.scatter_(-1, free, 0)
        view.keys.scatter_(2, free.unsqueeze(-1).expand(rows, heads, 1, dim),
                           torch.randn(rows, heads, 1, dim, device=dev, generator=gen).to(view.keys.dtype))
        attention = torch.rand(rows, heads, S, device=dev, generator=gen) * view.valid
        attention = attention / attention.sum(-1, keepdim=True) * 4  # summed over a group of 4 query heads
        batch = PolicyBatch(layer=0, budget=budget_t, step=torch.full((rows,), t, device=dev), params=tensors,
                            maxima=maxima, inputs=inputs, pool_rows=torch.arange(rows, device=dev), max_rows=rows)
        # This step's token per row: a delimiter every 12 tokens; its hidden
        # state near the base direction of its sentence (rows offset).
        base = ((t // 12 + torch.arange(rows)) % 6).to(dev)
        hidden_states = (bases[base] + 0.2 * torch.randn(rows, hidden, device=dev, generator=gen)).to(torch.bfloat16)
        positions = torch.full((rows,), pos, device=dev)
        tokens = torch.full((rows,), DELIMITER if t % 12 == 11 else 7, device=dev)
        prof = None
        if profile and t >= steps - 10:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        torch.cuda.set_sync_debug_mode("error")
        start.record()
        evict = policy.select_decode(batch, view, Observations(attention=attention))
        view.valid &= ~evict
        view.position.masked_fill_(~view.valid, -1)
        end.record()
        h1 = time.perf_counter()
        if name == "skipkv":
            for r, s in enumerate(states):
                policy.on_tokens(s, positions[r:r + 1], tokens[r:r + 1], hidden_states[r:r + 1])
        host_tokens.append(time.perf_counter() - h1)
        torch.cuda.set_sync_debug_mode(0)
        end.synchronize()
        if prof is not None:
            prof.__exit__(None, None, None)
            for e in prof.key_averages():
                totals[e.key] = totals.get(e.key, 0.0) + e.device_time_total / 1000
        decide.append(start.elapsed_time(end))
        if t % 16 == 0:
            assert int(view.valid.sum(-1).max()) <= budget, f"over budget at step {t}"
    for key, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:12]:  # CUDA time of the last 10 steps
        print(f"{ms:9.2f} ms  {key[:100]}")
    stats = lambda xs: {"mean_ms": sum(xs) / len(xs), "max_ms": max(xs)}  # noqa: E731
    warm = decide[5:]
    return {"policy": name, "rows": rows, "steps": steps, "budget": budget, "buffer": buffer, "kv_heads": heads,
            "head_dim": dim,
            "decision_per_layer": stats(warm),
            "host_step_inputs": stats([1000 * x for x in host_inputs[5:]]),
            "host_on_tokens_all_rows": stats([1000 * x for x in host_tokens[5:]]),
            "host_flush_all_rows": stats([1000 * x for x in host_flush[5:]]),
            "max_redundant_spans": max(spans, default=0),
            "peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20}


def redundancy_error(rows: int = 16, heads: int = 8, slots: int = 1040, dim: int = 128) -> dict:
    """key_redundancy on bf16 keys (the GPU's 16-bit products) against the
    same keys in float32, and how often the two disagree on a head's
    least redundant half."""
    from kvsieve.policies.skipkv.rkv_scores import key_redundancy

    gen = torch.Generator(device="cuda").manual_seed(1)
    keys = (torch.randn(rows, heads, slots, dim, device="cuda", generator=gen)
            + torch.randn(rows, heads, 1, dim, device="cuda", generator=gen)).to(torch.bfloat16)
    valid = torch.rand(rows, heads, slots, device="cuda", generator=gen) < 0.95
    low = key_redundancy(keys, valid)
    ref = key_redundancy(keys.float(), valid)
    rel = ((low - ref).abs() / ref.clamp(min=1e-12))[valid]
    half = slots // 2
    pick = lambda r: r.masked_fill(~valid, 2.0).argsort(-1)[..., :half]  # noqa: E731
    a = torch.zeros_like(valid).scatter_(-1, pick(low), True)
    b = torch.zeros_like(valid).scatter_(-1, pick(ref), True)
    return {"max_rel_error": float(rel.max()), "mean_rel_error": float(rel.mean()),
            "half_disagreement": float((a ^ b).sum() / (2 * a.sum()))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--policies", nargs="+", default=["rkv", "skipkv"])
    p.add_argument("--rows", type=int, nargs="+", default=[64])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--buffer", type=int, default=1,
                   help="the policies' `buffer` (decide every N steps); 1, every step, is the worst case")
    p.add_argument("--out")
    p.add_argument("--profile", action="store_true", help="print the kernels of the last 10 steps by CUDA time")
    args = p.parse_args()
    results = {"device": torch.cuda.get_device_name(), "runs": [], "redundancy_16bit_vs_fp32": redundancy_error()}
    print(json.dumps(results["redundancy_16bit_vs_fp32"]), flush=True)
    for name in args.policies:
        for rows in args.rows:
            results["runs"].append(run(name, rows, args.steps, args.budget, args.heads, args.dim, args.hidden,
                                       profile=args.profile, buffer=args.buffer))
            print(json.dumps(results["runs"][-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
