"""Admission by the compressed ceiling: with a small fixed token pool, all N
compressed requests run at once, where only a fraction of N full ones fit.
Generated tokens of compressed requests take no pool slot."""

import asyncio
import time

import httpx
import pytest

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


@pytest.fixture(scope="module")
def small_pool_server(tiny_llama, tmp_path_factory):
    """A 256-token pool, shared by the two tests below: each ends with the
    region idle, and the radix cache they leave is evictable pool space."""
    server = start_server(tmp_path_factory.mktemp("small-pool"), "--model", str(tiny_llama),
                          "--max-total-tokens", "256")
    yield server
    assert server.stop() == 0, server.log()


def test_compressed_requests_fit_where_full_ones_do_not(small_pool_server):
    server = small_pool_server
    prompts = [[i + 1, 20, 30, 40] for i in range(N)]
    full, full_peak = asyncio.run(run_batch(server, "full", prompts))
    compressed, compressed_peak = asyncio.run(
        run_batch(server, {"name": "h2o", "budget": 16, "compress_prompt": True}, [[p[0] + 100, *p[1:]] for p in prompts]))
    assert all(r["usage"]["completion_tokens"] == NEW for r in full + compressed)
    assert all(r["kv_usage"]["retained_tokens"] == 16 for r in compressed)
    # Each full request needs ~125 of the 256 pool tokens; a compressed
    # one needs its 4 prompt tokens plus a page.
    assert compressed_peak == N
    assert full_peak < N
    assert region_idle(server)


def test_prompt_memory_returns_after_prefill(small_pool_server):
    """Three prompts of 150 private tokens, streaming with budget 16, in a
    256-token pool and its default 64-page region (2 layers x 2 kv heads).

    Pool: two prompts never fit at once, so all three run together only if
    each prompt's pool slots come back when its prefill ends.
    Region: each request's ceiling is 10 pages per (layer, head) while its
    prompt is held (40 in all); after the policy cuts it, it holds 3 per head
    (sinks in page 0, the recent tokens in pages 8-9), so the reservation
    shrinks to 12 and 12 + 12 + 40 fit in 64."""
    server = small_pool_server
    assert "64 pages x 16 slots" in server.log()
    # First ids the test above did not use (it shares this server): no radix hit.
    prompts = [[N + 1 + i] + [(7 * j + 13 * i) % 300 + 50 for j in range(149)] for i in range(3)]
    # Buffer 1: cut to the budget every step (the default's 16 would reserve 32 a head).
    policy = {"name": "streaming", "budget": 16, "compress_prompt": True, "params": {"buffer": 1}}
    results, peak = asyncio.run(run_batch(server, policy, prompts))
    assert all(r["usage"]["completion_tokens"] == NEW for r in results)
    assert all(r["kv_usage"]["retained_tokens"] == 16 for r in results)
    assert peak == 3
    assert region_idle(server)
    assert metric(server, "kvsieve_region_reserved_pages") == 0
    # The pool is whole again: a full request of 240 tokens fits.
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "prompt": prompts[0] + prompts[1][:50], "max_tokens": 40, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40


def test_retracted_requests_come_back_and_compressed_ones_go_last(tiny_llama, tmp_path):
    # SGLang's test switch retracts at least one running request every 3rd
    # forward pass (keeping one). Full requests are retracted before
    # compressed ones; when only compressed ones run, they are retracted too,
    # re-admitted with their outputs as prompt, and finish with every page back.
    server = start_server(tmp_path, "--model", str(tiny_llama), env={"SGLANG_TEST_RETRACT": "1"})
    compressed = [{"name": name, "budget": 16, "compress_prompt": True} for name in ("h2o", "longflow")] + \
        [{"name": "streaming", "budget": 16, "compress_prompt": True, "params": {"buffer": 1}}]  # cuts every step

    async def run(policies, first_token):
        async with httpx.AsyncClient(timeout=600) as client:
            bodies = [{"prompt": [first_token + i, 20, 30, 40, 50], "max_tokens": 80, "ignore_eos": True,
                       "temperature": 0, "kv_policy": policy} for i, policy in enumerate(policies)]
            results = await asyncio.gather(*(client.post(f"{server.url}/v1/completions", json=b) for b in bodies))
        for r, policy in zip(results, policies):
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 80
            if policy != "full":
                assert r.json()["kv_usage"]["retained_tokens"] == 16

    try:
        asyncio.run(run(["full", *compressed], 1))
        mixed = metric(server, "sglang:num_retracted_requests_total")
        assert mixed > 0
        asyncio.run(run(compressed, 10))  # retractions now can only hit compressed requests
        assert metric(server, "sglang:num_retracted_requests_total") > mixed
        assert region_idle(server)
        assert metric(server, "kvsieve_region_reserved_pages") == 0
    finally:
        assert server.stop() == 0, server.log()


def test_the_last_request_under_max_running_requests_is_not_held_behind_a_chunked_prefill(tiny_llama, tmp_path):
    """As many requests as --max-running-requests, prompts of 70 tokens in
    128-token prefill chunks (every pass holds a chunked request): SGLang
    0.5.17 counts a chunked request twice when it checks the batch's slots,
    marks the batch full one request early, and keeps it so until a running
    request finishes; the last request then waited for the whole batch to
    end. kvsieve's next-batch hook lets the queue try again after a prefill:
    every request starts before any finishes, compressed and full alike."""
    rows, new = 12, 48
    server = start_server(tmp_path, "--model", str(tiny_llama), "--max-running-requests", str(rows),
                          "--chunked-prefill-size", "128")
    policies = ["full", {"name": "streaming", "budget": 16}, {"name": "h2o", "budget": 16}]

    async def run():
        started = time.monotonic()
        first, done = [None] * rows, [None] * rows
        async with httpx.AsyncClient(timeout=600) as client:
            async def one(i):
                body = {"prompt": [i + 1] + [(11 * j + 7 * i) % 300 + 50 for j in range(69)], "max_tokens": new,
                        "ignore_eos": True, "temperature": 0, "stream": True, "kv_policy": policies[i % 3]}
                async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                    assert r.status_code == 200, await r.aread()
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and first[i] is None:
                            first[i] = time.monotonic() - started
                done[i] = time.monotonic() - started
            await asyncio.gather(*(one(i) for i in range(rows)))
        return first, done

    try:
        first, done = asyncio.run(run())
        assert max(first) < min(done), (first, done)  # all ran at once: none waited for another to end
        assert region_idle(server)
    finally:
        assert server.stop() == 0, server.log()
