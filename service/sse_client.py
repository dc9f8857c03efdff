"""Reading an OpenAI-style event stream as a client (tests, benchmarks, the
load tests): lines split at "\n" only. httpx's iter_lines/aiter_lines also
split at U+2028, U+0085 and the other str.splitlines() breaks, which a
model's text may hold (JSON leaves them unescaped), so an event came out cut
in two and its JSON failed to parse."""

from __future__ import annotations

from typing import AsyncIterator, Iterator


def sse_lines(response) -> Iterator[str]:
    """The lines of a streamed httpx response."""
    pending = ""
    for text in response.iter_text():
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            yield line.rstrip("\r")
    if pending:
        yield pending


async def asse_lines(response) -> AsyncIterator[str]:
    """The lines of a streamed httpx.AsyncClient response."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            yield line.rstrip("\r")
    if pending:
        yield pending
