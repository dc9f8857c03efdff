"""The client-side event-stream reader (tests, benchmarks, load tests) keeps
an event whole when its text holds a line break other than \n (U+2028,
U+0085), where httpx's iter_lines cuts it in two, and drops the \r of a
\r\n line end."""

import asyncio
import json

import httpx

from kvsieve.service.sse_client import asse_lines, sse_lines

EVENT = {"choices": [{"text": "a\u2028b\u0085c"}]}
BODY = f"data: {json.dumps(EVENT, ensure_ascii=False)}\r\n\r\ndata: [DONE]\n\n".encode()


def _chunks(size=5):
    return [BODY[i:i + size] for i in range(0, len(BODY), size)]


def test_sync_reader_keeps_the_event_whole_across_chunks():
    response = httpx.Response(200, stream=httpx.ByteStream(BODY))
    assert len(list(response.iter_lines())) > 4  # httpx splits inside the event
    response = httpx.Response(200, content=iter(_chunks()))
    lines = [line for line in sse_lines(response) if line]
    assert lines == [f"data: {json.dumps(EVENT, ensure_ascii=False)}", "data: [DONE]"]
    assert json.loads(lines[0][6:]) == EVENT


def test_async_reader_keeps_the_event_whole_across_chunks():
    async def body():
        for chunk in _chunks(3):
            yield chunk

    async def read():
        response = httpx.Response(200, content=body())
        return [line async for line in asse_lines(response) if line]

    lines = asyncio.run(read())
    assert [json.loads(lines[0][6:]), lines[1]] == [EVENT, "data: [DONE]"]
