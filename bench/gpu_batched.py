"""The compressed path at a small batch on a GPU, in one device call
(../shared/gpu/README.md):

    python bench/gpu_batched.py bench/models/r1-distill-qwen-7b OUT_DIR [--profiles-only]

R1-Distill-Qwen-7B architecture with dummy weights, 128-token prompts, a
batch of 64 requests generating 256 tokens each, budget 64, SGLang's own
CUDA graphs off (the compressed rows' decode runs the Triton kernel and
the region's per-layer graphs, the defaults on CUDA). Measures tokens/s of
vanilla SGLang (triton), kvsieve `full` and streaming, h2o, snapkv and
longflow; counts CUDA kernel launches and host syncs per decode step with
SGLang's torch profiler; checks on the GPU that a budget covering the
generation equals `full` token for token and that a mixed batch equals its
solo runs. Writes OUT_DIR/gpu-batched.json (with --profiles-only: the
profiles and checks only, each engine profiled before it serves anything
else).

Committed result: bench/results/gpu-batched-graphs.json (H100,
2026-11-22), from `python bench/gpu_batched.py bench/models/r1-distill-qwen-7b
OUT_DIR`; bench/policy_cost.py takes its vanilla step time (batch 64) as
the GPU step.
bench/gpu_headline.py is the throughput benchmark at equal KV memory.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import sys
import tempfile
import time

BATCH = 64
PROMPT = 128
GEN = 256
BUDGET = 64
PROFILE_STEPS = 8
REPEATS = 3  # runs of `full` on each engine (medians compared: single runs vary by tens of percent)
POLICIES = ["streaming", "h2o", "snapkv", "longflow"]

LAUNCH_EVENTS = {"cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"}
SYNC_EVENTS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}


def prompts(seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1000, 100000) for _ in range(PROMPT)] for _ in range(BATCH)]


def params(policy, tokens=GEN) -> dict:
    return {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True, "custom_params": {"kv_policy": policy}}


def throughput(engine, policy, seed) -> dict:
    ids = prompts(seed)
    start = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=[params(policy)] * len(ids))
    elapsed = time.perf_counter() - start
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {"policy": policy, "requests": len(ids), "generated_tokens": tokens, "seconds": round(elapsed, 2),
            "tokens_per_s": round(tokens / elapsed, 1)}


def count_profile(trace_dir: str) -> dict:
    """Kernel launches and host syncs in the decode-stage trace(s)."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.json*"), recursive=True))
    decode = [f for f in files if "decode" in os.path.basename(f).lower()] or files
    launches = syncs = 0
    for path in decode:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            events = json.load(f).get("traceEvents", [])
        for e in events:
            name = e.get("name", "")
            if name in LAUNCH_EVENTS:
                launches += 1
            elif name in SYNC_EVENTS:
                syncs += 1
    return {"trace_files": [os.path.basename(f) for f in decode], "kernel_launches": launches,
            "host_syncs": syncs, "steps": PROFILE_STEPS,
            "kernel_launches_per_step": round(launches / PROFILE_STEPS, 1),
            "host_syncs_per_step": round(syncs / PROFILE_STEPS, 1)}


def profiled(engine, policy, seed) -> dict:
    trace_dir = tempfile.mkdtemp(prefix="kvsieve-prof-")
    # CUDA activity only: it records the runtime API calls counted here
    # (launches, synchronizations); recording CPU ops too crashed kineto's
    # trace clean-up in SGLang's scheduler on the H100 host.
    engine.start_profile(output_dir=trace_dir, num_steps=PROFILE_STEPS, activities=["GPU"],
                         profile_by_stage=True)
    ids = prompts(seed)[:16]
    engine.generate(input_ids=ids, sampling_params=[params(policy, tokens=PROFILE_STEPS * 3)] * len(ids))
    time.sleep(2)  # the trace is written after the last profiled step
    result = count_profile(trace_dir)
    result["batch"] = len(ids)
    return result


