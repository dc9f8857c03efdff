"""TPOT on CPU: the embedded default model behind `kvsieve serve` (kvsieve
attention backend), streamed chat, greedy, ignore_eos.

1. TPOT (time per output token after the first) of each policy (--policies;
   default `full` and every compressing policy of the registry) at each
   batch size (--batches), all at budget --budget in one server, with the
   ratio to `full` at the same batch.
2. A long generation with h2o (--long-tokens, budget --long-budget; 0 skips
   it): retained private tokens per (layer, kv head) and the peak of region
   pages in use, which stay within the budget plus one page of slack per
   (layer, head).

    .venv/bin/python bench/cpu_tpot.py [--tokens 64] [--batches 1,8,32] [--long-tokens 1000]
        [--policies full,streaming,...] [--out bench/results/cpu-batched.json]

Committed result: bench/results/cpu-batched.json (2-core x86_64,
2026-11-22), from `python bench/cpu_tpot.py --tokens 64 --batches 1,8,32
--long-tokens 0 --policies full,streaming,h2o,snapkv,longflow`.
bench/plot_cpu_tpot.py draws it as docs/plots/cpu-batched-tpot.png;
bench/policy_cost.py reads its `full` TPOT as the CPU step time.
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
from serve_cpu import start_server  # noqa: E402

from kvsieve.policies import get_policy, policy_names  # noqa: E402
from kvsieve.service.sse_client import asse_lines  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [{"role": "user", "content": "Think step by step: what is 17 times 23?"}]


def policy_spec(name: str, budget: int):
    return "full" if name == "full" else {"name": name, "budget": budget}


async def streamed_tpot(client, url, policy, tokens) -> tuple[float, dict]:
    body = {"messages": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "kv_policy": policy}
    first = last = None
    final = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        async for line in asse_lines(r):
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
    ap.add_argument("--policies", default=",".join(["full"] + [n for n in policy_names() if get_policy(n).compresses]))
    ap.add_argument("--out", default="bench/results/cpu-batched.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    proc, url, start_s = start_server([])
    print(f"engine up in {start_s:.1f} s", flush=True)
    try:
        tpot = {}
        for name in args.policies.split(","):
            for batch in batches:
                ms = 1000 * asyncio.run(tpot_run(url, policy_spec(name, args.budget), batch, args.tokens))
                tpot[f"{name}/batch{batch}"] = round(ms, 1)
                print(f"{name:10s} batch {batch}: TPOT {ms:.1f} ms", flush=True)

        ratio = {key: round(ms / tpot[f"full/{key.split('/')[1]}"], 2) for key, ms in tpot.items()
                 if not key.startswith("full/") and f"full/{key.split('/')[1]}" in tpot}
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
        "command": "python bench/cpu_tpot.py " + " ".join(sys.argv[1:]),
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
