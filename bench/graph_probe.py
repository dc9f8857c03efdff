"""CUDA graphs of the compressed decode pass (radix_ext/region_graphs.py)
against the eager pass, outside SGLang, on a GPU (device tool):

    python bench/graph_probe.py OUT.json [--rows 64] [--prompt 128] [--steps 48]

For each graph-safe policy, the same decode steps (same q/k/v, seeded) run
twice from a fresh region: eagerly, then through the graphs (first step of
the shapes eager and captured, the rest replayed). Every step's attention
output of every layer and the region's final state (valid bits, positions,
scores) must be equal; times per step (28 layers) are medians.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from kvsieve.policies import get_policy, policy_names
from kvsieve.radix_ext.region_graphs import RegionGraphs
from kvsieve.radix_ext.runtime import RUNTIME

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from sync_probe import HQ, LAYERS, H, D, make_backend  # noqa: E402

BUDGET = 16  # below the steps: every policy evicts during the probe


def run(policy: str, rows: int, prompt: int, steps: int, graphs: bool) -> dict:
    torch.manual_seed(0)  # the token pool's random prefix K/V: the same in both runs
    backend, layer, rids, batch = make_backend(policy, rows, prompt, steps, "cuda",
                                               graphs=RegionGraphs() if graphs else None, budget=BUDGET)
    gen = torch.Generator(device="cuda").manual_seed(0)
    outputs, times = [], []
    for s in range(steps):
        q3 = torch.randn(rows, HQ, D, dtype=torch.bfloat16, device="cuda", generator=gen)
        k3 = torch.randn(rows, H, D, dtype=torch.bfloat16, device="cuda", generator=gen)
        v3 = torch.randn(rows, H, D, dtype=torch.bfloat16, device="cuda", generator=gen)
        torch.cuda.synchronize()
        start = time.perf_counter()
        step = backend.steps.build(batch(s))
        if backend.graphs is not None:
            backend.graphs.begin_step(step, needs_keys=False)
        o_step = []
        for layer_id in range(LAYERS):
            layer.layer_id = layer_id
            o3 = torch.empty_like(q3)
            if backend.graphs is None or not backend.graphs.run(backend._decode_region, layer, q3, k3, v3, o3):
                backend._decode_region(q3, k3, v3, o3, layer, step)
            o_step.append(o3)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        outputs.append(torch.stack(o_step))
    p = RUNTIME.region
    state = (p.valid.clone(), p.position.clone(), p.score.clone(), RUNTIME.counters.clone())
    stats = {"captures": backend.graphs.captures, "replays": backend.graphs.replays} if graphs else {}
    RUNTIME.requests.clear()
    RUNTIME.region = None
    steady = sorted(times[2:])
    return {"outputs": torch.stack(outputs), "state": state, "median_step_ms": 1000 * steady[len(steady) // 2],
            **stats}


def main() -> None:
    out = sys.argv[1]
    args = dict(zip(sys.argv[2::2], sys.argv[3::2]))
    rows, prompt, steps = int(args.get("--rows", 64)), int(args.get("--prompt", 128)), int(args.get("--steps", 48))
    results = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": "python bench/graph_probe.py " + " ".join(sys.argv[1:]),
               "shapes": {"layers": LAYERS, "q_heads": HQ, "kv_heads": H, "head_dim": D, "rows": rows,
                          "prompt_in_pool": prompt, "budget": BUDGET, "steps": steps}, "policies": []}
    for name in policy_names():
        cls = get_policy(name)
        if not cls.compresses or not cls.graph_safe:
            continue
        eager = run(name, rows, prompt, steps, graphs=False)
        graphed = run(name, rows, prompt, steps, graphs=True)
        same_out = bool(torch.equal(eager["outputs"], graphed["outputs"]))
        same_state = all(torch.equal(a, b) for a, b in zip(eager["state"], graphed["state"]))
        entry = {"policy": name, "outputs_equal": same_out, "region_state_equal": same_state,
                 "max_output_diff": (eager["outputs"].float() - graphed["outputs"].float()).abs().max().item(),
                 "eager_step_ms": round(eager["median_step_ms"], 2),
                 "graph_step_ms": round(graphed["median_step_ms"], 2),
                 "speedup": round(eager["median_step_ms"] / graphed["median_step_ms"], 2),
                 "captures": graphed["captures"], "replays": graphed["replays"]}
        results["policies"].append(entry)
        print(json.dumps(entry), flush=True)
        with open(out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
