"""What one prefill (extend) of a compressed request costs, per policy, against `full`:

    python bench/extend_profile.py MODEL_DIR OUT_DIR [--policies full,streaming,rkv,...] [--budget 256]
        [--prefix 512] [--private 16,512] [--repeats 5] [--profile 3] [--stack 1]
        [--kv-tokens 196608] [--device cuda|cpu] [--out extend-profile.json]

Why: under traffic (bench/traffic.py, H200, 2026-11-28) a one-row extend of a
compressed request took 100-200 ms whatever its length (16 tokens: 134 ms),
against 20-45 ms for a pool-only one of up to 2K tokens, and every decode
row waits for it. This measures that cost alone, one request at a time:

For each policy: one request puts the shared prefix (--prefix tokens) in the
radix cache; then, for each private length of --private, --repeats requests
of prefix + that many fresh tokens, max_new_tokens 1 (the prefill is the
whole request), each timed end to end (the median is reported). With
--profile N (GPU only), N more requests of the last length run under
SGLang's torch profiler (CPU and GPU, Python stacks with --stack 1), and the
trace is summarized as bench/step_profile.py does: GPU busy share, idle
gaps, kernels, the host's top-level ops and Python functions by inclusive
time. A profiled step's host time is overstated by the profiler (several
times with stacks); the unprofiled medians are the figures to quote.

Engine set-up as bench/step_profile.py (dummy weights, kvsieve backend, the
region / pool split of --kv-tokens as bench/traffic.py's --pool-share 0.6).
On CPU (`--device cpu`, MODEL_DIR `tiny`) the same requests without a
profile: a logic check.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_headline as headline  # noqa: E402  (request parameters)
import gpu_smoke as smoke  # noqa: E402  (policy_specs, model_dir, model_shape)
import step_profile  # noqa: E402  (the trace summary)

POOL_SHARE = 0.6  # bench/traffic.py's split in the run that showed the cost


def options(argv: list[str]) -> dict:
    opts = dict(zip(argv[3::2], argv[4::2]))
    device = opts.get("--device", "cuda")
    cuda = device == "cuda"
    return {"policies": opts.get("--policies", "full,streaming,h2o,snapkv,rkv,skipkv,thinkv,crystal_kv,longflow,"
                                                "crystalcache").split(","),
            "budget": int(opts.get("--budget", 256 if cuda else 12)),
            "prefix": int(opts.get("--prefix", 512 if cuda else 32)),
            "private": [int(x) for x in opts.get("--private", "16,512" if cuda else "4,24").split(",")],
            "repeats": int(opts.get("--repeats", 5 if cuda else 2)),
            "profile": int(opts.get("--profile", 3)) if cuda else 0,
            "stack": opts.get("--stack", "1") == "1",
            "kv_tokens": int(opts.get("--kv-tokens", 196608 if cuda else 8192)),
            "device": device, "out": opts.get("--out", "extend-profile.json")}


async def one_request(engine, ids: list[int], policy: dict | None) -> float:
    """Milliseconds from send to the request's end (one generated token)."""
    started = time.perf_counter()
    out = await engine.async_generate(input_ids=ids, sampling_params=headline.params(1, policy))
    if out["meta_info"]["finish_reason"]["type"] == "abort":
        raise RuntimeError(f"request aborted: {out['meta_info']['finish_reason']}")
    return (time.perf_counter() - started) * 1000


