"""Prefix-aware routing vs Serve's power of two choices, 2 engine replicas:
8 system prompts x many users, each request its system prompt plus a short
question of its own. Measures the radix-cache hit rate (`cached_tokens` /
prompt tokens) and TTFT per set-up; writes JSON and a PNG.

    python loadtest/prefix_routing.py --model DIR --out loadtest/results/prefix-routing

The token pool (`--max-total-tokens`) is sized so that one replica cannot
keep every system prompt cached at once, as with a real model whose KV
memory is the limit: routing by prefix then keeps each replica's share.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

from kvsieve.service.scale.overhead import _start
from kvsieve.service.sse_client import asse_lines

WORDS = ("model cache token prefix replica route think verify answer number word graph node edge batch "
         "policy budget memory page layer head query key value step").split()


def system_prompts(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"system {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


async def one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    first, usage = None, None
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "kv_policy": "full"}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in asse_lines(r):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            if first is None and event["choices"][0]["text"]:
                first = time.perf_counter()
            usage = event.get("usage") or usage
    return {"ttft": (first or time.perf_counter()) - start, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


async def load(url: str, prompts: list[str], requests: int, concurrency: int, max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    work = [f"{rng.choice(prompts)}\nuser {i}: {' '.join(rng.choice(WORDS) for _ in range(6))}?"
            for i in range(requests)]
    results: list[dict] = []
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker():
            while work:
                results.append(await one(client, url, work.pop(), max_tokens))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    ttft = sorted(r["ttft"] for r in results)
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    return {"requests": len(results), "wall_s": round(wall, 2), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": round(cached / prompt, 4), "ttft_p50_s": round(statistics.median(ttft), 4),
            "ttft_p95_s": round(ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))], 4),
            "ttft_s": [round(x, 4) for x in ttft]}


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["results"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(names, [out["results"][n]["hit_rate"] for n in names], color=["#888", "#2a7"])
    a.set_ylabel("radix-cache hit rate (cached / prompt tokens)")
    a.set_ylim(0, 1)
    for n in names:
        ttft = out["results"][n]["ttft_s"]
        b.plot(sorted(ttft), [i / len(ttft) for i in range(1, len(ttft) + 1)], label=n)
    b.set_xlabel("TTFT (s)")
    b.set_ylabel("fraction of requests")
    b.legend()
    fig.suptitle(f"2 replicas, {out['load']['system_prompts']} system prompts x {out['load']['requests']} requests "
                 f"({out['machine']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, help="path prefix: writes OUT.json, OUT.png and the server logs")
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--prompt-words", type=int, default=300)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--max-total-tokens", type=int, default=4096)
    p.add_argument("--start-timeout", type=float, default=900)
    args = p.parse_args(argv)
    out_base = Path(args.out)
    out_base.parent.mkdir(parents=True, exist_ok=True)
    prompts = system_prompts(args.system_prompts, args.prompt_words)
    out = {"machine": f"{platform.node()} {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
           "date": time.strftime("%Y-%m-%d %H:%M"), "model": Path(args.model).name,
           "load": {"system_prompts": args.system_prompts, "prompt_words": args.prompt_words,
                    "requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                    "max_total_tokens": args.max_total_tokens, "policy": "full"},
           "results": {}}
    for routing in ("pow2", "prefix"):
        config = out_base.with_suffix(f".{routing}.yaml")
        config.write_text(f"ray:\n  replicas: 2\n  routing: {routing}\n")
        log = out_base.with_suffix(f".{routing}.log")
        proc, url = _start(["--model", args.model, "--config", str(config),
                            "--max-total-tokens", str(args.max_total_tokens)], log, args.start_timeout)
        try:
            result = asyncio.run(load(url, prompts, args.requests, args.concurrency, args.max_tokens, seed=1))
            out["results"][routing] = result
            print(routing, {k: v for k, v in result.items() if k != "ttft_s"}, flush=True)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=300)
    out_base.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    plot(out, out_base.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
