"""Issue #30 through `kvsieve serve` (tiny Llama on CPU): the built-in
`<policy>-paper` presets listed and served by name, the papers' per-request
knobs with their bounds (a 400 naming the field), and TBQ's precision served
as asked or refused, never stored lower (KVSIEVE_TBQ_BITS)."""

import httpx
import pytest

from conftest import start_server
from kvsieve.service.presets import BUILTIN_PRESETS
from test_compressed import complete

PROMPT = [7 + (i * 37) % 400 for i in range(120)]  # the tiny vocabulary has 410 ids
ALL_R = [0.0, 1.0]  # thinkv thresholds that type every segment R (a step's sparsity is below 1)


def post(server, policy, prompt=PROMPT, max_tokens=8):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "kv_policy": policy}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)


def test_kv_policies_lists_the_builtin_presets_with_their_sources(llama_server):
    body = httpx.get(f"{llama_server.url}/v1/kv_policies", timeout=30).json()
    assert set(body["builtin_presets"]) == set(BUILTIN_PRESETS)  # every policy is served on CPU
    assert body["presets"] == {"lossless": {"name": "full"}}  # the user's stay apart
    crystal = body["builtin_presets"]["crystal_kv-paper"]
    assert crystal["kv_policy"]["params"]["answer_tokens"] is None
    assert crystal["sources"]["params.adaptive"].startswith("§5.3")
    by_name = {p["id"]: p["params"]["properties"] for p in body["data"]}
    assert by_name["crystal_kv"]["decay"]["minimum"] == 0 and by_name["crystal_kv"]["decay"]["maximum"] == 1
    assert {"type": "null"} in by_name["crystal_kv"]["answer_tokens"]["anyOf"]
    thresholds = by_name["thinkv"]["thresholds"]["anyOf"][0]
    assert thresholds["prefixItems"][0] == {"maximum": 1.0, "minimum": 0.0, "type": "number"}
    assert by_name["thinkv"]["layers"]["anyOf"][0]["items"]["maximum"] == 4095
    assert by_name["longflow"]["window"]["maximum"] == 4096 and by_name["longflow"]["kernel"]["maximum"] == 63
    schema = httpx.get(f"{llama_server.url}/openapi.json", timeout=30).json()["components"]["schemas"]
    assert schema["KVPolicyParams_thinkv"]["properties"]["thresholds"]["anyOf"][0]["minItems"] == 2


@pytest.mark.parametrize("name", sorted(BUILTIN_PRESETS))
def test_each_builtin_preset_serves_by_name(llama_server, name):
    out = complete(llama_server, PROMPT, name, max_tokens=24)
    kv = out["kv_usage"]
    assert kv["preset"] == name and kv["policy"] == BUILTIN_PRESETS[name].kv_policy["name"]
    assert len(out["choices"][0]["token_ids"]) == 24


def test_crystalcache_paper_budgets_are_the_fraction_of_the_prompt(llama_server):
    prompt = [9 + (i * 53) % 400 for i in range(400)]
    b30 = complete(llama_server, prompt, "crystalcache-paper-b30", max_tokens=4)["kv_usage"]
    b50 = complete(llama_server, prompt, "crystalcache-paper-b50", max_tokens=4)["kv_usage"]
    # B = max(132, ceil(beta * n)) of the private prompt, cut at its end; decode
    # off (the paper's dormant breath cycles): nothing is evicted afterwards.
    assert b30["evicted_tokens"] >= b50["evicted_tokens"] > 0
    assert b30["retained_tokens"] <= b50["retained_tokens"] < 400


@pytest.mark.parametrize("policy, field", [
    ({"name": "crystal_kv", "params": {"decay": 1.5}}, "kv_policy.params.decay"),
    ({"name": "crystal_kv", "params": {"decay": -0.5}}, "kv_policy.params.decay"),
    ({"name": "crystal_kv", "params": {"answer_tokens": -1}}, "kv_policy.params.answer_tokens"),
    ({"preset": "crystal_kv-paper", "params": {"decay": 2}}, "kv_policy.params.decay"),
    ({"name": "thinkv", "params": {"thresholds": [0.9, 0.1]}}, "kv_policy.params.thresholds"),
    ({"name": "thinkv", "params": {"thresholds": [0.1, 1.2]}}, "kv_policy.params.thresholds.1"),
    ({"name": "thinkv", "params": {"layers": [-1]}}, "kv_policy.params.layers.0"),
    ({"name": "thinkv", "params": {"layers": [2]}}, "kv_policy.params.layers"),  # the model has 2 layers
    ({"name": "longflow", "params": {"window": 0}}, "kv_policy.params.window"),
    ({"name": "longflow", "params": {"kernel": 8}}, "kv_policy.params.kernel"),
    ({"name": "longflow", "params": {"kernel": 65}}, "kv_policy.params.kernel"),
])
def test_out_of_bounds_knobs_are_a_400_naming_the_field(llama_server, policy, field):
    r = post(llama_server, policy)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error", error


