"""Whole-forward CUDA graphs (radix_ext/forward_graphs.py) on a GPU, in one device call:

    python bench/forward_graphs_check.py OUT_DIR [--rows 64] [--tokens 192] [--budget 32] [--device cpu]

(`--device cpu`: the same logic on CPU, with KVSIEVE_REGION_GRAPHS=rerun,
whose "graphs" rerun the recorded function: a check of this script.)

The same greedy batch twice, each on a fresh kvsieve engine: with
KVSIEVE_FORWARD_GRAPHS=0 (region graphs only: the model's layers eager)
and =1 (all-compressed decode steps replay the whole decoder stack). The
batch: --rows requests spread over every graph-safe decode-time policy (the
registry's list), distinct 24-token prompts, budget --budget, --tokens
generated each, all sent at once. Model: bench/tp_gpu_check.py's `small`
Llama (random fp32 weights, served in bf16; 8 query / 4 kv heads of 128,
4 layers). Checks every row's tokens are equal between the two engines
(the graph replays the same kernels on the same data) and that the second
engine replayed whole steps (kvsieve_decode_graph_* counters, read from
the scheduler's Prometheus multiprocess files). Reports tokens/s of both
(wall clock of the batch; a small model, so this is the host's share, not
the headline). Writes OUT_DIR/forward-graphs-check.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))


def graph_counters(directory: str) -> dict:
    from prometheus_client import CollectorRegistry, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)
    out = {}
    for family in registry.collect():
        if family.name.startswith("kvsieve_decode_graph"):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[f"{sample.name}{{graph={sample.labels.get('graph')}}}"] = sample.value
    return out


def run_engine(model: Path, forward_graphs: str, prompts: list, policies: list, tokens: int, budget: int,
               device: str) -> dict:
    import sglang as sgl

    metrics_dir = tempfile.mkdtemp(prefix="kvsieve-prom-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    os.environ["KVSIEVE_FORWARD_GRAPHS"] = forward_graphs
    started = time.perf_counter()
    where = dict(cuda_graph_max_bs_decode=16, mem_fraction_static=0.5)
    if device == "cpu":
        from kvsieve.service.engine import prepare_process_environment

        prepare_process_environment("cpu")  # SGLang's CPU engine, as `kvsieve serve` starts it
        os.environ["KVSIEVE_REGION_GRAPHS"] = "rerun"
        where = dict(device="cpu", disable_cuda_graph=True, max_total_tokens=16384)
    engine = sgl.Engine(model_path=str(model), attention_backend="kvsieve", skip_tokenizer_init=True,
                        log_level="warning", max_running_requests=len(prompts), **where)
    start_s = time.perf_counter() - started
    try:
        params = [{"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
                   "custom_params": {"kv_policy": {"name": p, "budget": budget}}} for p in policies]
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - t0
    finally:
        engine.shutdown()
    return {"forward_graphs": forward_graphs, "engine_start_s": round(start_s, 1), "seconds": round(seconds, 2),
            "tokens_per_s": round(len(prompts) * tokens / seconds, 1), "counters": graph_counters(metrics_dir),
            "tokens": [o["output_ids"] for o in outs],
            "evicted": [usage_of(o).get("evicted_tokens") for o in outs]}


def usage_of(out: dict) -> dict:
    usage = out["meta_info"].get("kvsieve_kv_usage") or {}
    return usage[-1] if isinstance(usage, list) else usage  # a list under tensor parallelism


def main(argv: list[str]) -> int:
    import random

    import torch

    from kvsieve.policies import get_policy, policy_names
    from tp_gpu_check import MODEL_ROOT, build_small_llama

    out_dir = Path(argv[0])
    opts = dict(zip(argv[1::2], argv[2::2]))
    rows, tokens, budget = int(opts.get("--rows", 64)), int(opts.get("--tokens", 192)), int(opts.get("--budget", 32))
    device = opts.get("--device", "cuda")
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_small_llama(MODEL_ROOT / "small-llama")
    safe = [n for n in policy_names() if get_policy(n).compresses and get_policy(n).graph_safe
            and n not in ("snapkv",)]  # snapkv never evicts while decoding
    policies = [safe[i % len(safe)] for i in range(rows)]
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 400) for _ in range(24)] for _ in range(rows)]
    result = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": "python bench/forward_graphs_check.py " + " ".join(argv), "model": "small-llama",
              "rows": rows, "tokens": tokens, "budget": budget, "policies": sorted(set(policies)), "runs": []}
    for mode in ("0", "1"):
        run = run_engine(model, mode, prompts, policies, tokens, budget, device)
        print(f"forward_graphs={mode}: {run['tokens_per_s']} tok/s, counters {run['counters']}", flush=True)
        result["runs"].append(run)
    eager, graphed = result["runs"]
    differing = [i for i in range(rows) if eager["tokens"][i] != graphed["tokens"][i]]
    replays = sum(v for k, v in graphed["counters"].items() if "replays" in k and "forward" in k)
    result["rows_equal"] = rows - len(differing)
    result["differing_rows"] = [{"row": i, "policy": policies[i], "first_difference": next((
        j for j, (a, b) in enumerate(zip(eager["tokens"][i], graphed["tokens"][i])) if a != b), None)} for i in differing]
    result["forward_replays"] = replays
    result["speedup"] = round(graphed["tokens_per_s"] / eager["tokens_per_s"], 3)
    result["ok"] = not differing and replays > 0 and any(e for e in graphed["evicted"] if e)
    for run in result["runs"]:
        run["tokens"] = None  # compared above; not kept in the JSON
    (out_dir / "forward-graphs-check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
