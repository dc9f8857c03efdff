"""Chat on a second architecture (tiny Qwen3) with the official client."""

import openai


def test_qwen3_chat_and_stream(qwen3_server):
    client = openai.OpenAI(base_url=f"{qwen3_server.url}/v1", api_key="unused")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "one plus one"}]
    resp = client.chat.completions.create(model=qwen3_server.model, messages=messages, max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(model=qwen3_server.model, messages=messages, max_tokens=8,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert resp.choices[0].message.content == streamed != ""