def test_r8e4t2_on_a_4_bit_server_is_a_400_naming_the_field_and_the_setting(llama_server):
    r = post(llama_server, {"name": "thinkv", "params": {"tbq_precision": "R8E4T2"}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "kv_policy.params.tbq_precision" and "KVSIEVE_TBQ_BITS=8" in error["message"]


def test_thinkv_overrides_type_the_segments_and_kv_usage_says_what_each_type_got(llama_server):
    policy = {"name": "thinkv", "budget": 48, "params": {"thresholds": ALL_R, "layers": [1], "refresh": 16}}
    kv = complete(llama_server, PROMPT, policy, max_tokens=64)["kv_usage"]
    assert kv["thought_typing"] == {"layers": [1], "thresholds": ALL_R, "source": "override",
                                    "overrides": ["layers", "thresholds"]}
    assert kv["tbq"] is True
    assert kv["tbq_precision"] == {"reasoning": "nvfp4", "execution": "full", "transition": "full"}
    assert kv["tbq_groups"]["reasoning"] >= 3 and kv["tbq_groups"]["transition"] == 0


def test_crystal_kv_lru_lfu_ratio_and_no_eviction_after_the_marker_serve(llama_server):
    base = {"think_end": "", "evict_interval": 1}
    for params in ({"decay": 0}, {"decay": 1}):
        kv = complete(llama_server, PROMPT, {"name": "crystal_kv", "budget": 8, "params": base | params},
                      max_tokens=32)["kv_usage"]
        assert kv["evicted_tokens"] == 32 - 8
    # Adaptive budgets with a budget_ratio: every reallocation shares the ratio's budget of its step.
    ratio = {"name": "crystal_kv", "budget_ratio": 0.25,
             "params": base | {"adaptive": True, "realloc_interval": 8, "min_head_budget": 4}}
    out = complete(llama_server, PROMPT, ratio, max_tokens=64)
    assert out["choices"][0]["finish_reason"] == "length" and out["kv_usage"]["evicted_tokens"] > 0
    # answer_tokens null with a marker the model never writes: thinking throughout, evicting to the budget.
    never = {"name": "crystal_kv", "budget": 8, "params": {"answer_tokens": None, "evict_interval": 1}}
    assert complete(llama_server, PROMPT, never, max_tokens=24)["kv_usage"]["evicted_tokens"] == 24 - 8


def test_longflow_prefill_window_and_kernel_serve(llama_server):
    prompt = [401, 402, *PROMPT]  # a prompt of its own: all of it private, cut to the budget at its end
    kv = complete(llama_server, prompt, {"name": "longflow", "budget": 24, "params": {"window": 4, "kernel": 3}},
                  max_tokens=8)["kv_usage"]
    # The shared server's radix cache may hold another test's prompt that
    # begins alike: only the private part (still longer than the budget) is cut.
    private = len(prompt) - kv["prefix_cache_hit_tokens"]
    assert private > 24
    assert kv["retained_tokens"] == 24 and kv["evicted_tokens"] == private + 8 - 24


@pytest.fixture(scope="module")
def tbq8_server(tiny_llama, tmp_path_factory):
    """Tiny Llama whose quantized pages hold 8-bit rows."""
    server = start_server(tmp_path_factory.mktemp("tbq8"), "--model", str(tiny_llama),
                          env={"KVSIEVE_TBQ_BITS": "8"})
    yield server
    assert server.stop() == 0, server.log()


def test_r8e4t2_is_served_as_asked_with_8_bit_rows(tbq8_server):
    def run(precision):
        policy = {"name": "thinkv", "budget": 48, "params": {"thresholds": ALL_R, "tbq_precision": precision}}
        return complete(tbq8_server, PROMPT, policy, max_tokens=64)["kv_usage"]

    r8, r4 = run("R8E4T2"), run("R4E4T2")
    assert r8["tbq"] and r4["tbq"]
    assert r8["tbq_precision"]["reasoning"] == "fp8" and r4["tbq_precision"]["reasoning"] == "nvfp4"
    assert r8["tbq_groups"]["reasoning"] >= 3
    # FP8 codes take a byte an element, NVFP4 half a byte (plus scales).
    assert r8["kv_bits_per_element"] > r4["kv_bits_per_element"] + 2
