"""kvsieve serve on CPU against a plain SGLang engine: the embedded default
model (or --model), greedy, ignore_eos, `full` requests.

Measures engine start (process start to /health ok) and decode throughput
(tokens/s end to end through the HTTP API, one stream and a batch of 8
concurrent requests) and writes bench/results/serve-cpu.json. With --plain,
the same load also runs on a plain `sglang.Engine` in this process (no
HTTP, no plugin), recorded beside it as `plain_engine`.

    .venv/bin/python bench/serve_cpu.py [--tokens 128] [--model DIR] [--plain]

Committed result: bench/results/serve-cpu.json (2-core x86_64, 2026-11-21),
from `python bench/serve_cpu.py --tokens 128`. bench/cpu_tpot.py starts its
server with start_server() from here.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [{"role": "user", "content": "Explain step by step why the sky is blue."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str, float]:
    port = _free_port()
    t0 = time.monotonic()
    proc = subprocess.Popen([str(Path(sys.executable).with_name("kvsieve")), "serve", "--port", str(port), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise RuntimeError("server exited during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url, time.monotonic() - t0
        except httpx.HTTPError:
            time.sleep(0.2)


async def _one(client: httpx.AsyncClient, url: str, tokens: int) -> int:
    body = {"messages": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    r = await client.post(f"{url}/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


async def throughput(url: str, batch: int, tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=900) as client:
        await _one(client, url, 4)  # warm-up
        t0 = time.monotonic()
        done = await asyncio.gather(*(_one(client, url, tokens) for _ in range(batch)))
        elapsed = time.monotonic() - t0
    return {"batch": batch, "tokens_per_request": tokens, "seconds": round(elapsed, 2),
            "tokens_per_second": round(sum(done) / elapsed, 1)}


def plain_engine(model: str | None, tokens: int) -> list[dict]:
    """The same batches on a plain sglang.Engine in this process (prompts of
    30 token ids instead of the chat template)."""
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    import sglang

    from kvsieve.service.default_model import ensure_default_model

    engine = sglang.Engine(model_path=model or str(ensure_default_model()), device="cpu",
                           attention_backend="torch_native", sampling_backend="pytorch", disable_cuda_graph=True,
                           max_total_tokens=65536, log_level="error")
    params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    runs = []
    try:
        engine.generate(input_ids=list(range(100, 130)), sampling_params={**params, "max_new_tokens": 4})  # warm-up
        for batch in (1, 8):
            prompts = [list(range(100 + i, 130 + i)) for i in range(batch)]
            t0 = time.monotonic()
            engine.generate(input_ids=prompts, sampling_params=params)
            elapsed = time.monotonic() - t0
            runs.append({"batch": batch, "tokens_per_request": tokens, "seconds": round(elapsed, 2),
                         "tokens_per_second": round(batch * tokens / elapsed, 1)})
            print(f"plain engine, batch {batch}: {runs[-1]['tokens_per_second']} tok/s", flush=True)
    finally:
        engine.shutdown()
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--model", help="checkpoint dir (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--plain", action="store_true", help="also run the load on a plain sglang.Engine")
    args = ap.parse_args()
    extra = ["--model", args.model] if args.model else []

    print("starting kvsieve serve ...", flush=True)
    proc, url, start_s = start_server(extra)
    print(f"engine up in {start_s:.1f} s", flush=True)
    try:
        runs = []
        for batch in (1, 8):
            print(f"batch {batch}: {args.tokens} tokens per request ...", flush=True)
            runs.append(asyncio.run(throughput(url, batch, args.tokens)))
            print(f"  {runs[-1]['tokens_per_second']} tok/s", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or 'cpu'}",
        "command": "python bench/serve_cpu.py " + " ".join(sys.argv[1:]),
        "model": args.model or "SmolLM2-135M-Instruct (embedded, bf16)",
        "engine_start_seconds": round(start_s, 1),
        "runs": runs,
    }
    if args.plain:
        result["plain_engine"] = plain_engine(args.model, args.tokens)
    out = ROOT / "bench" / "results" / "serve-cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
