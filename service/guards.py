"""What stands between a client and the engine: API keys, per-key rate
limits and the request body size limit (an ASGI middleware on /v1/*), plus
the store mirror that supplies keys and presets. /health and /metrics stay
open (probes and scrapers carry no key).
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

from fastapi.responses import JSONResponse

from .auth import bearer_token, verify
from .caps import Caps
from .config import Settings, load_settings
from .errors import APIError
from .metrics import GUARD_REJECTIONS
from .ratelimit import RateLimiter, rate_limiter_for
from .store import open_store


def _receive_cancelled_errors() -> tuple:
    """What an ASGI receive() raises when the client has gone, besides
    returning http.disconnect: Ray Serve's ingress cancels its receive task
    and the await raises TaskCancelledError (a traceback per disconnect
    otherwise). Only where this process runs under Ray (no Ray import for a
    single-process server)."""
    exceptions = sys.modules.get("ray.exceptions")
    return (exceptions.TaskCancelledError,) if exceptions is not None else ()
from .store_cache import StoreMirror

logger = logging.getLogger(__name__)


def _error(status: int, message: str, type_: str, code: str, headers: Optional[dict] = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class Guards:
    def __init__(self, settings: Settings, mirror: Optional[StoreMirror]):
        self.settings = settings
        self.mirror = mirror
        self.caps = Caps(settings.limits)
        self.limiter = rate_limiter_for(settings.store.url, settings.store.timeout_s)

    @classmethod
    def from_settings(cls, settings: Optional[Settings] = None) -> "Guards":
        settings = settings or load_settings()
        url = settings.store.url
        backend = "file" if url.startswith("file://") else "redis"
        mirror = StoreMirror(open_store(url, settings.store.timeout_s), backend,
                             settings.store.refresh_interval_s).start()
        return cls(settings, mirror)

    @property
    def presets(self) -> dict[str, dict]:
        return self.mirror.presets if self.mirror is not None else {}

    def admit(self, authorization: Optional[str]) -> Optional[JSONResponse]:
        """None when the request may go on, else the response refusing it."""
        auth = self.settings.auth
        if not auth.enabled:
            return None
        keys = self.mirror.keys if self.mirror is not None else {}
        record = verify(bearer_token(authorization), keys)
        if record is None:
            GUARD_REJECTIONS.labels("unauthorized").inc()
            return _error(401, "missing or invalid API key (Authorization: Bearer <key>)",
                          "invalid_request_error", "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        rate = record.rate_per_s or auth.default_rate_per_s
        burst = record.burst or auth.default_burst
        wait = self.limiter.acquire(record.key_id, rate, burst)
        if wait is not None:
            GUARD_REJECTIONS.labels("rate_limited").inc()
            return _error(429, f"rate limit of key {record.name!r} reached ({rate:g}/s, burst {burst})",
                          "requests", "rate_limit_exceeded", {"Retry-After": RateLimiter.retry_after_header(wait)})
        return None

    def stop(self) -> None:
        if self.mirror is not None:
            self.mirror.stop()
        close = getattr(self.limiter, "close", None)
        if close is not None:
            close()


class _BodyTooLarge(APIError):
    def __init__(self, limit: int):
        super().__init__(413, f"request body is larger than {limit} bytes", code="request_too_large")


class GuardMiddleware:
    """Pure ASGI (streaming responses pass through untouched)."""

    def __init__(self, app, guards: Guards):
        self.app = app
        self.guards = guards
        self.receive_cancelled = _receive_cancelled_errors()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self.guards.admit(headers.get("authorization"))
        if refusal is not None:
            return await refusal(scope, receive, send)
        limit = self.guards.settings.limits.max_body_bytes
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            GUARD_REJECTIONS.labels("body_too_large").inc()
            return await _BodyTooLarge(limit).response()(scope, receive, send)

        seen = 0

        async def limited_receive():
            nonlocal seen
            try:
                message = await receive()
            except self.receive_cancelled:
                return {"type": "http.disconnect"}  # the client is gone: say so the ASGI way
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # chunked uploads carry no content-length
                    GUARD_REJECTIONS.labels("body_too_large").inc()
                    raise _BodyTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)
