"""The OpenAPI document of the API: the routes read raw JSON (so every bad
input gets OpenAI's error shape, not FastAPI's), so their request bodies are
described here from the protocol models; schemathesis and clients read it.

`kv_policy` is described by the `KVPolicy` component (a name, or the object
with its budget bounds), and each policy's parameters (defaults, bounds) by
a `KVPolicyParams_<policy>` component, as GET /v1/kv_policies lists them."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kvsieve.policies import get_policy, policy_names
from kvsieve.policies.spec import MAX_BUDGET

from .presets import BUILTIN_PRESETS
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


def params_component(name: str) -> str:
    return f"KVPolicyParams_{name}"


def kv_policy_components() -> dict:
    """KVPolicy and every registered policy's parameter schema."""
    components = {}
    for name in policy_names():
        schema = get_policy(name).Params.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[params_component(name)] = schema
    params = ", ".join(f"{n}: #/components/schemas/{params_component(n)}" for n in policy_names())
    components["KVPolicy"] = {
        "description": "KV-cache compression of this request (GET /v1/kv_policies lists policies, parameters "
                       "and presets); out-of-bounds values are a 400 naming the field",
        "anyOf": [
            {"type": "string", "description": f"a policy name ({', '.join(policy_names())}) or a preset name "
                                              f"(built-in: {', '.join(sorted(BUILTIN_PRESETS))})"},
            {"type": "object", "properties": {
                "name": {"type": "string", "description": "the policy"},
                "preset": {"type": "string", "description": "start from this preset; the other keys override it"},
                "budget": {"type": "integer", "minimum": 1, "maximum": MAX_BUDGET,
                           "description": "retained private tokens per layer and kv head"},
                "budget_ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1,
                                 "description": "budget as a share of the private tokens seen so far"},
                "compress_prompt": {"type": "boolean"},
                "params": {"type": "object", "description": f"the policy's parameters ({params})"},
            }},
            {"type": "null"},
        ],
    }
    return components


def document_request_bodies(app: FastAPI, auth: bool) -> None:
    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title="kvsieve", version="0.1.0", routes=app.routes,
                             description="OpenAI-compatible API with per-request KV-cache compression (kv_policy)")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["Error"] = _ERROR
        components.update(kv_policy_components())
        for path, model in _BODIES.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            body["properties"]["kv_policy"] = {"$ref": "#/components/schemas/KVPolicy"}
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
