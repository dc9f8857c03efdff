"""Where a kvsieve decode step's time goes, at the headline's shape, in one device call:

    python bench/step_profile.py MODEL_DIR OUT_DIR [--policy streaming[,rkv,...]] [--budget 1024]
        [--requests 512] [--steps 16] [--policy-params '{"crystal_kv": {...}}'] [--stack 0|1]
        [--out step-profile.json]

Starts the kvsieve engine exactly as bench/gpu_headline.py does (dummy
weights, the same KV split). For each policy in turn, runs --requests
requests of 64-token prompts under it; once every request holds budget + 32
generated tokens (each step evicts or decides, as in the headline's window)
it measures the unprofiled throughput over 64 steps, then asks SGLang's
scheduler for a torch-profiler trace of --steps steps (16 covers one
decision of the policies that decide every 16 steps). The trace is
summarized on the spot: the GPU's busy share of the profiled span (union of
kernel intervals), idle gaps, the kernels by total time, and the host's
top-level operations (Python stacks with --stack 1: they slow the host
several times over, so the host share is then overstated). Writes
OUT_DIR/step-profile.json after every policy, under `runs` (the traces stay
on the device: they are large).

The engine runs with KVSIEVE_PROFILE_RANGES=1 (radix_ext/
profiling.py), so the summary splits the step by what the GPU ran inside each
named range: `split_per_step_ms` gives the attention kernel
(kvsieve.attend), the region writes (kvsieve.store + kvsieve.evict), the
slot gathers a decision reads (kvsieve.view), each policy's decision
(kvsieve.decide.<policy>), the model's own layers (every other kernel) and
the host's share (the step's span minus the GPU's busy time), with the host
ranges (step metadata, each policy's step_inputs) beside it. Ranges are not
recorded inside a CUDA-graph replay, so while the profiler records, the
region's pass runs eagerly (radix_ext/profiling.recording): the profiled
steps are slower than the unprofiled ones, whose throughput (region graphs
on, as served) is reported beside them.
"""

from __future__ import annotations

import asyncio
import bisect
import glob
import gzip
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_headline as headline  # noqa: E402  (same engine setup and prompts)


def options() -> dict:
    opts = dict(zip(sys.argv[3::2], sys.argv[4::2]))
    return {"policy": opts.get("--policy", "streaming"), "budget": int(opts.get("--budget", 1024)),
            "requests": int(opts.get("--requests", 512)), "steps": int(opts.get("--steps", 16)),
            "kv_tokens": int(opts.get("--kv-tokens", 786432)), "out": opts.get("--out", "step-profile.json"),
            "policy_params": json.loads(opts.get("--policy-params", "{}")), "stack": opts.get("--stack", "0") == "1"}


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def idle_gaps(intervals: list[tuple[float, float]], least_us: float) -> list[tuple[float, float]]:
    gaps, end = [], None
    for start, stop in sorted(intervals):
        if end is not None and start - end >= least_us:
            gaps.append((end, start))
        end = stop if end is None else max(end, stop)
    return gaps


def range_split(events: list, gpu: list, span_us: float, busy_us: float, steps: int) -> dict:
    """GPU kernel time inside each kvsieve.* range (gpu_user_annotation
    events mark where the kernels a range launched ran), host time of each
    kvsieve.* range, and the step split into the parts named in the
    docstring, all per step in ms."""
    ranges = [e for e in events if e.get("ph") == "X" and e.get("cat") == "gpu_user_annotation"
              and e.get("name", "").startswith("kvsieve.")]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu)
    starts = [k[0] for k in kernels]
    gpu_ms: dict[str, float] = {}
    for r in ranges:
        lo, hi = r["ts"], r["ts"] + r["dur"]
        i = bisect.bisect_left(starts, lo)
        inside = 0.0
        while i < len(kernels) and kernels[i][0] < hi:
            inside += min(kernels[i][1], hi) - kernels[i][0]
            i += 1
        gpu_ms[r["name"]] = gpu_ms.get(r["name"], 0.0) + inside / 1000
    host_ms: dict[str, float] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name", "").startswith("kvsieve."):
            host_ms[e["name"]] = host_ms.get(e["name"], 0.0) + e["dur"] / 1000
    per = lambda v: round(v / steps, 3)  # noqa: E731
    named = sum(gpu_ms.values())
    split = {"attention_kernel": per(gpu_ms.get("kvsieve.attend", 0.0)),
             "region_writes": per(gpu_ms.get("kvsieve.store", 0.0) + gpu_ms.get("kvsieve.evict", 0.0)),
             "decision_inputs_view": per(gpu_ms.get("kvsieve.view", 0.0)),
             "model_layers_and_rest": per(busy_us / 1000 - named),
             "host_gpu_idle": per((span_us - busy_us) / 1000)}
    for name, ms in gpu_ms.items():
        if name.startswith(("kvsieve.decide.", "kvsieve.observe.")):
            _, kind, policy = name.split(".", 2)
            split[("decision." if kind == "decide" else "observation.") + policy] = per(ms)
    return {"split_per_step_ms": split,
            "gpu_ms_per_step_by_range": {k: per(v) for k, v in sorted(gpu_ms.items())},
            "host_ms_per_step_by_range": {k: per(v) for k, v in sorted(host_ms.items())}}


