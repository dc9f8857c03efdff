"""rkv and skipkv end to end: a real `kvsieve serve` (tiny Llama on CPU, the
session server), requests through the OpenAI API."""

import asyncio

import httpx
import pytest

from test_compressed import complete

POLICIES = ["rkv", "skipkv"]


@pytest.mark.parametrize("policy", POLICIES)
def test_budget_above_the_length_equals_full(llama_server, policy):
    # 12 prompt + 24 generated tokens under a budget of 256: nothing evicted,
    # greedy output token for token that of `full`.
    prompt = [21 + POLICIES.index(policy), 301, 12, 44, 150, 23, 9, 81, 200, 5, 61, 17]
    out = complete(llama_server, prompt, {"name": policy, "budget": 256, "compress_prompt": True})
    full = complete(llama_server, prompt, "full")
    assert out["choices"][0]["token_ids"] == full["choices"][0]["token_ids"]
    kv = out["kv_usage"]
    assert kv["policy"] == policy and kv["evicted_tokens"] == 0
    # (a prompt token may already sit in the radix cache from an earlier test: shared, not private)
    assert kv["retained_tokens"] == kv["private_tokens"] == len(prompt) - kv["prefix_cache_hit_tokens"] + 24


@pytest.mark.parametrize("policy", POLICIES)
def test_small_budget_holds_the_budget(llama_server, policy):
    # A 12-token prompt in the region is cut to the budget, 8, at its end
    # (buffer 1: a decision every step): then a head evicts whenever it
    # holds 9, so it ends with 8 (skipkv may end below: it drops redundant
    # sentences whole). Admission reserved budget + 1 slots per head: one
    # more would fail the request.
    prompt = [110 + POLICIES.index(policy), 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]
    out = complete(llama_server, prompt, {"name": policy, "budget": 8, "compress_prompt": True,
                                          "params": {"buffer": 1}}, max_tokens=40)
    kv = out["kv_usage"]
    if policy == "rkv":
        assert kv["retained_tokens"] == 8
    assert 1 <= kv["retained_tokens"] <= 8
    assert kv["evicted_tokens"] == len(prompt) - kv["prefix_cache_hit_tokens"] + 40 - kv["retained_tokens"]
    assert kv["eviction_events"] > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_default_buffer_decides_every_16_steps(llama_server, policy):
    # The default buffer, 16: decisions at decode steps 15 and 31 of 40 cut
    # each head back to the budget, 8; the 8 tokens after step 31 stay. The
    # request never held more than budget + 16 (its admission ceiling).
    prompt = [130 + POLICIES.index(policy), 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]
    out = complete(llama_server, prompt, {"name": policy, "budget": 8, "compress_prompt": True}, max_tokens=40)
    kv = out["kv_usage"]
    if policy == "rkv":
        assert kv["retained_tokens"] == 8 + 40 % 16
    assert 1 <= kv["retained_tokens"] <= 8 + 40 % 16
    assert kv["evicted_tokens"] == len(prompt) - kv["prefix_cache_hit_tokens"] + 40 - kv["retained_tokens"]


def test_skipkv_keeps_its_budget_in_a_ragged_batch(llama_server):
    # SGLang batches are ragged (no padding), and each row's slots are its
    # own: a request keeps its whole budget, and so its greedy output, in a
    # batch of requests of other lengths and policies.
    prompt = [77, 301, 12, 44, 150, 23, 9]
    policy = {"name": "skipkv", "budget": 6, "params": {"refresh": 1}}
    alone = complete(llama_server, prompt, policy, max_tokens=32)

    async def batch():
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(kv_policy, ids):
                body = {"prompt": ids, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                        "return_token_ids": True, "kv_policy": kv_policy}
                r = await client.post(f"{llama_server.url}/v1/completions", json=body)
                r.raise_for_status()
                return r.json()
            others = [one({"name": "skipkv", "budget": 5 + i}, list(range(40 + i, 60 + 9 * i))) for i in range(3)]
            others.append(one({"name": "rkv", "budget": 7}, [5, 6, 7]))
            others.append(one("full", list(range(200, 231))))
            return await asyncio.gather(one(policy, prompt), *others)

    together = asyncio.run(batch())[0]
    assert together["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    assert together["kv_usage"]["evicted_tokens"] == alone["kv_usage"]["evicted_tokens"] > 0


@pytest.mark.parametrize("policy, params, field", [
    ("rkv", {"kernel": 4}, "kv_policy.params.kernel"),
    ("skipkv", {"tau": 2.0}, "kv_policy.params.tau"),
])
def test_bad_params_are_a_400_naming_the_field(llama_server, policy, params, field):
    body = {"prompt": [1, 2], "max_tokens": 2, "kv_policy": {"name": policy, "params": params}}
    r = httpx.post(f"{llama_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and field in r.text


def sentence_ends(model_dir, token_ids):
    """Indexes of the generated tokens that end a sentence: their text is made
    of ".", "?", "!" only, or holds a newline."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ends = []
    for i, t in enumerate(token_ids):
        text = tok.decode([t])
        if "\n" in text or (text.strip() and set(text.strip()) <= set(".?!")):
            ends.append(i)
    return ends


def test_skipkv_drops_a_redundant_generated_sentence_whole(llama_server, tiny_llama):
    # The tiny model's greedy output for this prompt has two sentences early
    # on (found from `full`'s output, d1 < d2 their last tokens). With tau -1
    # every finished sentence but the last is redundant. Refresh 1 reads S2's
    # end at decode step d2 + 1; the redundant spans reach the decision two
    # steps later (the read-backs wait for no GPU: policies/host_reads.py).
    # Budget d2 + 3: the head first goes over at decode step d2 + 3 (tokens
    # 0..d2+3 held), when the spans are there, so nothing was evicted
    # before and S1 = tokens 0..d1 is then dropped whole: d1 + 1 tokens, far
    # more than the one token the budget asked for. rkv at the same budget
    # evicts one token per step from there (buffer 1: both decide every step).
    prompt = [27, 301, 12, 44]
    full = complete(llama_server, prompt, "full", max_tokens=48)["choices"][0]["token_ids"]
    ends = sentence_ends(tiny_llama, full)
    assert len(ends) >= 2 and ends[1] - ends[0] > 8 and ends[0] >= 2, ends  # S1 outside the protected window of 8
    d1, d2 = ends[:2]
    M = d2 + 5
    policy = {"name": "skipkv", "budget": d2 + 3, "params": {"tau": -1.0, "refresh": 1, "buffer": 1}}
    out = complete(llama_server, prompt, policy, max_tokens=M)
    assert out["choices"][0]["token_ids"][:d2 + 4] == full[:d2 + 4]  # identical until the first eviction
    kv = out["kv_usage"]
    assert kv["evicted_tokens"] == d1 + 1 and kv["eviction_events"] > 0
    rkv = complete(llama_server, prompt, {"name": "rkv", "budget": d2 + 3, "params": {"buffer": 1}},
                   max_tokens=M)["kv_usage"]
    assert rkv["evicted_tokens"] < d1 + 1
