"""Latency and tokens/s through Ray Serve vs the single-process server, same
load: `python -m kvsieve.service.scale.overhead --model DIR --out FILE.json`.

Starts each set-up in turn (`kvsieve serve`, then `kvsieve serve --replicas N`
for each N asked), runs the same closed-loop load (streaming completions,
fixed prompt and length, ignore_eos) and writes one JSON record per set-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ..sse_client import asse_lines


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], log: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    kvsieve = str(Path(sys.executable).with_name("kvsieve"))
    proc = subprocess.Popen([kvsieve, "serve", "--port", str(port), *args], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: see {log}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"server did not come up: see {log}")


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    start = time.perf_counter()
    first = None
    tokens = 0
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
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    return {"e2e": end - start, "ttft": (first or end) - start, "tokens": tokens}


async def _load(url: str, concurrency: int, requests: int, body: dict) -> dict:
    results: list[dict] = []
    queue = list(range(requests))
    async with httpx.AsyncClient(timeout=600) as client:
        await _one(client, url, {**body, "max_tokens": 2})  # warm-up

        async def worker():
            while queue:
                queue.pop()
                results.append(await _one(client, url, body))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    e2e = sorted(r["e2e"] for r in results)
    ttft = sorted(r["ttft"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {
        "requests": len(results), "wall_s": round(wall, 3), "output_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2), "requests_per_s": round(len(results) / wall, 3),
        "e2e_p50_s": round(statistics.median(e2e), 4), "e2e_p95_s": round(pct(e2e, 0.95), 4),
        "ttft_p50_s": round(statistics.median(ttft), 4), "ttft_p95_s": round(pct(ttft, 0.95), 4),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--replicas", type=int, action="append", help="Ray Serve set-ups to measure (default: 1 and 2)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--start-timeout", type=float, default=900)
    args = p.parse_args(argv)
    body = {"prompt": "the model thinks step by step about numbers and words " * 3,
            "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True, "kv_policy": "full"}
    setups = [("single-process", [])] + [
        (f"ray-serve-{n}-replica{'s' if n > 1 else ''}", ["--replicas", str(n)]) for n in (args.replicas or [1, 2])]
    out = {"machine": f"{platform.node()} {os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d"),
           "model": Path(args.model).name, "load": {"concurrency": args.concurrency, "requests": args.requests,
                                                   "max_tokens": args.max_tokens, "stream": True, "policy": "full"},
           "results": {}}
    for name, extra in setups:
        log = Path(args.out).with_suffix(f".{name}.log")
        proc, url = _start(["--model", args.model, *extra], log, args.start_timeout)
        try:
            out["results"][name] = asyncio.run(_load(url, args.concurrency, args.requests, body))
            print(name, out["results"][name], flush=True)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=180)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
