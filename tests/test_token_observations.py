"""Policies that ask for TOKEN_IDS / HIDDEN_STATES receive, once per forward
pass, every token the request processed (prompt chunks, then one per decode
step) with its position, its id and the last layer's hidden state (after the
final norm), the same as transformers computes for that sequence.

The session's chunked server (16-token prefill chunks) serves the recording
policy of tests/policies_extra; this test's prompts start with ids 5..20,
which its other users do not send."""

import json

import httpx
import torch


def test_policy_sees_token_ids_and_last_layer_hidden_states(chunked_server, tiny_llama, tmp_path):
    from transformers import AutoModel

    server = chunked_server
    out = tmp_path / "tokens.jsonl"
    # A shared prefix first, so the recorded prompt starts past it.
    shared = list(range(5, 21))
    httpx.post(f"{server.url}/v1/completions", timeout=60,
               json={"prompt": shared + [3], "max_tokens": 1}).raise_for_status()
    prompt = shared + list(range(30, 70))  # 40 private tokens: three prefill chunks
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 12, "ignore_eos": True, "temperature": 0, "return_token_ids": True,
        "kv_policy": {"name": "test_recording", "params": {"out": str(out)}}})
    assert r.status_code == 200, r.text
    body = r.json()
    generated = body["choices"][0]["token_ids"]
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    # SGLang's overlap scheduler may run one more decode step for the request
    # after its answer went out; a later request's answer comes after that step.
    httpx.post(f"{server.url}/v1/completions", timeout=60,
               json={"prompt": [2] + shared, "max_tokens": 1}).raise_for_status()

    records = [json.loads(line) for line in out.read_text().splitlines()]
    sequence = prompt + generated
    # Every private token once, in order: the prompt past the shared prefix,
    # then each generated token fed back (the extra decode step above feeds
    # the last generated token too).
    end = len(records) + cached
    assert end in (len(sequence) - 1, len(sequence))
    assert [rec["position"] for rec in records] == list(range(cached, end))
    assert [rec["token"] for rec in records] == sequence[cached:end]

    model = AutoModel.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        reference = model(torch.tensor([sequence[:end]])).last_hidden_state[0, cached:]
    recorded = torch.tensor([rec["hidden"] for rec in records])
    # The engine computes in bfloat16 on CPU: close, not bit-equal.
    assert (recorded - reference).abs().max() < 0.05
    assert torch.nn.functional.cosine_similarity(recorded, reference, dim=-1).min() > 0.999
