"""crystalcache end to end: a real `kvsieve serve` (tiny Llama on CPU: 2
layers, 2 kv heads, 4 query heads; the session server), requests through the
OpenAI API. Prompts start with ids >= 400 that no other test uses, so no
earlier request's radix-cached prefix is shared with them; the counts still
read the shared part from kv_usage."""

import httpx
import pytest
from transformers import AutoTokenizer

from kvsieve.policies import get_policy
from kvsieve.policies.crystalcache.policy import CrystalCacheParams
from test_compressed import complete, region_idle

LAYERS = 2  # the tiny Llama's


def ceiling(params: dict, private_prompt: int, max_new: int, budget: int) -> int:
    """The policy's admission ceiling for this request (tokens per layer and head)."""
    policy = get_policy("crystalcache")()
    return policy.max_private_tokens(CrystalCacheParams(**params), private_prompt, max_new, budget)


def test_budget_above_the_length_equals_full(llama_server):
    # 16 prompt + 80 generated tokens under the default budget (1024): one
    # breath cycle runs (at step 64) and keeps everything; greedy output
    # token for token that of `full`.
    # (a prompt whose greedy run has no near-tie between the two attention paths: 401 has one at token 66)
    prompt = [405, 33, 12, 44, 150, 23, 9, 81, 200, 5, 61, 17, 90, 91, 92, 93]
    out = complete(llama_server, prompt, "crystalcache", max_tokens=80)
    full = complete(llama_server, prompt, "full", max_tokens=80)
    assert out["choices"][0]["token_ids"] == full["choices"][0]["token_ids"]
    kv = out["kv_usage"]
    assert kv["policy"] == "crystalcache" and kv["evicted_tokens"] == 0 and kv["eviction_events"] == 0
    assert kv["retained_tokens"] == kv["private_tokens"] == len(prompt) - kv["prefix_cache_hit_tokens"] + 80


def test_small_budget_holds_its_ceiling_over_two_breath_cycles(llama_server):
    # Budget 66 (the floor with sinks 4, recent 8), 24 prompt tokens, 140
    # generated: breath cycles (snapshots at decode steps 63 and 127, keep
    # tables at 65 and 129) each cut the request back to 66 (+ the two
    # tokens after the snapshot), and nothing else evicts, so every layer
    # evicts exactly twice.
    params = {"sinks": 4, "recent": 8}
    prompt = [402] + [30 + (7 * i) % 60 for i in range(23)]
    out = complete(llama_server, prompt, {"name": "crystalcache", "budget": 66, "params": params}, max_tokens=140)
    kv = out["kv_usage"]
    private = kv["private_tokens"]
    assert private == len(prompt) - kv["prefix_cache_hit_tokens"] + 140
    bound = ceiling(params, private - 140, 140, 66)
    assert bound == 66 + 64 + 2
    assert kv["retained_tokens"] <= bound
    # after the cut at step 129: at most 66 + 2, then the tokens of steps 130..139
    # (a request stores one token per generated token: steps 0..139)
    assert kv["retained_tokens"] <= 66 + 2 + 10
    assert kv["evicted_tokens"] == private - kv["retained_tokens"] > 0
    assert kv["eviction_events"] == 2 * LAYERS


