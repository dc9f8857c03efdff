"""API keys (hashed, constant-time check, never logged), per-key token-bucket
rate limits (429 + Retry-After), request caps, body size limit, and the
served presets and keys following the Redis store live, through an outage.
Real `kvsieve serve` with a real engine and a real redis-server."""

import re
import time

import httpx
import pytest

from conftest import kvsieve_cli
from kvsieve.service.auth import bearer_token, new_key, verify
from kvsieve.service.ratelimit import RateLimiter


def test_token_bucket():
    now = [0.0]
    limiter = RateLimiter(clock=lambda: now[0])
    assert [limiter.acquire("k", rate=2.0, burst=3) for _ in range(3)] == [None, None, None]
    wait = limiter.acquire("k", rate=2.0, burst=3)
    assert wait == pytest.approx(0.5)
    assert RateLimiter.retry_after_header(wait) == "1"
    assert limiter.acquire("other", rate=2.0, burst=3) is None  # buckets are per key
    now[0] += 0.5
    assert limiter.acquire("k", rate=2.0, burst=3) is None
    assert limiter.acquire("k", rate=2.0, burst=3) is not None
    now[0] += 100  # refills to the burst, not beyond
    assert [limiter.acquire("k", 2.0, 3) is None for _ in range(4)] == [True, True, True, False]


def test_key_format_and_bearer():
    key, record = new_key("a")
    assert re.fullmatch(r"ksv-[0-9a-f]{12}-[\w-]+", key) and record.key_id in key
    assert bearer_token(f"Bearer {key}") == key and bearer_token(f"bearer  {key} ") == key
    assert bearer_token("Basic abc") is None and bearer_token(None) is None
    assert verify(key, {record.key_id: record}) is record
    assert verify(key + "x", {record.key_id: record}) is None


def _complete(server, headers=None, **body):
    body = {"prompt": "one two three", "max_tokens": 4, **body}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=120)


def test_keys_required_and_rate_limited(guarded_server):
    s = guarded_server
    assert httpx.get(f"{s.url}/health").status_code == 200  # probes carry no key
    missing = _complete(s)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    wrong = _complete(s, headers=s.headers("ksv-000000000000-" + "a" * 43))
    assert wrong.status_code == 401
    assert httpx.get(f"{s.url}/v1/models", headers=s.headers()).status_code == 200

    # A key created after start-up works without a restart; its bucket holds 2.
    created = kvsieve_cli("keys", "create", "tiny-quota", "--rate", "0.2", "--burst", "2", env=s.env)
    key = created.stdout.strip()
    deadline = time.monotonic() + 10
    while _complete(s, headers=s.headers(key)).status_code == 401 and time.monotonic() < deadline:
        time.sleep(0.2)
    codes = [_complete(s, headers=s.headers(key)) for _ in range(3)]
    limited = [r for r in codes if r.status_code == 429]
    assert limited, [r.status_code for r in codes]
    assert int(limited[0].headers["Retry-After"]) >= 1
    assert limited[0].json()["error"]["code"] == "rate_limit_exceeded"
    # Deleting the key takes it away, again without a restart.
    key_id = key.split("-")[1]
    assert kvsieve_cli("keys", "delete", key_id, env=s.env).returncode == 0
    deadline = time.monotonic() + 10
    while _complete(s, headers=s.headers(key)).status_code != 401 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _complete(s, headers=s.headers(key)).status_code == 401

    metrics = httpx.get(f"{s.url}/metrics").text
    assert 'kvsieve_guard_rejections_total{reason="unauthorized"}' in metrics
    assert 'kvsieve_guard_rejections_total{reason="rate_limited"}' in metrics
    assert key not in s.server.log() and s.key not in s.server.log()


def test_caps_and_body_limit(guarded_server):
    s, h = guarded_server, guarded_server.headers()
    over = _complete(s, headers=h, max_tokens=17)
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
    chat = httpx.post(f"{s.url}/v1/chat/completions", headers=h, timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 99})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_completion_tokens"
    long_prompt = _complete(s, headers=h, prompt=list(range(5, 300)))
    assert long_prompt.status_code == 400 and long_prompt.json()["error"]["param"] == "prompt"
    budget = _complete(s, headers=h, kv_policy={"name": "streaming", "budget": 1024})
    assert budget.status_code == 400 and budget.json()["error"]["param"] == "kv_policy.budget"
    n = _complete(s, headers=h, n=2)
    assert n.status_code == 400 and n.json()["error"]["param"] == "n"
    # No max_tokens: the cap is the default, not the whole context.
    default = _complete(s, headers=h, max_tokens=None, ignore_eos=True)
    assert default.status_code == 200 and default.json()["usage"]["completion_tokens"] == 16
    big = httpx.post(f"{s.url}/v1/completions", headers={**h, "content-type": "application/json"},
                     content=b'{"prompt": "' + b"a" * 70000 + b'"}', timeout=60)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"

    def chunked():
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"b" * 4096
        yield b'"}'

    streamed = httpx.post(f"{s.url}/v1/completions", headers={**h, "content-type": "application/json"},
                          content=chunked(), timeout=60)
    assert streamed.status_code == 413


def test_presets_follow_redis_through_an_outage(guarded_server):
    s, h = guarded_server, guarded_server.headers()
    assert kvsieve_cli("presets", "set", "house", '{"name": "full"}', env=s.env).returncode == 0
    deadline = time.monotonic() + 10
    while (r := _complete(s, headers=h, kv_policy="house")).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert r.status_code == 200 and r.json()["kv_usage"]["preset"] == "house"

    s.redis.stop()
    try:
        time.sleep(1.0)  # a few polls fail
        # Serving goes on with the last known presets and keys.
        r = _complete(s, headers=h, kv_policy="house")
        assert r.status_code == 200 and r.json()["kv_usage"]["preset"] == "house"
        metrics = httpx.get(f"{s.url}/metrics").text
        assert 'kvsieve_store_up{backend="redis"} 0.0' in metrics
        assert re.search(r'kvsieve_store_errors_total\{backend="redis"\} [1-9]', metrics)
        assert "store unreachable" in s.server.log()
    finally:
        s.redis.start()
    assert kvsieve_cli("presets", "set", "later", '{"name": "full"}', env=s.env).returncode == 0
    deadline = time.monotonic() + 10
    while (r := _complete(s, headers=h, kv_policy="later")).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert r.status_code == 200
    assert 'kvsieve_store_up{backend="redis"} 1.0' in httpx.get(f"{s.url}/metrics").text
    assert "store reachable again" in s.server.log()
