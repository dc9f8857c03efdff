"""thinkv with TBQ through a real `kvsieve serve` (tiny Llama on CPU, the
session server): generated tokens are quantized in groups of 16 by default,
reported in kv_usage and the metrics, and every page, full-precision and
quantized, comes back when the request ends or is aborted."""

import json
import time

import httpx

from test_compressed import complete, metric, region_idle
from kvsieve.service.sse_client import sse_lines

PROMPT = [13, 301, 12, 44, 150, 23, 9, 81, 200, 5, 61, 17]
THINKV = {"name": "thinkv", "budget": 48, "params": {"refresh": 16, "retention": [8, 4], "kmeans_iters": 2}}


def with_params(**params):
    return {**THINKV, "params": {**THINKV["params"], **params}}


def quantized_idle(server, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(server, "kvsieve_region_quantized_pages", state="used") == 0:
            return True
        time.sleep(0.2)
    return False


def test_thinkv_quantizes_by_default_and_reports_its_bytes(llama_server):
    on = complete(llama_server, PROMPT, THINKV, max_tokens=100)["kv_usage"]
    off = complete(llama_server, PROMPT, with_params(tbq=False), max_tokens=100)["kv_usage"]
    assert on["tbq"] is True and off["tbq"] is False
    # Both hold the budget (quantized outputs differ, and so do their anneals).
    assert on["retained_tokens"] <= len(PROMPT) + 48 and off["retained_tokens"] <= len(PROMPT) + 48
    # Without TBQ every element has the model's precision (16 bits or more);
    # with it 2-4 bit codes, their scales and the newest group in full precision.
    full_bits = off["kv_bits_per_element"]
    assert full_bits >= 16
    assert 2 < on["kv_bits_per_element"] < full_bits / 2
    # Region tokens: the prompt's private part stays in the radix cache, retained whole.
    per_token = lambda kv: kv["retained_kv_bytes"] / (  # noqa: E731
        kv["retained_tokens"] - kv["prompt_tokens"] + kv["prefix_cache_hit_tokens"])
    assert per_token(on) < per_token(off) / 2
    # R8E4T2 on a 4-bit page class is a 400 (issue #30, tests/test_paper_presets_api.py), not stored as NVFP4.
    assert region_idle(llama_server) and quantized_idle(llama_server)


def test_bad_tbq_params_are_a_400_naming_the_field(llama_server):
    for params, field in [({"tbq": "yes"}, "tbq"), ({"tbq_precision": "R2E4T2"}, "tbq_precision")]:
        body = {"prompt": [1, 2], "max_tokens": 2, "kv_policy": {"name": "thinkv", "params": params}}
        r = httpx.post(f"{llama_server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and f"kv_policy.params.{field}" in r.text, r.text


def test_an_aborted_tbq_request_returns_every_page_and_shows_in_the_metrics(llama_server):
    body = {"prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True,
            "kv_policy": THINKV}
    bits = 0.0
    with httpx.stream("POST", f"{llama_server.url}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        chunks = 0
        for line in sse_lines(r):
            if line.startswith("data: ") and line != "data: [DONE]":
                json.loads(line[6:])
                chunks += 1
            if chunks >= 60:
                # In flight: quantized pages held, bits per element below full
                # precision. The gauges refresh about once a second: a refresh
                # from the request's first 16 tokens (no group flushed yet) reads 16.
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and not 0 < bits < 16:
                    bits = metric(llama_server, "kvsieve_retained_kv_bits_per_element", policy="thinkv")
                    time.sleep(0.3)
                used = metric(llama_server, "kvsieve_region_quantized_pages", state="used")
                break  # closing the stream aborts the request
    assert used > 0
    assert 2 < bits < 16
    assert region_idle(llama_server) and quantized_idle(llama_server)
