"""A retracted compressed request must prefill its prompt and everything it
generated again. Its length is bounded by the context, not by the token pool,
so past the pool's size that re-prefill can never fit: it ends with a 503
naming why, instead of waiting forever at the head of the queue.

SGLang's test switch (SGLANG_TEST_RETRACT) retracts one of the running
requests every third forward pass; in a 128-token pool, two compressed
requests of 200 tokens each are retracted past that size sooner or later.
Their prompts go to the region (compress_prompt), which is large here, so
pool slots come back after each prefill and region room never runs short:
the only bound left is the one under test."""

import asyncio

import httpx

from conftest import start_server
from test_compressed import metric, region_idle
from test_region_exhaustion import completion

POLICY = {"name": "streaming", "budget": 16, "compress_prompt": True}


def test_a_retracted_request_that_cannot_resume_ends_with_a_503(tiny_llama, tmp_path):
    server = start_server(tmp_path, "--model", str(tiny_llama), "--max-total-tokens", "128",
                          env={"SGLANG_TEST_RETRACT": "1", "KVSIEVE_REGION_PAGES": "400"})
    try:
        async def run():
            async with httpx.AsyncClient(timeout=httpx.Timeout(400)) as client:
                bodies = [completion([60 + i, 61, 62, 63], 200, POLICY)
                          for i in range(2)]
                return await asyncio.gather(*(client.post(f"{server.url}/v1/completions", json=b)
                                              for b in bodies))

        results = asyncio.run(run())
        assert metric(server, "sglang:num_retracted_requests_total") > 0
        statuses = sorted(r.status_code for r in results)
        # The last one running is never retracted (SGLang keeps one); one
        # retracted past the pool's size could not come back.
        assert statuses == [200, 503], [r.text[:300] for r in results]
        done = next(r for r in results if r.status_code == 200)
        assert done.json()["usage"]["completion_tokens"] == 200
        refused = next(r for r in results if r.status_code == 503)
        assert "retracted" in refused.text and "token pool" in refused.text, refused.text
        assert metric(server, "kvsieve_compressed_requests_live") == 0
        assert region_idle(server)
    finally:
        assert server.stop() == 0, server.log()
