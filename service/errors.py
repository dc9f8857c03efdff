"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse
from pydantic import ValidationError


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: Optional[str] = None,
        type_: str = "invalid_request_error",
        code: Optional[str] = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        # 503 means "full right now": tell clients when to come back.
        headers = {"Retry-After": "1"} if self.status == 503 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation_error(err: ValidationError) -> APIError:
    """First pydantic error -> 400 naming the field by its dotted path."""
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"] if not str(p).startswith(("function-", "tagged-union"))]
    # Union members add their type names to the path; keep the field path.
    loc = [p for p in loc if p not in {"str", "int", "list[int]", "list[str]", "dict[str,any]", "list[TextPart]"}]
    param = ".".join(loc) or None
    message = first["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
        if ":" in message and param is None:
            param = message.split(":", 1)[0]
    return bad_request(f"{param}: {message}" if param else message, param=param)
