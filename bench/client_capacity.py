"""How much load bench/gpu_replicas.py's client can drive by itself:

    python bench/client_capacity.py [--rates 16,64] [--duration 20] [--out FILE]

A load run's TTFT is the client's, so a slow client would read as a slow
server. This replays gpu_replicas' streaming client (`replay`, httpx, one
event loop) against a stand-in OpenAI server in another process that
answers every /v1/completions at once with a fixed "prefill" pause, then
SSE chunks of `--chunk-tokens` tokens every `--tpot-ms` x chunk, so the
server adds nothing that grows with load. What the client then measures
above that floor is the client's own cost. Poisson arrivals at each rate,
generation lengths uniform in [--gen-min, --gen-max] as gpu_replicas' trace.

Written for issue #31: at 4 GPU replicas (64 requests/s through the
ingress) TTFT p50 rose from 0.12 s to 2.3 s while TPOT stayed 11.4 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import gpu_replicas  # noqa: E402  (its client, `replay`, is what this measures)
from gpu_replicas import free_port  # noqa: E402
from traffic import percentile  # noqa: E402


# ----- the stand-in server (run as `--serve PORT ...` in a child process) -----

def stand_in_app(prefill_s: float, tpot_s: float, chunk_tokens: int):
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def completions(request):
        body = await request.json()
        total = int(body["max_tokens"])

        async def events():
            await asyncio.sleep(prefill_s)
            done = 0
            while done < total:
                step = min(chunk_tokens, total - done)
                done += step
                last = done >= total
                event = {"choices": [{"index": 0, "text": "x" * step, "token_ids": list(range(step)),
                                      "finish_reason": "length" if last else None}]}
                if last:
                    event["usage"] = {"prompt_tokens": len(body["prompt"]), "completion_tokens": total,
                                      "prompt_tokens_details": {"cached_tokens": 0}}
                yield f"data: {json.dumps(event)}\n\n"
                if not last:
                    await asyncio.sleep(tpot_s * chunk_tokens)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def serve(port: int, prefill_s: float, tpot_s: float, chunk_tokens: int) -> None:
    import uvicorn

    uvicorn.run(stand_in_app(prefill_s, tpot_s, chunk_tokens), host="127.0.0.1", port=port, log_level="warning")


# ----- the client side -----

def wait_up(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"the stand-in server did not listen on {port} within {timeout} s")


def poisson_trace(rate: float, duration: float, gen_min: int, gen_max: int, prompt_tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    trace, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > duration:
            return trace
        trace.append({"id": len(trace), "arrival": t, "prompt": [1] * prompt_tokens, "policy": "full",
                      "gen": rng.randint(gen_min, gen_max)})


def figures(trace: list[dict], records: list[dict], prefill_s: float, chunk_tokens: int) -> dict:
    ttft = [r["chunks"][0][0] - r["sent"] for r in records if r["chunks"]]
    send_lag = [r["sent"] - q["arrival"] for r, q in zip(records, trace) if r["sent"] is not None]
    tpot = [(r["chunks"][-1][0] - r["chunks"][0][0]) / (r["tokens"] - chunk_tokens) * 1000
            for r in records if len(r["chunks"]) > 1 and r["tokens"] > chunk_tokens]
    r3 = lambda x: None if x is None else round(x, 3)  # noqa: E731
    return {"requests": len(trace), "errors": sum(1 for r in records if r["error"]),
            "unfinished": sum(1 for r in records if r["end"] is None),
            "ttft_floor_s": prefill_s, "ttft_p50_s": r3(percentile(ttft, 0.5)), "ttft_p99_s": r3(percentile(ttft, 0.99)),
            "send_lag_p99_s": r3(percentile(send_lag, 0.99)),
            "tpot_p50_ms": r3(percentile(tpot, 0.5)), "tpot_p99_ms": r3(percentile(tpot, 0.99)),
            "tokens": sum(r["tokens"] for r in records)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="16,64", help="requests/s, comma-separated")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
    ap.add_argument("--gen-min", type=int, default=128)
    ap.add_argument("--gen-max", type=int, default=1024)
    ap.add_argument("--prompt-tokens", type=int, default=768, help="token ids per prompt (gpu_replicas: 512-1024)")
    ap.add_argument("--prefill-ms", type=float, default=50.0, help="the stand-in's pause before its first chunk")
    ap.add_argument("--tpot-ms", type=float, default=11.4, help="the stand-in's time per token (the H200 runs' TPOT)")
    ap.add_argument("--chunk-tokens", type=int, default=8, help="tokens per SSE chunk (gpu_replicas' stream_interval)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.7, help="sent in each body, as gpu_replicas does")
    ap.add_argument("--out", default=None, help="JSON file for the results (printed only when absent)")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the child: serve on this port
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prefill_s, tpot_s = args.prefill_ms / 1000, args.tpot_ms / 1000
    if args.serve is not None:
        serve(args.serve, prefill_s, tpot_s, args.chunk_tokens)
        return 0
    port = free_port()
    child = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--prefill-ms", str(args.prefill_ms),
                              "--tpot-ms", str(args.tpot_ms), "--chunk-tokens", str(args.chunk_tokens)])
    results = []
    try:
        wait_up(port)
        for rate in [float(x) for x in args.rates.split(",")]:
            trace = poisson_trace(rate, args.duration, args.gen_min, args.gen_max, args.prompt_tokens, args.seed)
            timeout = args.duration + args.gen_max * tpot_s + 30
            records, cut = asyncio.run(gpu_replicas.replay(f"http://127.0.0.1:{port}", trace,
                                                           {"full": {"kv_policy": {"name": "full"}}}, args, timeout))
            row = {"rate": rate, "cut_off": cut is not None, **figures(trace, records, prefill_s, args.chunk_tokens)}
            results.append(row)
            print(f"rate {rate:g}/s: {row['requests']} requests, {row['errors']} errors; TTFT p50/p99 "
                  f"{row['ttft_p50_s']}/{row['ttft_p99_s']} s (floor {prefill_s}); send lag p99 "
                  f"{row['send_lag_p99_s']} s; TPOT p50/p99 {row['tpot_p50_ms']}/{row['tpot_p99_ms']} ms", flush=True)
    finally:
        child.terminate()
        child.wait(timeout=30)
    record = {"kind": "client_capacity", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs; "
                         "the stand-in server shares them)",
              "command": "python bench/client_capacity.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "config": {k: v for k, v in vars(args).items() if k not in ("serve", "out")}, "rates": results}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