def summarize(trace_path: str, steps: int) -> dict:
    events = json.load(gzip.open(trace_path))["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host = [e for e in spans if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in gpu]
    first, last = min(s for s, _ in intervals), max(e for _, e in intervals)
    busy = union_length(intervals)
    gaps = idle_gaps(intervals, 50.0)
    by_kernel: dict[str, list[float]] = {}
    for e in gpu:
        by_kernel.setdefault(e["name"][:120], []).append(e["dur"])
    kernels = sorted(((name, sum(d), len(d)) for name, d in by_kernel.items()), key=lambda k: -k[1])
    # Host: an operation's own top level (not nested in another host op of the same thread).
    by_thread: dict = {}
    for e in host:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    top_level: dict[str, list[float]] = {}
    for items in by_thread.values():
        items.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_until = float("-inf")
        for e in items:
            if e["ts"] >= open_until:
                top_level.setdefault(e["name"][:120], []).append(e["dur"])
                open_until = e["ts"] + e["dur"]
    host_ops = sorted(((name, sum(d), len(d)) for name, d in top_level.items()), key=lambda k: -k[1])
    # Python functions, inclusive time (nested calls count in each caller): where the host's step goes.
    inclusive: dict[str, list[float]] = {}
    for e in host:
        if e.get("cat") == "python_function":
            inclusive.setdefault(e["name"][:120], []).append(e["dur"])
    python_functions = sorted(((name, sum(d), len(d)) for name, d in inclusive.items()), key=lambda k: -k[1])
    span_us = last - first
    # What the host was doing in the GPU's longest idle gaps.
    longest = sorted(gaps, key=lambda g: g[0] - g[1])[:8]
    in_gaps = []
    for start, stop in longest:
        inside = [e for e in host if e["ts"] < stop and e["ts"] + e["dur"] > start and e["dur"] > 0.3 * (stop - start)]
        inside.sort(key=lambda e: e["dur"])
        in_gaps.append({"gap_us": round(stop - start, 1), "host_ops_covering": [e["name"][:80] for e in inside[:6]]})
    return {**range_split(events, gpu, span_us, busy, steps),
            "span_ms": round(span_us / 1000, 3), "steps": steps, "span_per_step_ms": round(span_us / 1000 / steps, 3),
            "gpu_busy_ms": round(busy / 1000, 3), "gpu_busy_share": round(busy / span_us, 3),
            "idle_gaps_over_50us": {"count": len(gaps), "total_ms": round(sum(b - a for a, b in gaps) / 1000, 3)},
            "longest_gaps": in_gaps,
            "kernels": [{"name": n, "total_ms": round(t / 1000, 3), "per_step_ms": round(t / 1000 / steps, 3), "count": c}
                        for n, t, c in kernels[:40]],
            "host_top_level": [{"name": n, "total_ms": round(t / 1000, 3), "count": c} for n, t, c in host_ops[:40]],
            "python_inclusive": [{"name": n, "per_step_ms": round(t / 1000 / steps, 3), "count": c}
                                 for n, t, c in python_functions[:80]]}


async def profile_one(engine, cfg, name: str, seed: int, trace_dir: str) -> dict:
    """One policy's batch: --requests requests ramp to budget + 32 tokens,
    the unprofiled throughput over the next 64 steps, then --steps profiled
    steps; the batch then runs to its end before the next policy starts."""
    from sglang.srt.managers.io_struct import ProfileReq

    budget, n = cfg["budget"], cfg["requests"]
    counts = [0] * n
    policy = {"name": name, "budget": budget}
    if cfg["policy_params"].get(name):
        policy["params"] = cfg["policy_params"][name]
    sampling = headline.params(budget + 192, policy)
    started = time.perf_counter()

    async def one(i, ids):
        async for chunk in await engine.async_generate(input_ids=ids, sampling_params=sampling, stream=True):
            counts[i] = chunk["meta_info"]["completion_tokens"]

    tasks = [asyncio.ensure_future(one(i, ids)) for i, ids in enumerate(headline.prompts(n, headline.SHORT_PROMPT, seed))]
    while min(counts) < budget + 32:
        await asyncio.sleep(0.05)
    ramp_s = time.perf_counter() - started
    # Chunks arrive every STREAM_INTERVAL tokens per request: a window of
    # 64 steps holds 8 of them, so the count moves smoothly through it.
    before = (time.perf_counter(), sum(counts))
    while sum(counts) < before[1] + 64 * n:
        await asyncio.sleep(0.02)
    after = (time.perf_counter(), sum(counts))
    unprofiled = (after[1] - before[1]) / (after[0] - before[0])
    profile_id = f"kvsieve-step-{name}"
    await engine.tokenizer_manager.start_profile(ProfileReq(output_dir=trace_dir, num_steps=cfg["steps"],
                                                            activities=["CPU", "GPU"], with_stack=cfg["stack"],
                                                            record_shapes=False, profile_id=profile_id))
    await asyncio.gather(*tasks)
    result = {"policy": policy, "ramp_s": round(ramp_s, 1), "tokens_per_s_unprofiled": round(unprofiled, 1),
              "step_ms_unprofiled": round(1000 * n / unprofiled, 2)}
    traces = sorted(glob.glob(os.path.join(trace_dir, f"{profile_id}*.trace.json.gz")))
    if traces:
        result["profile"] = summarize(traces[-1], cfg["steps"])
    return result


def report(name: str, result: dict) -> None:
    print(name, json.dumps({k: v for k, v in result.items() if k != "profile"}))
    if "profile" not in result:
        return
    prof = result["profile"]
    print(json.dumps({k: prof[k] for k in ("span_per_step_ms", "gpu_busy_share", "idle_gaps_over_50us")}))
    print("split", json.dumps(prof["split_per_step_ms"]))
    print("host ranges", json.dumps(prof["host_ms_per_step_by_range"]))
    for k in prof["kernels"][:12]:
        print("kernel", k["per_step_ms"], k["count"], k["name"])
    for h in prof["python_inclusive"][:30]:
        print("py", h["per_step_ms"], h["count"], h["name"])


def main() -> None:
    model, out_dir = sys.argv[1], sys.argv[2]
    cfg = options()
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    headline.VOCAB_IDS = (min(1000, vocab // 4), min(100000, vocab))
    import torch
    import sglang as sgl

    os.environ["KVSIEVE_PROFILE_RANGES"] = "1"  # the named ranges of radix_ext/profiling.py
    pool_tokens = int(cfg["kv_tokens"] * headline.POOL_SHARE)
    region_tokens = cfg["kv_tokens"] - pool_tokens
    os.environ["KVSIEVE_REGION_PAGES"] = str(region_tokens * headline.LAYERS * headline.KV_HEADS // headline.PAGE)
    engine = sgl.Engine(model_path=model, load_format="dummy", skip_tokenizer_init=True, sampling_backend="pytorch",
                        log_level="warning", mem_fraction_static=0.85, stream_interval=headline.STREAM_INTERVAL,
                        attention_backend="kvsieve", max_total_tokens=pool_tokens, max_running_requests=cfg["requests"],
                        cuda_graph_max_bs_decode=128)
    trace_dir = os.path.join("/tmp", "kvsieve-trace")
    out_path = os.path.join(out_dir, cfg["out"])
    result = {"device": torch.cuda.get_device_name(0), "command": "python bench/step_profile.py " + " ".join(sys.argv[1:]),
              "config": cfg, "runs": {}}
    try:
        for seed, name in enumerate(cfg["policy"].split(",")):
            run = engine.loop.run_until_complete(profile_one(engine, cfg, name, seed + 7, trace_dir))
            result["runs"][name] = run
            result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            with open(out_path, "w") as f:  # after every policy: a call cut short keeps what ran
                json.dump(result, f, indent=1)
            report(name, run)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
