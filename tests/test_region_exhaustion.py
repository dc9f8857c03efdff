"""Admission by the region side of the compressed ceiling: a compressed
request whose ceiling does not fit next to the running ones waits in the
queue and then runs; one that could never fit is a 400 naming kv_policy;
past --max-queued-requests a new request gets a 503 with Retry-After.
Running requests are never disturbed and every page comes back."""

import asyncio
import time

import httpx
import pytest

from conftest import start_server
from test_compressed import metric, region_idle

# Tiny Llama: 2 layers x 2 kv heads = 4 (layer, head) pairs; pages of 16 slots.
REGION_PAGES = 16
# h2o with budget 40 may hold 41 tokens per (layer, head): 3 pages each, 12 in
# all, so two of these never run at once in a 16-page region.
BIG = {"name": "h2o", "budget": 40, "compress_prompt": True}


def completion(prompt, max_tokens, policy):
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "kv_policy": policy}


async def watch(server, tasks, names):
    """Peak of each metric while the tasks run."""
    peaks = dict.fromkeys(names, 0.0)
    while not all(t.done() for t in tasks):
        for name in names:
            peaks[name] = max(peaks[name], metric(server, name))
        await asyncio.sleep(0.02)
    return peaks


@pytest.fixture(scope="module")
def small_region_server(tiny_llama, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("region"), "--model", str(tiny_llama),
                          "--max-queued-requests", "1", env={"KVSIEVE_REGION_PAGES": str(REGION_PAGES)})
    yield server
    assert server.stop() == 0, server.log()


def test_requests_wait_for_region_room_and_then_run(small_region_server):
    server = small_region_server
    assert "compressed region" in server.log() and "token pool" in server.log()
    solo = httpx.post(f"{server.url}/v1/completions", timeout=120, json=completion([8, 9, 10], 150, BIG)).json()

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            url = f"{server.url}/v1/completions"
            # One at a time into the queue: this server allows one waiting request.
            full = asyncio.create_task(client.post(url, json=completion([5, 6, 7], 400, "full")))
            await until(lambda: metric(server, "sglang:num_running_reqs") >= 1)
            first = asyncio.create_task(client.post(url, json=completion([8, 9, 10], 150, BIG)))
            await until(lambda: metric(server, "kvsieve_region_reserved_pages") == 12)
            second = asyncio.create_task(client.post(url, json=completion([11, 12, 13], 150, BIG)))
            tasks = [full, first, second]
            peaks = await watch(server, tasks, ["kvsieve_region_reserved_pages", "sglang:num_queue_reqs",
                                                "kvsieve_region_pages"])
            return [t.result() for t in tasks], peaks

    (full, first, second), peaks = asyncio.run(run())
    for r, n in ((full, 400), (first, 150), (second, 150)):
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == n
    # The second waited while the first held its 12 pages, then ran.
    assert peaks["sglang:num_queue_reqs"] >= 1
    assert peaks["kvsieve_region_reserved_pages"] == 12
    assert first.json()["choices"][0]["text"] == solo["choices"][0]["text"]
    assert second.json()["kv_usage"]["retained_tokens"] == 40
    assert region_idle(server)
    assert metric(server, "kvsieve_region_reserved_pages") == 0
    assert metric(server, "kvsieve_region_pages", state="free") == REGION_PAGES


def test_a_request_that_can_never_fit_is_a_400_naming_kv_policy(small_region_server):
    # Budget 100 may hold 101 tokens per (layer, head): 7 pages x 4 = 28 > 16.
    r = httpx.post(f"{small_region_server.url}/v1/completions", timeout=60,
                   json=completion([5, 6], 200, {"name": "h2o", "budget": 100}))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "kv_policy"
    assert "28 pages of the compressed region" in error["message"] and "has 16" in error["message"]
    # The same budget with fewer tokens to generate fits (ceiling 2 + 60 tokens: 4 pages each).
    ok = httpx.post(f"{small_region_server.url}/v1/completions", timeout=60,
                    json=completion([5, 6], 60, {"name": "h2o", "budget": 100}))
    assert ok.status_code == 200, ok.text
    assert region_idle(small_region_server)


def test_past_the_queue_limit_a_request_gets_a_503_and_others_finish(small_region_server):
    server = small_region_server

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            url = f"{server.url}/v1/completions"
            running = asyncio.create_task(client.post(url, json=completion([20, 21], 600, BIG)))
            await until(lambda: metric(server, "sglang:num_running_reqs") == 1)
            waiting = asyncio.create_task(client.post(url, json=completion([22, 23], 50, BIG)))
            await until(lambda: metric(server, "sglang:num_queue_reqs") == 1)
            refused = await client.post(url, json=completion([24, 25], 50, BIG))
            assert not running.done()  # the limit was hit while the first still ran
            return refused, await running, await waiting

    refused, running, waiting = asyncio.run(run())
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "server_error"
    assert running.status_code == 200 and running.json()["usage"]["completion_tokens"] == 600
    assert waiting.status_code == 200 and waiting.json()["usage"]["completion_tokens"] == 50
    assert region_idle(server)
    assert metric(server, "kvsieve_region_reserved_pages") == 0


async def until(condition, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)