def summary(runs: list[dict]) -> dict:
    """Median tokens/s per (engine, policy), and each against vanilla."""
    by_key: dict[str, list[float]] = {}
    for run in runs:
        policy = run["policy"] if isinstance(run["policy"], str) else run["policy"]["name"]
        key = "vanilla" if run["engine"].startswith("vanilla") else f"kvsieve/{policy}"
        by_key.setdefault(key, []).append(run["tokens_per_s"])
    medians = {k: sorted(v)[len(v) // 2] for k, v in by_key.items()}
    base = medians.get("vanilla")
    return {k: {"median_tokens_per_s": m, "runs": len(by_key[k]),
                "vs_vanilla": round(m / base, 3) if base else None} for k, m in medians.items()}


def make_engine(model: str, backend: str):
    import sglang as sgl

    return sgl.Engine(model_path=model, load_format="dummy", skip_tokenizer_init=True, attention_backend=backend,
                      sampling_backend="pytorch", disable_cuda_graph=True, mem_fraction_static=0.85,
                      log_level="warning", max_running_requests=BATCH)


def main() -> None:
    model, out_dir = sys.argv[1], sys.argv[2]
    profiles_only = "--profiles-only" in sys.argv[3:]
    import torch

    results = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"),
               "command": "python bench/gpu_batched.py " + " ".join(sys.argv[1:]),
               "setup": {"model": "R1-Distill-Qwen-7B architecture, dummy weights", "batch": BATCH,
                         "prompt_tokens": PROMPT, "generated_tokens": GEN, "budget": BUDGET,
                         "cuda_graphs": False,
                         "attention": "decode: KVSIEVE_DECODE_KERNEL (default triton: kernels/decode_attention.py); "
                                      "extend: PyTorch reference (kernels/attention_ref.py)"},
               "runs": [], "profiles": {}, "checks": {}}

    def save():
        with open(os.path.join(out_dir, "gpu-batched.json"), "w") as f:
            json.dump(results, f, indent=2)

    started = time.perf_counter()
    vanilla = make_engine(model, "triton")
    results["vanilla_start_s"] = round(time.perf_counter() - started, 1)
    try:
        throughput(vanilla, "full", seed=99)  # warm-up
        if not profiles_only:
            for _ in range(REPEATS):
                run = throughput(vanilla, "full", seed=0)
                run["engine"] = "vanilla SGLang (triton)"
                results["runs"].append(run)
        results["profiles"]["vanilla"] = profiled(vanilla, "full", seed=1)
    finally:
        vanilla.shutdown()
    save()
    print(json.dumps(results["runs"], indent=1), flush=True)

    started = time.perf_counter()
    engine = make_engine(model, "kvsieve")
    results["kvsieve_start_s"] = round(time.perf_counter() - started, 1)
    try:
        throughput(engine, "full", seed=99)  # warm-up
        runs = ["full"] * REPEATS + [{"name": p, "budget": BUDGET} for p in POLICIES]
        for policy in [] if profiles_only else runs:
            run = throughput(engine, policy, seed=0)
            run["engine"] = "kvsieve"
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
            save()
        results["profiles"]["kvsieve_full"] = profiled(engine, "full", seed=1)
        save()
        for p in POLICIES:
            results["profiles"][p] = profiled(engine, {"name": p, "budget": BUDGET}, seed=1)
            save()
        # Correctness on the GPU: a budget covering the generation equals
        # `full`; a mixed batch equals the solo runs.
        ids = prompts(7)[:4]
        full = [o["output_ids"] for o in engine.generate(input_ids=ids, sampling_params=[params("full", 32)] * 4)]
        big = {"name": "h2o", "budget": PROMPT + 64, "compress_prompt": True}
        same = [o["output_ids"] for o in engine.generate(input_ids=ids, sampling_params=[params(big, 32)] * 4)]
        results["checks"]["h2o_budget_covering_everything_equals_full"] = same == full
        mixed_policies = ["full", {"name": "h2o", "budget": 16}, {"name": "snapkv", "budget": 16},
                          {"name": "longflow", "budget": 16}]
        solo = [engine.generate(input_ids=i, sampling_params=params(p, 32))["output_ids"]
                for i, p in zip(ids, mixed_policies)]
        mixed = [o["output_ids"] for o in engine.generate(input_ids=ids,
                                                          sampling_params=[params(p, 32) for p in mixed_policies])]
        results["checks"]["mixed_batch_equals_solo_runs"] = mixed == solo
        results["checks"]["mixed_batch_full_row_equals_full"] = mixed[0] == full[0]
    finally:
        engine.shutdown()
    results["summary"] = summary(results["runs"])
    save()
    print(json.dumps({"profiles": results["profiles"], "checks": results["checks"]}, indent=1))


if __name__ == "__main__":
    main()
