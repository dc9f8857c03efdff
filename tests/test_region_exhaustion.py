"""A full compressed region ends only the request that cannot fit, with a 503
and Retry-After; other requests keep running and every page comes back."""

import asyncio

import httpx

from conftest import start_server
from test_compressed import metric, region_idle


def test_region_full_is_a_503_and_nothing_else_breaks(tiny_llama, tmp_path):
    # Tiny Llama: 2 layers x 2 kv heads. 6 pages of 16 slots: one request
    # with budget 40 needs 3 pages per (layer, head) = 12 pages and overflows.
    server = start_server(tmp_path, "--model", str(tiny_llama), env={"KVSIEVE_REGION_PAGES": "6"})
    try:
        assert "compressed region" in server.log() and "token pool" in server.log()

        async def run():
            async with httpx.AsyncClient(timeout=300) as client:
                url = f"{server.url}/v1/completions"
                full = client.post(url, json={"prompt": [5, 6, 7], "max_tokens": 60, "ignore_eos": True})
                big = client.post(url, json={"prompt": [8, 9, 10], "max_tokens": 60, "ignore_eos": True,
                                             "kv_policy": {"name": "h2o", "budget": 40}})
                return await asyncio.gather(full, big)

        full, big = asyncio.run(run())
        assert full.status_code == 200 and full.json()["usage"]["completion_tokens"] == 60
        assert big.status_code == 503, big.text
        assert big.headers["retry-after"] == "1"
        assert "region is full" in big.json()["error"]["message"]
        assert region_idle(server)
        # A request that fits still runs afterwards.
        ok = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": [11, 12], "max_tokens": 20, "ignore_eos": True, "kv_policy": {"name": "streaming", "budget": 8}})
        assert ok.status_code == 200 and ok.json()["kv_usage"]["retained_tokens"] == 8
        assert metric(server, "kvsieve_region_pages", state="free") == 6
    finally:
        assert server.stop() == 0, server.log()
