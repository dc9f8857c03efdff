"""Decision cost per policy per decode step:

    python bench/policy_cost.py OUT.json [--device cpu|cuda] [--batches 1,8,32 | --batch 256] [--budget 32]
                                         [--step-ms 256=MS,...] [--threads N] [--policies a,b] [--prompt 512] [--clock wall|cpu]

Every registered compressing policy's `select_decode` on random slots and
observations, for every layer of a step (medians of timed steps), as a
share of a decode step of the same batch. Shapes: on CPU the embedded model
(SmolLM2-135M: 30 layers, 3 kv heads, 9 query heads, head_dim 64; step
times from bench/results/cpu-batched.json, `full` TPOT); on CUDA
R1-Distill-Qwen-7B (28 layers, 4 kv heads, 28 query heads, head_dim 128;
step time from bench/results/gpu-batched-graphs.json vanilla at batch 64,
a lower bound for larger batches, unless --step-ms gives one). Policies
whose decision needs per-step inputs get them from their own step_inputs
on fresh request states, anything else from a FIXTURES hook; one that
cannot run this way is listed with why. A policy with an observe_decode
also gets the cost of that (the step of a row whose decision is not due),
and one that reads the first layer's prompt probe (Need.LAYER0_ATTENTION)
the cost of its prompt's end for the batch (`--prompt` tokens each).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from kvsieve.policies import Need, Observations, PolicyBatch, SlotView, get_policy, policy_names
from kvsieve.policies.base import ModelInfo, Policy, StepRow

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"cpu": dict(model="SmolLM2-135M-Instruct", layers=30, kv_heads=3, q_heads=9, head_dim=64),
          "cuda": dict(model="R1-Distill-Qwen-7B", layers=28, kv_heads=4, q_heads=28, head_dim=128)}


#: Per-policy fixture hooks: name -> fn(policy, batch, view, obs, shape) that
#: fills in whatever else a policy's decision reads (beyond its own
#: step_inputs, random observations and keys for Need.KEYS). A policy
#: registered later adds its entry here if the defaults do not fit it.
FIXTURES: dict = {}

#: What times a step: wall time (default) or, with --clock cpu on the CPU,
#: the thread's CPU time (one intra-op thread), which a shared machine's
#: other tenants do not inflate.
CLOCK = [time.perf_counter]


def fixture(name: str):
    def add(fn):
        FIXTURES[name] = fn
        return fn
    return add


@fixture("crystalcache")
def _crystalcache_breath_step(policy, batch, view, obs, shape):
    """A breath-cycle step, its costliest: every layer evicts by the host's
    keep table (half of the positions kept) and the first layer also
    snapshots its slots for the next cycle (step_inputs ships neither on a
    fresh request)."""
    R, _, S = view.valid.shape
    g = torch.Generator(device=view.valid.device).manual_seed(1)
    batch.inputs["keep"] = torch.rand(R, S, generator=g, device=view.valid.device) < 0.5
    batch.inputs["snap"] = torch.ones(R, dtype=torch.bool, device=view.valid.device)
    # What step_inputs records for a snapshot step: each row's state, due a
    # snapshot (select_decode queues its copy on the state).
    states = [policy.begin_request(policy.Params(), shape["layers"], view.valid.shape[1]) for _ in range(R)]
    policy._snap_states = {R: [(state, True) for state in states]}
    if view.keys is None:  # Need.LAYER0_KEYS: the first layer's keys
        view.keys = torch.randn(R, view.valid.shape[1], S, shape["head_dim"], generator=g, device=view.valid.device)


def time_observe(name: str, rows: int, shape: dict, budget: int, device: str, steps: int) -> float | None:
    """observe_decode over every layer (the step of a row whose decision is
    not due), or None for a policy that observes nothing between decisions."""
    cls = get_policy(name)
    if cls.observe_decode is Policy.observe_decode:
        return None
    policy = cls()
    policy.bind_model(ModelInfo(name=shape["model"], num_layers=shape["layers"], num_kv_heads=shape["kv_heads"],
                                num_q_heads=shape["q_heads"], head_dim=shape["head_dim"]))
    batch, view, obs = inputs(cls, policy, rows, shape, budget, device)
    batch.inputs = {}
    times = []
    for _ in range(steps):
        _sync(device)
        start = CLOCK[0]()
        for layer in range(shape["layers"]):
            batch.layer = layer
            if layer and cls.observes_first_layer_only:
                continue  # the engine skips it past the first layer
            policy.observe_decode(batch, view, obs)
        _sync(device)
        times.append(CLOCK[0]() - start)
    times.sort()
    return 1000 * times[len(times) // 2]


def time_prompt_end(name: str, rows: int, shape: dict, prompt: int, device: str, steps: int) -> float | None:
    """Need.LAYER0_ATTENTION: the prompt's end of `rows` requests of
    `prompt` private tokens (the probe's read-back and the policy's
    prompt_attention_inputs; the probe itself is attention work), or None."""
    cls = get_policy(name)
    if not cls.needs & Need.LAYER0_ATTENTION:
        return None
    from kvsieve.radix_ext import layer0_probe
    H, HQ, D = shape["kv_heads"], shape["q_heads"], shape["head_dim"]
    policy = cls()
    policy.bind_model(ModelInfo(name=shape["model"], num_layers=shape["layers"], num_kv_heads=H, num_q_heads=HQ,
                                head_dim=D, delimiter_ids=frozenset({13})))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 1100, (rows, prompt), generator=g)
    ids = torch.where(torch.rand(rows, prompt, generator=g) < 1 / 16, torch.full_like(ids, 13), ids).tolist()
    times = []
    for _ in range(steps):
        states = [policy.begin_request(cls.Params(), shape["layers"], H) for _ in range(rows)]
        for st in states:
            probe = layer0_probe.ProbeState(prompt, device)
            layer0_probe.observe(probe, (torch.randn(prompt, HQ, D, generator=g) * 2).to(device),
                                 torch.randn(H, prompt, D, generator=g).to(device), torch.zeros(0, H, D, device=device),
                                 D ** -0.5)
            setattr(st, layer0_probe.ATTRIBUTE, probe)
        _sync(device)
        start = CLOCK[0]()
        summaries = layer0_probe.collect([(st, ids[r], 0, 1024) for r, st in enumerate(states)])
        policy.prompt_attention_inputs(summaries, device)
        _sync(device)
        times.append(CLOCK[0]() - start)
    times.sort()
    return 1000 * times[len(times) // 2]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_ms(device: str, batch: int, given: dict[int, float]) -> tuple[float | None, str]:
    """A decode step of the same batch and where its time came from (see module doc)."""
    if batch in given:
        return given[batch], "--step-ms"
    if device == "cpu":
        tpot = json.loads((ROOT / "bench/results/cpu-batched.json").read_text())["tpot_ms"]
        return tpot.get(f"full/batch{batch}"), "cpu-batched.json full TPOT"
    summary = json.loads((ROOT / "bench/results/gpu-batched-graphs.json").read_text())["summary"]
    ms = 1000 * 64 / summary["vanilla"]["median_tokens_per_s"]
    # Only batch 64 was measured; a larger batch's step is no shorter (the
    # weights are read once per step either way), so its share is an upper bound.
    return ms, "gpu-batched-graphs.json vanilla batch 64" + ("" if batch == 64 else " (lower bound: share is an upper bound)")


def inputs(cls, policy, rows: int, shape: dict, budget: int, device: str) -> tuple[PolicyBatch, SlotView, Observations]:
    R, H, L, S = rows, shape["kv_heads"], shape["layers"], budget + 8
    g = torch.Generator(device=device).manual_seed(0)
    params = [cls.Params() for _ in range(R)]
    tensors, maxima = cls.batch_params(params, device)
    states = [policy.begin_request(p, L, H) for p in params]
    step_rows = [StepRow(state=s, step=budget + 8, pool_row=i, budget=budget, prefill=False, private_tokens=S)
                 for i, s in enumerate(states)]
    batch = PolicyBatch(layer=0, budget=torch.full((R, H), budget, device=device),
                        step=torch.full((R,), budget + 8, device=device), params=tensors, maxima=maxima,
                        inputs=policy.step_inputs(step_rows, device), pool_rows=torch.arange(R, device=device),
                        max_rows=R)
    valid = torch.ones(R, H, S, dtype=torch.bool, device=device)
    position = torch.arange(S, device=device).expand(R, H, S).contiguous()
    view = SlotView(valid=valid, position=position, score=torch.rand(R, H, S, generator=g, device=device),
                    last_hit=torch.zeros(R, H, S, dtype=torch.int32, device=device),
                    keys=torch.randn(R, H, S, shape["head_dim"], generator=g, device=device)
                    if cls.needs & Need.KEYS else None)
    attention = torch.rand(R, H, S, generator=g, device=device)
    obs = Observations(attention=attention / attention.sum(-1, keepdim=True), pv_norm=torch.rand(R, H, S, generator=g,
                                                                                                 device=device),
                       sparsity=torch.rand(R, shape["q_heads"], generator=g, device=device))
    if cls.name in FIXTURES:
        FIXTURES[cls.name](policy, batch, view, obs, shape)
    return batch, view, obs


def time_policy(name: str, rows: int, shape: dict, budget: int, device: str, steps: int) -> float:
    cls = get_policy(name)
    policy = cls()
    policy.bind_model(ModelInfo(name=shape["model"], num_layers=shape["layers"], num_kv_heads=shape["kv_heads"],
                                num_q_heads=shape["q_heads"], head_dim=shape["head_dim"]))
    batch, view, obs = inputs(cls, policy, rows, shape, budget, device)
    times = []
    for _ in range(steps):
        fresh = SlotView(valid=view.valid.clone(), position=view.position, score=view.score.clone(),
                         last_hit=view.last_hit.clone(), keys=view.keys)
        if device == "cuda":
            torch.cuda.synchronize()
        start = CLOCK[0]()
        for layer in range(shape["layers"]):
            batch.layer = layer
            policy.select_decode(batch, fresh, obs)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(CLOCK[0]() - start)
    times.sort()
    return 1000 * times[len(times) // 2]


def main() -> None:
    out = sys.argv[1]
    args = dict(zip(sys.argv[2::2], sys.argv[3::2]))
    device = args.get("--device", "cpu")
    batches = [int(b) for b in args.get("--batches", args.get("--batch", "1,8,32" if device == "cpu" else "64,256"))
               .split(",")]
    budget = int(args.get("--budget", 32 if device == "cpu" else 1024))
    # --step-ms 256=41.5,64=16.2: decode step times measured elsewhere (ms).
    given = {int(b): float(ms) for b, ms in (kv.split("=") for kv in args["--step-ms"].split(","))} \
        if "--step-ms" in args else {}
    shape = SHAPES[device]
    if args.get("--clock", "wall") == "cpu":
        CLOCK[0] = time.thread_time
    # One intra-op thread by default on CPU: on 2 shared cores, two threads
    # spin-waiting on each other made R-KV's tiny products 20x slower.
    threads = int(args.get("--threads", 1 if device == "cpu" else torch.get_num_threads()))
    torch.set_num_threads(threads)
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "machine": torch.cuda.get_device_name(0) if device == "cuda" else "x86_64, 2 cores (shared)",
               "command": "python bench/policy_cost.py " + " ".join(sys.argv[1:]), "shape": shape, "budget": budget,
               "torch_threads": threads, "clock": args.get("--clock", "wall"),
               "step_time_source": __doc__.split("Shapes: ")[1].split(". Policies")[0], "policies": {}}
    # --policies a,b: only these; --prompt N: private prompt length of the prompt-end measure.
    chosen = args["--policies"].split(",") if "--policies" in args else policy_names()
    prompt = int(args.get("--prompt", 512))
    results["prompt_end_tokens"] = prompt
    for name in chosen:
        cls = get_policy(name)
        if not cls.compresses:
            continue
        entry = results["policies"][name] = {}
        for rows in batches:
            try:
                ms = time_policy(name, rows, shape, budget, device, steps=5 if device == "cpu" else 20)
            except Exception as err:  # recorded: the policy needs what this bench cannot give it
                entry[f"batch{rows}"] = {"error": f"{type(err).__name__}: {err}"[:200]}
                continue
            base, source = step_ms(device, rows, given)
            entry[f"batch{rows}"] = {"decision_ms_per_step": round(ms, 3),
                                     "step_ms": round(base, 1) if base else None, "step_ms_from": source,
                                     "share_of_step": round(ms / base, 4) if base else None}
            steps = 5 if device == "cpu" else 20
            observe = time_observe(name, rows, shape, budget, device, steps)
            if observe is not None:
                entry[f"batch{rows}"]["observe_ms_per_step"] = round(observe, 3)
            prompt_end = time_prompt_end(name, rows, shape, prompt, device, 3)
            if prompt_end is not None:
                entry[f"batch{rows}"]["prompt_end_ms"] = round(prompt_end, 3)
        print(name, json.dumps(entry), flush=True)
        Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
