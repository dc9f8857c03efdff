"""Where a kvsieve decode step's time goes, at the headline's shape, in one device call:

    python bench/step_profile.py MODEL_DIR OUT_DIR [--policy streaming] [--budget 1024]
        [--requests 512] [--steps 4]

Starts the kvsieve engine exactly as bench/gpu_headline.py does (dummy
weights, the same KV split), runs --requests requests of 64-token prompts
under the policy, and once every request holds budget + 32 generated tokens
(each step evicts, as in the headline's window) asks SGLang's scheduler for a
torch-profiler trace of --steps steps. The trace is summarized on the spot:
the GPU's busy share of the profiled span (union of kernel intervals), idle
gaps, the kernels by total time, and the host's top-level operations. Writes
OUT_DIR/step-profile.json (the trace itself stays on the device: it is large).
"""

from __future__ import annotations

import asyncio
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
            "requests": int(opts.get("--requests", 512)), "steps": int(opts.get("--steps", 4)),
            "kv_tokens": int(opts.get("--kv-tokens", 786432))}


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
    return {"span_ms": round(span_us / 1000, 3), "steps": steps, "span_per_step_ms": round(span_us / 1000 / steps, 3),
            "gpu_busy_ms": round(busy / 1000, 3), "gpu_busy_share": round(busy / span_us, 3),
            "idle_gaps_over_50us": {"count": len(gaps), "total_ms": round(sum(b - a for a, b in gaps) / 1000, 3)},
            "longest_gaps": in_gaps,
            "kernels": [{"name": n, "total_ms": round(t / 1000, 3), "per_step_ms": round(t / 1000 / steps, 3), "count": c}
                        for n, t, c in kernels[:40]],
            "host_top_level": [{"name": n, "total_ms": round(t / 1000, 3), "count": c} for n, t, c in host_ops[:40]],
            "python_inclusive": [{"name": n, "per_step_ms": round(t / 1000 / steps, 3), "count": c}
                                 for n, t, c in python_functions[:80]]}


async def drive(engine, cfg, trace_dir: str) -> dict:
    from sglang.srt.managers.io_struct import ProfileReq

    budget, n = cfg["budget"], cfg["requests"]
    counts = [0] * n
    policy = {"name": cfg["policy"], "budget": budget}
    sampling = headline.params(budget + 160, policy)

    async def one(i, ids):
        async for chunk in await engine.async_generate(input_ids=ids, sampling_params=sampling, stream=True):
            counts[i] = chunk["meta_info"]["completion_tokens"]

    tasks = [asyncio.ensure_future(one(i, ids)) for i, ids in enumerate(headline.prompts(n, headline.SHORT_PROMPT, 7))]
    while min(counts) < budget + 32:
        await asyncio.sleep(0.05)
    before = (time.perf_counter(), sum(counts))
    await asyncio.sleep(2.0)
    after = (time.perf_counter(), sum(counts))
    unprofiled = (after[1] - before[1]) / (after[0] - before[0])
    await engine.tokenizer_manager.start_profile(ProfileReq(output_dir=trace_dir, num_steps=cfg["steps"],
                                                            activities=["CPU", "GPU"], with_stack=True,
                                                            record_shapes=False, profile_id="kvsieve-step"))
    await asyncio.gather(*tasks)
    return {"tokens_per_s_unprofiled": round(unprofiled, 1), "step_ms_unprofiled": round(1000 * n / unprofiled, 2)}


def main() -> None:
    model, out_dir = sys.argv[1], sys.argv[2]
    cfg = options()
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    headline.VOCAB_IDS = (min(1000, vocab // 4), min(100000, vocab))
    import torch
    import sglang as sgl

    pool_tokens = int(cfg["kv_tokens"] * headline.POOL_SHARE)
    region_tokens = cfg["kv_tokens"] - pool_tokens
    os.environ["KVSIEVE_REGION_PAGES"] = str(region_tokens * headline.LAYERS * headline.KV_HEADS // headline.PAGE)
    engine = sgl.Engine(model_path=model, load_format="dummy", skip_tokenizer_init=True, sampling_backend="pytorch",
                        log_level="warning", mem_fraction_static=0.85, stream_interval=headline.STREAM_INTERVAL,
                        attention_backend="kvsieve", max_total_tokens=pool_tokens, max_running_requests=cfg["requests"],
                        cuda_graph_max_bs_decode=128)
    trace_dir = os.path.join("/tmp", "kvsieve-trace")
    try:
        result = engine.loop.run_until_complete(drive(engine, cfg, trace_dir))
    finally:
        engine.shutdown()
    traces = sorted(glob.glob(os.path.join(trace_dir, "*.trace.json.gz")))
    result.update(device=torch.cuda.get_device_name(0), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  command="python bench/step_profile.py " + " ".join(sys.argv[1:]), config=cfg,
                  traces=[os.path.basename(t) for t in traces])
    if traces:
        result["profile"] = summarize(traces[-1], cfg["steps"])
    with open(os.path.join(out_dir, "step-profile.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "profile"}))
    if "profile" in result:
        prof = result["profile"]
        print(json.dumps({k: prof[k] for k in ("span_per_step_ms", "gpu_busy_share", "idle_gaps_over_50us")}))
        for k in prof["kernels"][:25]:
            print("kernel", k["per_step_ms"], k["count"], k["name"])
        for h in prof["host_top_level"][:20]:
            print("host", h["total_ms"], h["count"], h["name"])
        print("gaps", json.dumps(prof["longest_gaps"]))
        for h in prof["python_inclusive"][:60]:
            print("py", h["per_step_ms"], h["count"], h["name"])


if __name__ == "__main__":
    main()
