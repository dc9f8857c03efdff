"""Compressed requests under chunked prefill (16-token chunks): the prompt is
stored chunk by chunk, the output equals `full`, nothing leaks."""

import httpx

from test_compressed import complete, metric, region_idle


def test_chunked_prefill_compressed_equals_full(chunked_server):
    # The session's 16-token-chunk server (its clean exit is checked at the
    # session's end). Prompts start with ids 3 and 4, which its other user
    # (test_crystalcache_engine, ids >= 400) does not send: no radix hit.
    server = chunked_server
    prompt = [(7 * i) % 400 + 3 for i in range(70)]  # 5 chunks
    compressed = complete(server, prompt, {"name": "longflow", "budget": 512})
    full = complete(server, prompt, "full")
    assert compressed["choices"][0]["token_ids"] == full["choices"][0]["token_ids"]
    assert compressed["kv_usage"]["retained_tokens"] == len(prompt) + 24
    small = complete(server, [p + 1 for p in prompt], {"name": "snapkv", "budget": 10, "params": {"window": 8}})
    assert small["kv_usage"]["retained_tokens"] == 10 + 8 + 24
    assert region_idle(server)
    assert metric(server, "kvsieve_retained_kv_tokens") == 0
    assert httpx.get(f"{server.url}/health").status_code == 200
