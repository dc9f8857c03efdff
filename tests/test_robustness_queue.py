"""The waiting queue with compressed requests in it, on one server whose
16-page region holds one BIG request at a time, with SGLang's queue limit (2)
and waiting timeout (5 s):

- requests SGLang drops before they run (queue limit, waiting timeout, a
  client gone while running) leave no runtime entry: the
  `kvsieve_compressed_requests_live` gauge counts them while queued and
  returns to 0;
- a compressed request waiting for region room does not hold back a `full`
  request behind it that fits the pool.

The long request is cancelled by the client once the checks ran, so no
assertion depends on how fast this machine decodes."""

import asyncio

import httpx
import pytest

from conftest import start_server
from test_compressed import metric, region_idle
from test_region_exhaustion import completion, until

LIVE = "kvsieve_compressed_requests_live"
# 3 pages per (layer, head) x 4: one at a time in 16 pages.
BIG = {"name": "h2o", "budget": 40}
LONG = 1900  # tokens; the request is cancelled long before it ends


@pytest.fixture(scope="module")
def queue_server(tiny_llama, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("queue"), "--model", str(tiny_llama),
                          "--max-queued-requests", "2",
                          env={"KVSIEVE_REGION_PAGES": "16", "SGLANG_REQ_WAITING_TIMEOUT": "5"})
    yield server
    assert server.stop() == 0, server.log()


async def start_long(client, server, prompt):
    running = asyncio.create_task(client.post(f"{server.url}/v1/completions", json=completion(prompt, LONG, BIG)))
    await until(lambda: metric(server, "kvsieve_region_reserved_pages") == 12)
    return running


async def cancel(task):
    assert not task.done(), f"the long request ended early: {task.result().text[:500]}"
    task.cancel()  # the client goes away: the service aborts the request in the engine
    with pytest.raises(asyncio.CancelledError):
        await task


def test_dropped_requests_leave_no_runtime_entry(queue_server):
    server = queue_server

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            url = f"{server.url}/v1/completions"
            running = await start_long(client, server, [30, 31])
            waiting = []
            for i in range(2):
                waiting.append(asyncio.create_task(client.post(url, json=completion([32 + i, 9], 20, BIG))))
                # SGLang's queue gauge lags (logged every few steps); this one is set at admission.
                await until(lambda: metric(server, LIVE) == i + 2)
            live_queued = metric(server, LIVE)
            # Past the queue limit: refused before they are queued.
            refused = [await client.post(url, json=completion([40 + i, 9], 20, BIG)) for i in range(3)]
            # Then the two waiting ones time out (SGLANG_REQ_WAITING_TIMEOUT).
            timed_out = [await t for t in waiting]
            still_running = not running.done()
            await cancel(running)
            return live_queued, refused, timed_out, still_running

    live_queued, refused, timed_out, still_running = asyncio.run(run())
    assert live_queued == 3  # one running, two waiting
    for r in refused + timed_out:
        assert r.status_code == 503, r.text
    assert "timeout" in timed_out[0].text
    assert still_running  # they timed out while the region was taken
    asyncio.run(until(lambda: metric(server, LIVE) == 0, timeout=60))
    assert region_idle(server)
    assert metric(server, "kvsieve_region_reserved_pages") == 0


def test_a_region_wait_does_not_block_full_requests(queue_server):
    server = queue_server

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            url = f"{server.url}/v1/completions"
            running = await start_long(client, server, [50, 51])
            waiting = asyncio.create_task(client.post(url, json=completion([52, 53], 20, BIG)))
            await until(lambda: metric(server, LIVE) == 2)
            full = await client.post(url, json=completion([54, 55, 56], 8, "full"))
            # Passed while the compressed request still waited for region room.
            order = (waiting.done(), running.done())
            await cancel(running)
            return full, order, await waiting

    full, (waiting_done, running_done), waiting = asyncio.run(run())
    assert full.status_code == 200 and full.json()["usage"]["completion_tokens"] == 8
    assert not waiting_done and not running_done
    # Once the region had room, the waiting request ran.
    assert waiting.status_code == 200, waiting.text
    assert waiting.json()["usage"]["completion_tokens"] == 20
    asyncio.run(until(lambda: metric(server, LIVE) == 0, timeout=60))
    assert region_idle(server)
