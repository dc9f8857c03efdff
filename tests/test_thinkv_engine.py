"""thinkv end to end: a real `kvsieve serve` (tiny Llama on CPU, the session
server), no calibration artifact for the model, so the fallback runs and is
reported."""

from test_compressed import complete, metric


def test_budget_above_the_length_equals_full(llama_server):
    # 12 prompt + 24 generated tokens under a budget of 256, no refresh
    # boundary (128) reached: nothing is cut.
    prompt = [13, 301, 12, 44, 150, 23, 9, 81, 200, 5, 61, 17]
    out = complete(llama_server, prompt, {"name": "thinkv", "budget": 256, "compress_prompt": True})
    full = complete(llama_server, prompt, "full")
    assert out["choices"][0]["token_ids"] == full["choices"][0]["token_ids"]
    kv = out["kv_usage"]
    assert kv["policy"] == "thinkv" and kv["evicted_tokens"] == 0
    assert kv["retained_tokens"] == len(prompt) + 24


def test_small_budget_holds_the_budget_and_reports_the_fallback(llama_server):
    # Budget 15, segments of 4 steps, schedule (2, 1). The 20-token prompt is
    # cut at its end (chunks of 4, oldest annealed first) to 15; then each
    # step past 15 held tokens anneals a segment. Admission reserves
    # budget + 1 = 16 slots per head after the prefill: exactly one 16-slot
    # page, so a head holding more than 15 after any step would overflow on
    # the next store and fail the request (503).
    prompt = [14, *range(31, 50)]
    policy = {"name": "thinkv", "budget": 15, "compress_prompt": True,
              "params": {"refresh": 4, "retention": [2, 1], "kmeans_iters": 2}}
    out = complete(llama_server, prompt, policy, max_tokens=40)
    kv = out["kv_usage"]
    assert 1 <= kv["retained_tokens"] <= 15
    assert kv["evicted_tokens"] == len(prompt) + 40 - kv["retained_tokens"]
    assert kv["eviction_events"] > 0
    # The tiny model has no artifact in the server's store: the fallback ran,
    # counted per request and logged.
    assert metric(llama_server, "kvsieve_policy_fallback_total", policy="thinkv") >= 1
    assert "thinkv: no calibration for model" in llama_server.log()


def test_bad_params_are_a_400_naming_the_field(llama_server):
    import httpx

    body = {"prompt": [1, 2], "max_tokens": 2, "kv_policy": {"name": "thinkv", "params": {"retention": [4, 8]}}}
    r = httpx.post(f"{llama_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and "kv_policy.params.retention" in r.text