async def measure_policy(engine, cfg: dict, name: str, policy: dict | None, rng: random.Random,
                         trace_dir: str) -> dict:
    from sglang.srt.managers.io_struct import ProfileReq

    def fresh(n: int) -> list[int]:
        return [rng.randrange(*headline.VOCAB_IDS) for _ in range(n)]

    prefix = fresh(cfg["prefix"])
    await one_request(engine, prefix + fresh(8), policy)  # the prefix goes into the radix cache
    result = {"kv_policy": policy, "private": {}}
    for length in cfg["private"]:
        times = [await one_request(engine, prefix + fresh(length), policy) for _ in range(cfg["repeats"])]
        result["private"][str(length)] = {"median_ms": round(statistics.median(times), 2),
                                          "all_ms": [round(t, 2) for t in times]}
    if cfg["profile"]:
        profile_id = f"kvsieve-extend-{name}"
        await engine.tokenizer_manager.start_profile(ProfileReq(
            output_dir=trace_dir, num_steps=cfg["profile"], activities=["CPU", "GPU"], with_stack=cfg["stack"],
            record_shapes=False, profile_id=profile_id))
        for _ in range(cfg["profile"]):
            await one_request(engine, prefix + fresh(cfg["private"][-1]), policy)
        await asyncio.sleep(2.0)  # the trace is written after the last profiled step
        traces = sorted(glob.glob(os.path.join(trace_dir, f"{profile_id}*.trace.json.gz")))
        if traces:
            summary = step_profile.summarize(traces[-1], cfg["profile"])
            summary["python_inclusive"] = summary["python_inclusive"][:40]
            result["profile"] = summary
        else:
            result["profile_missing"] = f"no trace under {trace_dir}"
    return result


def main() -> None:
    model, out_dir = sys.argv[1], sys.argv[2]
    cfg = options(sys.argv)
    from kvsieve.service.engine import prepare_process_environment

    prepare_process_environment(cfg["device"])
    model = str(smoke.model_dir(model))
    shape = smoke.model_shape(Path(model))
    headline.VOCAB_IDS = (min(1000, shape["vocab"] // 4), min(100000, shape["vocab"]))
    specs = smoke.policy_specs(cfg["policies"], cfg["budget"])
    invalid = {n: s["invalid"] for n, s in specs.items() if "invalid" in s}
    if invalid:
        raise SystemExit(f"no budget accepted: {invalid}")
    import torch
    import sglang as sgl

    if cfg["profile"]:
        os.environ["KVSIEVE_PROFILE_RANGES"] = "1"
    pool_tokens = int(cfg["kv_tokens"] * POOL_SHARE)
    region_tokens = cfg["kv_tokens"] - pool_tokens
    os.environ["KVSIEVE_REGION_PAGES"] = str(region_tokens * shape["layers"] * shape["kv_heads"] // headline.PAGE)
    device_kwargs = dict(cuda_graph_max_bs_decode=64) if cfg["device"] == "cuda" else \
        dict(device="cpu", disable_cuda_graph=True)
    engine = sgl.Engine(model_path=model, load_format="dummy", skip_tokenizer_init=True, sampling_backend="pytorch",
                        log_level="warning", mem_fraction_static=0.85, attention_backend="kvsieve",
                        max_total_tokens=pool_tokens, max_running_requests=64, **device_kwargs)
    os.makedirs(out_dir, exist_ok=True)
    out_path = os.path.join(out_dir, cfg["out"])
    result = {"device": torch.cuda.get_device_name(0) if cfg["device"] == "cuda" else "cpu",
              "command": "python bench/extend_profile.py " + " ".join(sys.argv[1:]), "config": cfg,
              "policies": specs, "runs": {}}
    rng = random.Random(11)
    try:
        # First use compiles kernels: one unmeasured pass over every policy.
        warm = {**cfg, "private": cfg["private"][:1], "repeats": 1, "profile": 0}
        for name in cfg["policies"]:
            engine.loop.run_until_complete(measure_policy(engine, warm, name, specs[name]["kv_policy"], rng, ""))
        for name in cfg["policies"]:
            run = engine.loop.run_until_complete(
                measure_policy(engine, cfg, name, specs[name]["kv_policy"], rng, "/tmp/kvsieve-trace"))
            result["runs"][name] = run
            result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            with open(out_path, "w") as f:  # after every policy: a call cut short keeps what ran
                json.dump(result, f, indent=1)
            medians = {k: v["median_ms"] for k, v in run["private"].items()}
            prof = run.get("profile", {})
            print(f"{name:14s} extend ms by private length {medians}"
                  + (f"; profiled span/step {prof.get('span_per_step_ms')} ms, GPU busy {prof.get('gpu_busy_share')}"
                     if prof else ""), flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
