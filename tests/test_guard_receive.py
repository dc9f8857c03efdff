"""A client that goes away under Ray Serve: the ingress's ASGI receive()
raises Ray's TaskCancelledError instead of returning http.disconnect, which
Starlette's streaming response let escape as a traceback per disconnect
(seen in tests/test_scale_ray.py). The guard middleware, which wraps every
/v1/ receive, turns it into the disconnect message; other receives pass."""

import asyncio

import pytest
from ray.exceptions import TaskCancelledError

from kvsieve.service.config import Settings
from kvsieve.service.guards import GuardMiddleware, Guards

SCOPE = {"type": "http", "path": "/v1/completions", "headers": [(b"content-type", b"application/json")]}


def _run(receive) -> list:
    seen = []

    async def app(scope, receive, send):
        seen.append(await receive())

    async def send(message):
        pass

    guards = Guards(Settings(), mirror=None)
    asyncio.run(GuardMiddleware(app, guards)(SCOPE, receive, send))
    return seen


def test_a_cancelled_ray_receive_reads_as_a_disconnect():
    async def receive():
        raise TaskCancelledError()

    assert _run(receive) == [{"type": "http.disconnect"}]


def test_other_receives_and_errors_pass_through():
    async def body():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    assert _run(body) == [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def broken():
        raise RuntimeError("not a disconnect")

    with pytest.raises(RuntimeError, match="not a disconnect"):
        _run(broken)
