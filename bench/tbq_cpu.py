"""Bytes per retained token and average bits per K/V element of thinkv with
TBQ (R4E4T2, the default) and without (`tbq: false`), through `kvsieve
serve` on CPU (the embedded SmolLM2-135M-Instruct, or --model), greedy.
Each prompt runs under both settings on one server; kv_usage gives the
retained bytes (codes and scales, exact) and tokens of each request.

    .venv/bin/python bench/tbq_cpu.py [--prompts 2] [--tokens 256] [--budget 96] [--model DIR]

Committed result: bench/results/tbq-cpu.json, from
`python bench/tbq_cpu.py --prompts 2 --tokens 256 --budget 96` (2 shared cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import sys
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_cpu import start_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "A farmer has 17 cows and buys 23 more, then sells a third of them. How many are left? Think step by step.",
    "Is 391 a prime number? Reason carefully and check each divisor.",
    "Write the steps to sort the list 9, 4, 7, 1, 8 with insertion sort, showing the list after each step.",
    "A train leaves at 14:35 and arrives at 18:10. How long is the trip? Explain.",
    "If x + 2y = 11 and 3x - y = 5, find x and y. Show your work.",
    "Explain why the sum of two odd numbers is even, then give three examples.",
    "How many days are there between March 3 and June 17 of the same year? Count month by month.",
    "A rectangle has a perimeter of 30 and an area of 56. Find its sides.",
]


def run(url: str, question: str, params: dict, budget: int, tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "kv_policy": {"name": "thinkv", "budget": budget, "params": params}}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1800)
    r.raise_for_status()
    kv = r.json()["kv_usage"]
    region_tokens = kv["retained_tokens"] - (kv["prompt_tokens"] - kv["prefix_cache_hit_tokens"])
    return {"tbq": kv["tbq"], "retained_tokens": kv["retained_tokens"], "region_tokens": region_tokens,
            "retained_kv_bytes": kv["retained_kv_bytes"], "kv_bits_per_element": kv["kv_bits_per_element"],
            "evicted_tokens": kv["evicted_tokens"]}


def summary(runs: list[dict], layers_heads: int) -> dict:
    size = sum(r["retained_kv_bytes"] for r in runs)
    tokens = sum(r["region_tokens"] for r in runs)
    return {"retained_kv_bytes": size, "region_tokens": tokens,
            "bytes_per_token_per_layer_head": round(size / tokens / layers_heads, 2),
            "bytes_per_token": round(size / tokens, 1),
            "mean_bits_per_element": round(sum(r["kv_bits_per_element"] for r in runs) / len(runs), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--budget", type=int, default=96)
    ap.add_argument("--model", help="checkpoint dir (default: embedded SmolLM2-135M-Instruct)")
    args = ap.parse_args()
    # A small token pool: the region (and its quantized pages) is sized from it on CPU.
    extra = ["--max-total-tokens", "8192"] + (["--model", args.model] if args.model else [])
    settings = {"tbq": {}, "no_tbq": {"tbq": False}}
    # A TBQ step on 2 shared CPU cores is slow (the PyTorch path dequantizes every page it reads).
    os.environ.setdefault("KVSIEVE_LIMITS__REQUEST_TIMEOUT_S", "3600")
    proc, url, _ = start_server(extra)
    try:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        runs = {name: [] for name in settings}
        for question in tqdm(QUESTIONS[:args.prompts], desc="prompts"):
            for name, params in settings.items():
                runs[name].append(run(url, question, params, args.budget, args.tokens))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    layers_heads = 30 * 3 if not args.model else None  # SmolLM2-135M: 30 layers x 3 kv heads
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or 'cpu'}",
        "command": "python bench/tbq_cpu.py " + " ".join(sys.argv[1:]),
        "model": model,
        "policy": {"name": "thinkv", "budget": args.budget, "max_tokens": args.tokens},
        "note": "bytes are the region's (generated tokens); the prompt stays in the radix cache. "
                "bytes_per_token_per_layer_head: K and V of one token in one (layer, kv head).",
        "summary": {name: summary(r, layers_heads or 1) for name, r in runs.items()},
        "runs": runs,
    }
    s = result["summary"]
    result["bytes_ratio_without_over_with"] = round(s["no_tbq"]["bytes_per_token"] / s["tbq"]["bytes_per_token"], 2)
    out = ROOT / "bench" / "results" / "tbq-cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2), result["bytes_ratio_without_over_with"])


if __name__ == "__main__":
    main()