def test_a_long_prompt_is_cut_at_prefill_and_the_ceiling_holds(llama_server, tiny_llama):
    # 300 private prompt tokens with sentence delimiters, budget_ratio 0.1:
    # B = max(4 + 128, 30) = 132; the prefill selection keeps the protected
    # trunks (first 4 / last 128 tokens, up to 31 past each) and cuts the
    # rest; one breath cycle (keep table at step 65) cuts back to 132.
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    dot, newline = tok.convert_tokens_to_ids("."), tok.convert_tokens_to_ids("Ċ")
    prompt = [403] + [dot if i % 11 == 10 else newline if i % 29 == 28 else 20 + (13 * i) % 300
                      for i in range(299)]
    out = complete(llama_server, prompt, {"name": "crystalcache", "budget_ratio": 0.1}, max_tokens=70)
    kv = out["kv_usage"]
    private_prompt = len(prompt) - kv["prefix_cache_hit_tokens"]
    assert kv["private_tokens"] == private_prompt + 70
    final_budget = max(16, -(-(private_prompt + 70) // 10))
    bound = ceiling({}, private_prompt, 70, final_budget)
    assert bound < private_prompt + 70
    assert kv["retained_tokens"] <= bound
    # step 65 cut to B = 132 (+2), then steps 66..69
    assert kv["retained_tokens"] <= 132 + 2 + 4
    assert kv["evicted_tokens"] == kv["private_tokens"] - kv["retained_tokens"] > 0
    # the prefill cut (every layer) and the breath cycle's (every layer)
    assert kv["eviction_events"] == 2 * LAYERS


def test_a_kept_prompt_and_generated_trunks(llama_server):
    # compress_prompt off: the prompt stays in the radix cache, only generated
    # tokens (their trunks) are judged at the breath cycles.
    prompt = [404, 31, 32, 33, 34, 35]
    out = complete(llama_server, prompt, {"name": "crystalcache", "budget": 66, "compress_prompt": False,
                                          "params": {"sinks": 4, "recent": 8}}, max_tokens=140)
    kv = out["kv_usage"]
    generated_retained = kv["retained_tokens"] - (len(prompt) - kv["prefix_cache_hit_tokens"])
    assert generated_retained <= 66 + 2 + 10
    assert kv["evicted_tokens"] == 140 - generated_retained > 0


def test_chunked_prefill_probes_the_whole_prompt(llama_server, chunked_server):
    # 16-token prefill chunks (the session's chunked server, whose clean exit
    # is checked at the session's end): the first layer's probe spans 19
    # extends (one CrystalCache chunk split across all of them) and selects
    # as many prompt tokens as the unchunked server does (the first layer's
    # q and k do not depend on the chunking); 8 generated tokens, no breath cycle.
    prompt = [406] + [20 + (11 * i) % 300 for i in range(299)]
    policy = {"name": "crystalcache", "budget": 140}
    whole = complete(llama_server, prompt, policy, max_tokens=8)["kv_usage"]
    chunked = complete(chunked_server, prompt, policy, max_tokens=8)["kv_usage"]
    assert region_idle(chunked_server)
    assert whole["prefix_cache_hit_tokens"] == chunked["prefix_cache_hit_tokens"] == 0
    assert chunked["retained_tokens"] == whole["retained_tokens"] < len(prompt)
    assert chunked["evicted_tokens"] == whole["evicted_tokens"] == len(prompt) + 8 - whole["retained_tokens"]


def test_every_region_page_is_free_after(llama_server):
    assert region_idle(llama_server)


@pytest.mark.parametrize("kv_policy,field", [
    ({"name": "crystalcache", "budget": 100}, "kv_policy.budget"),  # below sinks + recent = 132
    ({"name": "crystalcache", "budget": 70, "params": {"sinks": 4, "recent": 8, "breath": 0}},
     "kv_policy.params.breath"),
    ({"name": "crystalcache", "params": {"recent": -1}}, "kv_policy.params.recent"),
    ({"name": "crystalcache", "params": {"sinks": True}}, "kv_policy.params.sinks"),
    ({"name": "crystalcache", "params": {"chunk": 512}}, "kv_policy.params.chunk"),
])
def test_bad_params_are_a_400_naming_the_field(llama_server, kv_policy, field):
    body = {"prompt": [1, 2], "max_tokens": 2, "kv_policy": kv_policy}
    r = httpx.post(f"{llama_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and field in r.text, r.text


def test_listed_in_the_catalog(llama_server):
    entries = {e["id"]: e for e in httpx.get(f"{llama_server.url}/v1/kv_policies", timeout=30).json()["data"]}
    entry = entries["crystalcache"]
    assert entry["description"] and entry["compress_prompt_default"] is True
    assert set(entry["params"]["properties"]) == {"sinks", "recent", "breath", "decode", "t_max", "tau_merge", "alpha"}
