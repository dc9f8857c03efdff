"""Compressed-request benchmark on CPU: the embedded default model behind
`kvsieve serve` (kvsieve attention backend).

1. TPOT (time per output token after the first, streamed) of every wired
   policy vs `full` in the same run, at each batch size (--batches), with the
   ratio to `full` at the same batch.
2. A 1,000-token generation with budget 64 (skipped with --long-tokens 0):
   retained private tokens per (layer, kv head) and region pages, which must
   stay within the budget plus one page of slack per (layer, head).

    .venv/bin/python bench/compressed_cpu.py [--tokens 64] [--batches 1,8,32] [--long-tokens 1000]
        [--out bench/results/cpu-batched.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from foundation_cpu import start_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ["full", "streaming", "h2o", "snapkv", "longflow"]
PROMPT = [{"role": "user", "content": "Think step by step: what is 17 times 23?"}]


def policy_spec(name: str, budget: int):
    return "full" if name == "full" else {"name": name, "budget": budget}


async def streamed_tpot(client, url, policy, tokens) -> tuple[float, dict]:
    body = {"messages": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "kv_policy": policy}
    first = last = None
    final = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.monotonic()
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = first or now
                last = now
            if "kv_usage" in chunk:
                final = chunk
    n = final["usage"]["completion_tokens"]
    return (last - first) / max(n - 1, 1), final["kv_usage"]


async def tpot_run(url, policy, batch, tokens) -> float:
    async with httpx.AsyncClient(timeout=1800) as client:
        await streamed_tpot(client, url, policy, 4)  # warm-up
        results = await asyncio.gather(*(streamed_tpot(client, url, policy, tokens) for _ in range(batch)))
    return sum(t for t, _ in results) / batch


def metric(url, name, **labels) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--long-tokens", type=int, default=1000)
    ap.add_argument("--long-budget", type=int, default=64)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--out", default="bench/results/cpu-batched.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    proc, url, start_s = start_server([])
    print(f"engine up in {start_s:.1f} s", flush=True)
    try:
        tpot = {}
        for name in POLICIES:
            for batch in batches:
                ms = 1000 * asyncio.run(tpot_run(url, policy_spec(name, args.budget), batch, args.tokens))
                tpot[f"{name}/batch{batch}"] = round(ms, 1)
                print(f"{name:10s} batch {batch}: TPOT {ms:.1f} ms", flush=True)

        ratio = {key: round(ms / tpot[f"full/{key.split('/')[1]}"], 2) for key, ms in tpot.items()
                 if not key.startswith("full/")}
        config = httpx.get(f"{url}/v1/models").json()["data"][0]
        if not args.long_tokens:
            long_result = None
        else:
            long_result = long_generation(url, args)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)

    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": "python bench/compressed_cpu.py " + " ".join(sys.argv[1:]),
        "model": config["id"],
        "engine_start_seconds": round(start_s, 1),
        "tpot_ms": tpot,
        "tpot_ratio_to_full": ratio,
        "tpot_setting": {"tokens": args.tokens, "budget": args.budget, "batches": batches},
        "long_run": long_result,
    }
    out = ROOT / args.out
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def long_generation(url, args) -> dict:
    print(f"{args.long_tokens} tokens, h2o budget {args.long_budget} ...", flush=True)

    async def long_run():
        async with httpx.AsyncClient(timeout=3600) as client:
            task = asyncio.create_task(streamed_tpot(client, url, policy_spec("h2o", args.long_budget), args.long_tokens))
            peak = 0.0
            while not task.done():
                peak = max(peak, metric(url, "kvsieve_region_pages", state="used"))
                await asyncio.sleep(1.0)
            return (await task), peak

    (long_tpot, kv), peak_pages = asyncio.run(long_run())
    return {"policy": "h2o", "tokens": args.long_tokens, "budget": args.long_budget,
            "tpot_ms": round(1000 * long_tpot, 1), "kv_usage": kv, "peak_region_pages_used": peak_pages}


if __name__ == "__main__":
    main()
