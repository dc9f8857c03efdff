"""The OpenAI-compatible API on a real engine (tiny Llama on CPU)."""

import asyncio
import json
import time

import httpx
import openai
import pytest
from kvsieve.service.sse_client import sse_lines, asse_lines


@pytest.fixture(scope="module")
def client(llama_server):
    return openai.OpenAI(base_url=f"{llama_server.url}/v1", api_key="unused")


def test_models_and_health(llama_server):
    models = httpx.get(f"{llama_server.url}/v1/models").json()
    assert models["data"][0]["id"] == llama_server.model
    assert httpx.get(f"{llama_server.url}/health").json() == {"status": "ok"}


def test_chat_completion_with_openai_client(client, llama_server):
    resp = client.chat.completions.create(
        model=llama_server.model, messages=[{"role": "user", "content": "one two three"}],
        max_tokens=12, temperature=0, extra_body={"kv_policy": "full", "ignore_eos": True},
    )
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 12
    kv = resp.model_extra["kv_usage"]
    assert kv["policy"] == "full"
    assert kv["prompt_tokens"] == resp.usage.prompt_tokens
    assert kv["private_tokens"] == resp.usage.prompt_tokens - kv["prefix_cache_hit_tokens"] + 12
    assert kv["retained_tokens"] == kv["private_tokens"] and kv["evicted_tokens"] == 0


def test_completion_with_openai_client(client, llama_server):
    resp = client.completions.create(
        model=llama_server.model, prompt="the model thinks", max_tokens=8, temperature=0,
        extra_body={"kv_policy": {"name": "full"}, "ignore_eos": True},
    )
    assert resp.choices[0].text and resp.usage.completion_tokens == 8
    assert resp.model_extra["kv_usage"]["policy"] == "full"


