"""Compressed requests end to end: kvsieve server, real SGLang engine with the
"kvsieve" attention backend, tiny Llama on CPU."""

import asyncio
import time

import httpx
import pytest
from kvsieve.service.sse_client import asse_lines

WIRED = ["streaming", "h2o", "snapkv", "longflow"]
GEN = 24


def complete(server, prompt_ids, policy, max_tokens=GEN, **extra):
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "kv_policy": policy, **extra}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def complete_together(server, requests, max_tokens):
    """[(prompt_ids, kv_policy)] sent at once (one batch on the server);
    their responses in order."""
    async def run():
        async with httpx.AsyncClient(timeout=600) as client:
            async def one(prompt, policy):
                body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                        "return_token_ids": True, "kv_policy": policy}
                r = await client.post(f"{server.url}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()
            return await asyncio.gather(*(one(prompt, policy) for prompt, policy in requests))

    return asyncio.run(run())


def metric(server, name, **labels):
    total = 0.0
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def region_idle(server, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(server, "kvsieve_region_pages", state="used") == 0:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("policy", WIRED)
def test_budget_above_the_length_equals_full(llama_server, policy):
    # A fresh prompt per policy, compressed run first: its whole prompt is
    # private (in the region), then `full` on the same prompt.
    prompt = [7 + WIRED.index(policy), 300, 12, 44, 150, 23, 9, 81, 200, 5, 61, 17]
    compressed = complete(llama_server, prompt, {"name": policy, "budget": 256, "compress_prompt": True})
    full = complete(llama_server, prompt, "full")
    assert compressed["choices"][0]["token_ids"] == full["choices"][0]["token_ids"]
    kv = compressed["kv_usage"]
    assert kv["policy"] == policy and kv["evicted_tokens"] == 0
    assert kv["retained_tokens"] == kv["private_tokens"] == len(prompt) + GEN


#: Params that make each policy cut back to its budget after every step
#: (streaming's default cadence cuts every 16th: test_streaming_cuts_back_every_buffer_steps).
EVERY_STEP = {"streaming": {"buffer": 1}, "h2o": {}, "longflow": {}}


@pytest.mark.parametrize("policy", ["streaming", "h2o", "longflow"])
def test_small_budget_holds_the_budget(llama_server, policy):
    prompt = [90 + WIRED.index(policy), 31, 32, 33, 34]
    out = complete(llama_server, prompt, {"name": policy, "budget": 8, "compress_prompt": True,
                                          "params": EVERY_STEP[policy]}, max_tokens=40)
    kv = out["kv_usage"]
    assert kv["retained_tokens"] == 8
    assert kv["evicted_tokens"] == len(prompt) + 40 - 8
    assert kv["eviction_events"] > 0
    assert metric(llama_server, "kvsieve_evicted_tokens_total", policy=policy) >= kv["evicted_tokens"]


@pytest.mark.parametrize("buffer", [None, 3, 5])
def test_streaming_cuts_back_every_buffer_steps(llama_server, buffer):
    # 40 decode steps (0-39), a cut at steps buffer-1, 2*buffer-1, ...: the
    # region ends with the budget plus the steps after the last cut (default 16).
    prompt = [120 + (buffer or 0), 31, 32, 33, 34]
    policy = {"name": "streaming", "budget": 8, "compress_prompt": True}
    if buffer:
        policy["params"] = {"buffer": buffer}
    kv = complete(llama_server, prompt, policy, max_tokens=40)["kv_usage"]
    assert kv["retained_tokens"] == 8 + 40 % (buffer or 16)
    assert kv["evicted_tokens"] == len(prompt) + 40 - kv["retained_tokens"]
    assert kv["eviction_events"] > 0


@pytest.mark.parametrize("policy", ["streaming", "h2o", "longflow"])
def test_a_kept_prompt_is_whole_and_generated_tokens_hold_the_budget(llama_server, policy):
    prompt = [70 + WIRED.index(policy), 31, 32, 33, 34, 35]
    out = complete(llama_server, prompt, {"name": policy, "budget": 8, "compress_prompt": False,
                                          "params": EVERY_STEP[policy]}, max_tokens=40)
    kv = out["kv_usage"]
    assert kv["retained_tokens"] == len(prompt) + 8  # the prompt in the radix cache, 8 generated in the region
    assert kv["evicted_tokens"] == 40 - 8


def test_compressed_requests_share_a_kept_system_prompt(llama_server):
    # Two decode-phase requests (compress_prompt off by default) with one long
    # system prompt: the first inserts it into the radix tree, the second reads it.
    system = list(range(300, 364))
    first = complete(llama_server, system + [1, 2], {"name": "h2o", "budget": 8})
    second = complete(llama_server, system + [3, 4], {"name": "streaming", "budget": 8})
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(system)
    assert second["kv_usage"]["prefix_cache_hit_tokens"] >= len(system)
    # With the prompt compressed, nothing is shared.
    third = complete(llama_server, list(range(200, 264)) + [1], {"name": "h2o", "budget": 8, "compress_prompt": True})
    fourth = complete(llama_server, list(range(200, 264)) + [2], {"name": "h2o", "budget": 8})
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert fourth["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_snapkv_selects_at_prefill_only(llama_server):
    prompt = list(range(100, 160))  # 60 private prompt tokens
    kv = complete(llama_server, prompt, {"name": "snapkv", "budget": 8, "params": {"window": 4}})["kv_usage"]
    assert kv["retained_tokens"] == 8 + 4 + GEN  # top budget + window, then every decode token


def test_full_in_a_mixed_batch_equals_its_solo_run(llama_server):
    prompt = [3, 141, 59, 26, 53, 58, 97]
    solo = complete(llama_server, prompt, "full", max_tokens=32)["choices"][0]["token_ids"]

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(policy, ids):
                body = {"prompt": ids, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                        "return_token_ids": True, "kv_policy": policy}
                r = await client.post(f"{llama_server.url}/v1/completions", json=body)
                r.raise_for_status()
                return r.json()["choices"][0]["token_ids"]
            return await asyncio.gather(
                one("full", prompt),
                *(one({"name": p, "budget": 6}, [i + 1, 2, 3, 4, 5, 6, 7, 8]) for i, p in enumerate(WIRED)))

    results = asyncio.run(run())
    assert results[0] == solo


def test_every_region_page_returns_after_200_mixed_requests(llama_server):
    # Full and compressed requests of every wired policy, streamed and not,
    # client disconnects mid-stream, and invalid requests rejected mid-batch.
    # (SGLang's own idle check guards its token pool too: a leak there stops
    # the scheduler, and the requests after it would fail.)
    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(i):
                policy = {"name": WIRED[i % 4], "budget": 4 + i % 5} if i % 5 else "full"
                body = {"prompt": [i % 50 + 1, 7, 8, 9], "max_tokens": 3 + i % 6, "ignore_eos": True,
                        "kv_policy": policy, "stream": i % 3 == 0}
                if i % 17 == 0:
                    body["kv_policy"] = {"name": "h2o", "budget": 0}
                    r = await client.post(f"{llama_server.url}/v1/completions", json=body)
                    return r.status_code
                if i % 10 == 3:  # disconnect mid-stream
                    body.update(stream=True, max_tokens=400)
                    async with client.stream("POST", f"{llama_server.url}/v1/completions", json=body) as r:
                        async for _ in asse_lines(r):
                            break
                    return "gone"
                r = await client.post(f"{llama_server.url}/v1/completions", json=body)
                return r.status_code
            results = []
            for start in range(0, 200, 20):
                results += await asyncio.gather(*(one(i) for i in range(start, start + 20)))
            return results

    results = asyncio.run(run())
    rejected = [i for i in range(200) if i % 17 == 0]
    gone = [i for i in range(200) if i % 10 == 3 and i % 17]
    assert [i for i, r in enumerate(results) if r == 400] == rejected
    assert [i for i, r in enumerate(results) if r == "gone"] == gone
    assert results.count(200) == 200 - len(rejected) - len(gone)
    assert region_idle(llama_server)
    assert metric(llama_server, "kvsieve_region_pages", state="free") > 0
    assert metric(llama_server, "kvsieve_region_reserved_pages") == 0
    assert metric(llama_server, "kvsieve_retained_kv_tokens") == 0
    # SGLang's allocator after the last release: every slot is free or held
    # only by the radix tree (evictable); no request holds one.
    assert metric(llama_server, "kvsieve_token_pool_tokens", state="in_use") == 0
    assert metric(llama_server, "kvsieve_token_pool_tokens", state="free") > 0


def test_compressed_tokens_never_enter_the_radix_tree(llama_server):
    prompt = [340, 341, 342, 343, 344, 345, 346, 347, 348, 349, 350, 351]
    complete(llama_server, prompt, {"name": "h2o", "budget": 256, "compress_prompt": True})
    after_compressed = complete(llama_server, prompt, "full")
    assert after_compressed["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    after_full = complete(llama_server, prompt, "full")
    assert after_full["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_compressed_request_reuses_the_shared_prefix(llama_server):
    prompt = [360, 361, 362, 363, 364, 365, 366, 367, 368, 369]
    full = complete(llama_server, prompt, "full")
    compressed = complete(llama_server, prompt, {"name": "streaming", "budget": 256})
    kv = compressed["kv_usage"]
    assert kv["prefix_cache_hit_tokens"] > 0
    assert kv["private_tokens"] == len(prompt) - kv["prefix_cache_hit_tokens"] + GEN
    assert compressed["choices"][0]["token_ids"] == full["choices"][0]["token_ids"]
