"""thinkv end to end: real `kvsieve serve` processes (tiny Llama on CPU, the
session servers). The plain server's store has no artifact for the model, so
the fallback runs and is reported; the guarded server's Redis store gets one."""

import json

import httpx

from conftest import kvsieve_cli
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
    # (a prompt token may already sit in the radix cache from an earlier test: shared, not private)
    assert kv["retained_tokens"] == kv["private_tokens"] == len(prompt) - kv["prefix_cache_hit_tokens"] + 24


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
    assert kv["evicted_tokens"] == len(prompt) - kv["prefix_cache_hit_tokens"] + 40 - kv["retained_tokens"]
    assert kv["eviction_events"] > 0
    # The tiny model has no artifact in the server's store: the fallback ran,
    # counted per request and logged.
    assert metric(llama_server, "kvsieve_policy_fallback_total", policy="thinkv") >= 1
    assert "thinkv: no calibration for model" in llama_server.log()


def test_bad_params_are_a_400_naming_the_field(llama_server):
    body = {"prompt": [1, 2], "max_tokens": 2, "kv_policy": {"name": "thinkv", "params": {"retention": [4, 8]}}}
    r = httpx.post(f"{llama_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and "kv_policy.params.retention" in r.text


def test_a_calibrated_model_runs_with_its_artifact(guarded_server, tmp_path):
    # The guarded server keeps its store in Redis; its scheduler process reads
    # the same settings (environment, YAML file) when thinkv first runs there,
    # and finds the artifact under the served name, the checkpoint's directory.
    artifact = tmp_path / "thinkv.json"
    artifact.write_text(json.dumps({"model": "tiny-llama", "layers": [1], "thresholds": [0.3, 0.7]}))
    put = kvsieve_cli("artifacts", "put", "thinkv", "tiny-llama", str(artifact), env=guarded_server.env)
    assert put.returncode == 0, put.stderr
    body = {"prompt": [15, 31, 32, 33], "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "kv_policy": {"name": "thinkv", "budget": 15, "params": {"refresh": 4, "retention": [2, 1]}}}
    r = httpx.post(f"{guarded_server.url}/v1/completions", json=body, headers=guarded_server.headers(), timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["kv_usage"]["retained_tokens"] <= 4 + 15  # the prompt (radix cache) + the budget
    assert "thinkv: model 'tiny-llama' calibrated: layers [1], thresholds (0.3, 0.7)" in guarded_server.server.log()
    assert metric(guarded_server.server, "kvsieve_policy_fallback_total", policy="thinkv") == 0