def test_chat_stream_with_openai_client(client, llama_server):
    stream = client.chat.completions.create(
        model=llama_server.model, messages=[{"role": "user", "content": "plus minus"}],
        max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    last = chunks[-1]
    assert last.choices[0].finish_reason == "length"
    assert last.usage.completion_tokens == 10
    assert last.model_extra["kv_usage"]["policy"] == "full"
    # Streamed text equals the non-streamed text for the same greedy request.
    full = client.chat.completions.create(
        model=llama_server.model, messages=[{"role": "user", "content": "plus minus"}],
        max_tokens=10, temperature=0, extra_body={"ignore_eos": True},
    )
    assert text == full.choices[0].message.content


def test_completion_stream_with_openai_client(client, llama_server):
    stream = client.completions.create(
        model=llama_server.model, prompt="wait let me", max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    chunks = list(stream)
    ids = [t for c in chunks for t in c.choices[0].model_extra.get("token_ids", [])]
    assert len(ids) == 6
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 6


def test_raw_sse_ends_with_done(llama_server):
    body = {"prompt": "one", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{llama_server.url}/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in sse_lines(r) if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_preset_and_literal_extra_body(llama_server):
    body = {"prompt": "one", "max_tokens": 2, "extra_body": {"kv_policy": "lossless"}}
    r = httpx.post(f"{llama_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["kv_usage"] == {**r.json()["kv_usage"], "policy": "full", "preset": "lossless"}


def test_repeated_prompt_hits_the_prefix_cache(llama_server):
    prompt = "nine ten plus minus equals " * 20
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    httpx.post(f"{llama_server.url}/v1/completions", json=body, timeout=60).raise_for_status()
    second = httpx.post(f"{llama_server.url}/v1/completions", json=body, timeout=60).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert second["kv_usage"]["prefix_cache_hit_tokens"] == second["usage"]["prompt_tokens_details"]["cached_tokens"]


def _post(server, path, content, headers=None):
    return httpx.post(f"{server.url}{path}", content=content, timeout=60,
                      headers=headers or {"content-type": "application/json"})


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path, body, param",
    [
        (CHAT, b'{"messages": [', None),                                   # malformed JSON
        (CHAT, b'\xff\xfe{"messages": []}', None),                          # not UTF-8
        (CHAT, b'[1, 2]', None),                                            # not an object
        (CHAT, {}, "messages"),                                             # missing messages
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": "hi"}, "messages"),                             # wrong type
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        (CHAT, {"messages": MSG, "max_tokens": 0}, "max_tokens"),
        (CHAT, {"messages": MSG, "max_tokens": -3}, "max_tokens"),
        (CHAT, {"messages": MSG, "max_tokens": 10**9}, "max_tokens"),       # above the limit
        (CHAT, {"messages": MSG, "max_tokens": "ten"}, "max_tokens"),
        (CHAT, {"messages": MSG, "temperature": 5}, "temperature"),
        (CHAT, {"messages": MSG, "n": 2}, "n"),
        (CHAT, {"messages": MSG, "stream": "yes please"}, "stream"),
        (CHAT, {"messages": MSG, "kv_policy": "nope"}, "kv_policy.name"),
        (CHAT, {"messages": MSG, "kv_policy": {"name": "full", "budget": 0}}, "kv_policy.budget"),
        (CHAT, {"messages": MSG, "kv_policy": {"name": "full", "params": {"x": 1}}}, "kv_policy.params.x"),
        (CHAT, {"messages": MSG, "extra_body": {"kv_policy": 7}}, "kv_policy"),
        (COMP, {"prompt": "one " * 5000, "max_tokens": 1}, "prompt"),       # longer than the context
        (COMP, {"prompt": [999999]}, "prompt"),                             # token id out of range
        (COMP, {"prompt": []}, "prompt"),
        (COMP, {"max_tokens": 3}, "prompt"),
        (COMP, {"prompt": "x", "echo": True}, "echo"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(llama_server, path, body, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = _post(llama_server, path, content)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    if param:
        assert param in error["message"]


def test_unknown_model_is_404(llama_server):
    r = httpx.post(f"{llama_server.url}{CHAT}", json={"model": "gpt-9", "messages": MSG}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_server_keeps_serving_after_bad_input(llama_server):
    for junk in (b"{", b"\x80\x81", b"null"):
        assert _post(llama_server, CHAT, junk).status_code == 400
    r = httpx.post(f"{llama_server.url}{COMP}", json={"prompt": "one", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_sixteen_concurrent_requests_all_complete(llama_server):
    async def one(client, i):
        body = {"prompt": f"number {i} plus", "max_tokens": 16, "ignore_eos": True,
                "stream": i % 2 == 0, "kv_policy": "full"}
        if body["stream"]:
            async with client.stream("POST", f"{llama_server.url}{COMP}", json=body) as r:
                lines = [line async for line in asse_lines(r) if line]
            assert lines[-1] == "data: [DONE]"
            return json.loads(lines[-2][6:])["usage"]["completion_tokens"]
        r = await client.post(f"{llama_server.url}{COMP}", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    assert asyncio.run(run()) == [16] * 16


def _metric(server, name, **labels):
    total = 0.0
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_client_disconnect_mid_stream_aborts_in_engine(llama_server):
    before = _metric(llama_server, "kvsieve_requests_total", policy="full", status="aborted")
    body = {"prompt": "one two", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{llama_server.url}{COMP}", json=body, timeout=60) as r:
        for i, _ in enumerate(sse_lines(r)):
            if i > 3:
                break  # leaving the block closes the connection mid-stream
    # The request is aborted in the engine: nothing keeps running or holding KV.
    deadline = time.monotonic() + 30
    while True:
        aborted = _metric(llama_server, "kvsieve_requests_total", policy="full", status="aborted")
        running = _metric(llama_server, "sglang:num_running_reqs")
        if (aborted == before + 1 and running == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert aborted == before + 1
    assert running == 0
    assert _metric(llama_server, "kvsieve_kv_tokens_in_use", policy="full") == 0


def test_kv_policies_lists_every_served_policy_with_its_parameters(llama_server):
    from kvsieve.policies import get_policy, policy_names

    body = httpx.get(f"{llama_server.url}/v1/kv_policies").json()
    by_name = {p["id"]: p for p in body["data"]}
    assert set(by_name) == set(policy_names())
    streaming = by_name["streaming"]
    assert streaming["params"]["properties"]["sinks"] == {"default": 4, "minimum": 0, "title": "Sinks",
                                                          "type": "integer"}
    assert streaming["takes_budget"] and streaming["compress_prompt_default"] is False
    assert streaming["description"] == get_policy("streaming").description
    assert by_name["snapkv"]["compress_prompt_default"] is True
    assert "budget" not in by_name["full"] and not by_name["full"]["compresses"]
    assert all(p["description"] for p in body["data"])
    assert body["presets"] == {"lossless": {"name": "full"}}
