"""rkv and skipkv with `scoring: "paper"` end to end: a real `kvsieve serve`
(tiny Llama on CPU, the session server), requests through the OpenAI API.
The engine keeps the paper rows' decode queries (radix_ext/query_ring.py)
and their decisions read them; "fast" rows beside them are unchanged."""

import httpx
import pytest

from test_compressed import complete, complete_together

POLICIES = ["rkv", "skipkv"]


@pytest.mark.parametrize("policy", POLICIES)
def test_paper_with_a_budget_above_the_length_equals_full(llama_server, policy):
    prompt = [41 + POLICIES.index(policy), 301, 12, 44, 150, 23, 9, 81, 200, 5, 61, 17]
    out = complete(llama_server, prompt, {"name": policy, "budget": 256, "compress_prompt": True,
                                          "params": {"scoring": "paper"}})
    full = complete(llama_server, prompt, "full")
    assert out["choices"][0]["token_ids"] == full["choices"][0]["token_ids"]
    assert out["kv_usage"]["evicted_tokens"] == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_paper_holds_the_budget(llama_server, policy):
    # Budget 8, window 4, a decision every step (buffer 1). The 12-token
    # prompt in the region is cut to 8 at its end (no decode query yet: the
    # prompt window's mean attention and the paper's redundancy), then a head
    # holds 8 after each step (skipkv may drop a redundant sentence whole).
    prompt = [150 + POLICIES.index(policy), 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]
    out = complete(llama_server, prompt, {"name": policy, "budget": 8, "compress_prompt": True,
                                          "params": {"scoring": "paper", "window": 4, "buffer": 1}}, max_tokens=40)
    kv = out["kv_usage"]
    if policy == "rkv":
        assert kv["retained_tokens"] == 8
    assert 1 <= kv["retained_tokens"] <= 8
    assert kv["evicted_tokens"] == len(prompt) - kv["prefix_cache_hit_tokens"] + 40 - kv["retained_tokens"]
    assert kv["eviction_events"] > 0


def test_fast_is_unchanged_beside_paper_rows(llama_server):
    # A "fast" request's output and evictions are the same alone and in a
    # batch with "paper" rows of both policies (the engine then keeps every
    # row's queries, and rkv's group computes both scorings).
    prompt = [88, 301, 12, 44, 150, 23]
    fast = {"name": "rkv", "budget": 6, "params": {"window": 2, "buffer": 1}}
    paper = {"name": "rkv", "budget": 6, "params": {"window": 2, "buffer": 1, "scoring": "paper"}}
    alone = complete(llama_server, prompt, fast, max_tokens=48)
    together = complete_together(llama_server, [
        (prompt, fast),
        (prompt, paper),
        ([90, 5, 6, 7, 8], {"name": "skipkv", "budget": 5, "params": {"scoring": "paper", "window": 2}}),
        (list(range(200, 220)), "full"),
    ], max_tokens=48)
    assert together[0]["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    assert together[0]["kv_usage"]["evicted_tokens"] == alone["kv_usage"]["evicted_tokens"] > 0
    assert together[1]["kv_usage"]["evicted_tokens"] > 0


def test_paper_window_above_the_ring_is_a_400_naming_scoring(llama_server):
    body = {"prompt": [1, 2], "max_tokens": 2,
            "kv_policy": {"name": "rkv", "params": {"scoring": "paper", "window": 32}}}
    r = httpx.post(f"{llama_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and "kv_policy.params.scoring" in r.text
