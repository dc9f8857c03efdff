"""/metrics: SGLang's metrics and kvsieve's, following Prometheus naming."""

import httpx


def test_metrics_expose_sglang_and_kvsieve(llama_server):
    body = {"prompt": "one two", "max_tokens": 4, "ignore_eos": True, "kv_policy": "full"}
    httpx.post(f"{llama_server.url}/v1/completions", json=body, timeout=60).raise_for_status()
    httpx.post(f"{llama_server.url}/v1/completions", json={**body, "kv_policy": "bogus"}, timeout=60)
    text = httpx.get(f"{llama_server.url}/metrics").text
    assert "sglang:" in text  # the engine's own metrics, from its scheduler process
    for name in ("kvsieve_requests_total", "kvsieve_time_to_first_token_seconds_bucket",
                 "kvsieve_time_per_output_token_seconds_bucket", "kvsieve_kv_tokens_in_use",
                 "kvsieve_prompt_tokens_total", "kvsieve_generation_tokens_total"):
        assert any(line.startswith(name + "{") and 'policy="full"' in line for line in text.splitlines()), name
    # A rejected request with an unknown policy is counted without its name as label.
    assert 'kvsieve_requests_total{policy="invalid",status="rejected"}' in text
    assert 'policy="bogus"' not in text
