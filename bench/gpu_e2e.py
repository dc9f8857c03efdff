"""End-to-end throughput at equal KV memory, one command on a GPU host
(device tool; ../shared/gpu/README.md):

    python bench/gpu_e2e.py MODEL_DIR OUT_DIR [--context 2048] [--generate 256] [--requests 256]
        [--kv-tokens 147456] [--budgets 128,256] [--policies streaming,h2o,snapkv,longflow]

R1-Distill-Qwen-7B architecture with dummy weights. Each engine gets the
same KV memory: vanilla SGLang a token pool of --kv-tokens tokens (CUDA
graphs on); kvsieve a pool of 15% of that (prompt chunks pass through it)
and a compressed region of the other 85% (KVSIEVE_REGION_PAGES), its
compressed decode steps through its per-layer CUDA graphs. Every run is the
same workload: --requests prompts of --context random tokens, --generate
tokens each (ignore_eos), as many running at once as the engine's KV memory
admits. Reports tokens/s, per-request latency p50/p99, how many requests
fit at once (from the memory, by construction) and the ratio to vanilla.
Writes OUT_DIR/gpu-e2e.json.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 28, 4, 128, 16
BYTES_PER_TOKEN = LAYERS * KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16
POOL_SHARE = 0.15


def args() -> dict:
    opts = dict(zip(sys.argv[3::2], sys.argv[4::2]))
    return {"context": int(opts.get("--context", 2048)), "generate": int(opts.get("--generate", 256)),
            "requests": int(opts.get("--requests", 256)), "kv_tokens": int(opts.get("--kv-tokens", 147456)),
            "budgets": [int(b) for b in opts.get("--budgets", "128,256").split(",")],
            "policies": opts.get("--policies", "streaming,h2o,snapkv,longflow").split(",")}


def prompts(n: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1000, 100000) for _ in range(length)] for _ in range(n)]


def run(engine, policy, cfg) -> dict:
    ids = prompts(cfg["requests"], cfg["context"])
    params = {"max_new_tokens": cfg["generate"], "temperature": 0, "ignore_eos": True}
    if policy is not None:
        params["custom_params"] = {"kv_policy": policy}
    start = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=[params] * len(ids))
    elapsed = time.perf_counter() - start
    tokens = sum(len(o["output_ids"]) for o in outs)
    latency = sorted(o["meta_info"].get("e2e_latency", float("nan")) for o in outs)
    pick = lambda q: round(latency[min(len(latency) - 1, int(q * len(latency)))], 2)  # noqa: E731
    return {"policy": policy or "vanilla", "requests": len(ids), "generated_tokens": tokens,
            "seconds": round(elapsed, 2), "tokens_per_s": round(tokens / elapsed, 1),
            "latency_p50_s": pick(0.5), "latency_p99_s": pick(0.99)}


def main() -> None:
    model, out_dir = sys.argv[1], sys.argv[2]
    cfg = args()
    import sglang as sgl
    import torch

    results = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": "python bench/gpu_e2e.py " + " ".join(sys.argv[1:]), "config": cfg,
               "kv_bytes": cfg["kv_tokens"] * BYTES_PER_TOKEN, "runs": []}
    per_request = cfg["context"] + cfg["generate"]
    results["vanilla_fit"] = cfg["kv_tokens"] // per_request

    def save():
        with open(os.path.join(out_dir, "gpu-e2e.json"), "w") as f:
            json.dump(results, f, indent=1)

    common = dict(model_path=model, load_format="dummy", skip_tokenizer_init=True, sampling_backend="pytorch",
                  log_level="warning", max_running_requests=min(cfg["requests"], 512), mem_fraction_static=0.85)
    started = time.perf_counter()
    vanilla = sgl.Engine(attention_backend="triton", max_total_tokens=cfg["kv_tokens"],
                         cuda_graph_max_bs_decode=max(8, min(256, results["vanilla_fit"])), **common)
    results["vanilla_start_s"] = round(time.perf_counter() - started, 1)
    try:
        results["runs"].append(run(vanilla, None, cfg))
    finally:
        vanilla.shutdown()
    print(json.dumps(results["runs"][-1]), flush=True)
    save()

    pool_tokens = int(cfg["kv_tokens"] * POOL_SHARE)
    region_pages = int(cfg["kv_tokens"] * (1 - POOL_SHARE)) * LAYERS * KV_HEADS // PAGE
    os.environ["KVSIEVE_REGION_PAGES"] = str(region_pages)
    results["kvsieve_memory"] = {"pool_tokens": pool_tokens, "region_pages": region_pages, "page_size": PAGE}
    started = time.perf_counter()
    engine = sgl.Engine(attention_backend="kvsieve", max_total_tokens=pool_tokens, disable_cuda_graph=True,
                        chunked_prefill_size=max(cfg["context"], 2048), **common)
    results["kvsieve_start_s"] = round(time.perf_counter() - started, 1)
    try:
        for budget in cfg["budgets"]:
            for name in cfg["policies"]:
                policy = {"name": name, "budget": budget, "compress_prompt": True}
                entry = run(engine, policy, cfg)
                # Requests the region holds at once at a decode-phase ceiling of budget + generate
                # (whole pages per (layer, head)): an estimate; evicting policies hold less.
                entry["fit_estimate"] = region_pages // (LAYERS * KV_HEADS * -(-(budget + cfg["generate"] + 1)
                                                                                      // PAGE))
                entry["vs_vanilla"] = round(entry["tokens_per_s"] / results["runs"][0]["tokens_per_s"], 3)
                results["runs"].append(entry)
                print(json.dumps(entry), flush=True)
                save()
    finally:
        engine.shutdown()
    save()


if __name__ == "__main__":
    main()
