"""The OpenAPI document of the API: the routes read raw JSON (so every bad
input gets OpenAI's error shape, not FastAPI's), so their request bodies are
described here from the protocol models; schemathesis and clients read it."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .protocol import ChatCompletionRequest, CompletionRequest

_BODIES = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}
_ERROR = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]},
    }}},
}


def document_request_bodies(app: FastAPI, auth: bool) -> None:
    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title="kvsieve", version="0.1.0", routes=app.routes,
                             description="OpenAI-compatible API with per-request KV-cache compression (kv_policy)")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["Error"] = _ERROR
        for path, model in _BODIES.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            op = schema["paths"][path]["post"]
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            op["responses"] = {
                "200": {"description": "completion (JSON, or Server-Sent Events when stream is true)"},
                "400": {"description": "invalid request; error.param names the field",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
                **({"401": {"description": "missing or invalid API key"},
                    "429": {"description": "rate limited; see Retry-After"}} if auth else {}),
                "413": {"description": "request body too large"},
                "503": {"description": "engine full; see Retry-After"},
            }
        if auth:
            components_root = schema["components"]
            components_root["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, item in schema["paths"].items():
                if path.startswith("/v1/"):
                    for op in item.values():
                        op["security"] = [{"bearer": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
