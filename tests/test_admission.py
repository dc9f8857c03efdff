"""Admission by the compressed ceiling: with a small fixed token pool, all N
compressed requests run at once, where only a fraction of N full ones fit.
Generated tokens of compressed requests take no pool slot."""

import asyncio

import httpx

from conftest import start_server
from test_compressed import metric, region_idle

N, NEW = 6, 120


async def run_batch(server, policy, prompts):
    peak = 0
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(p):
            body = {"prompt": p, "max_tokens": NEW, "ignore_eos": True, "temperature": 0, "kv_policy": policy}
            r = await client.post(f"{server.url}/v1/completions", json=body)
            r.raise_for_status()
            return r.json()
        tasks = [asyncio.create_task(one(p)) for p in prompts]
        while not all(t.done() for t in tasks):
            peak = max(peak, metric(server, "sglang:num_running_reqs"))
            await asyncio.sleep(0.05)
        return [t.result() for t in tasks], int(peak)


def test_compressed_requests_fit_where_full_ones_do_not(tiny_llama, tmp_path):
    server = start_server(tmp_path, "--model", str(tiny_llama), "--max-total-tokens", "256")
    try:
        prompts = [[i + 1, 20, 30, 40] for i in range(N)]
        full, full_peak = asyncio.run(run_batch(server, "full", prompts))
        compressed, compressed_peak = asyncio.run(
            run_batch(server, {"name": "h2o", "budget": 16}, [[p[0] + 100, *p[1:]] for p in prompts]))
        assert all(r["usage"]["completion_tokens"] == NEW for r in full + compressed)
        assert all(r["kv_usage"]["retained_tokens"] == 16 for r in compressed)
        # Each full request needs ~125 of the 256 pool tokens; a compressed
        # one needs its 4 prompt tokens plus a page.
        assert compressed_peak == N
        assert full_peak < N
        assert region_idle(server)
    finally:
        assert server.stop() == 0, server.log()
