"""What `GET /v1/kv_policies` lists: every served policy with its
parameters (JSON Schema from its pydantic model: defaults, bounds,
descriptions), whether it takes a budget, its defaults, and a one-line
description, so clients can discover what `kv_policy` accepts."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from .registry import get_policy, policy_names
from .spec import DEFAULT_BUDGET, MAX_BUDGET, MIN_RATIO_BUDGET


def policy_entry(name: str) -> dict:
    cls = get_policy(name)
    entry = {
        "id": name,
        "object": "kv_policy",
        "description": cls.description,
        "compresses": cls.compresses,
        "takes_budget": cls.takes_budget,
        "params": cls.Params.model_json_schema(),
    }
    if cls.compresses:
        entry["compress_prompt_default"] = cls.compress_prompt
    if cls.takes_budget:
        entry["budget"] = {"type": "integer", "minimum": 1, "maximum": MAX_BUDGET, "default": DEFAULT_BUDGET,
                           "description": "retained private tokens per layer and kv head"}
        entry["budget_ratio"] = {"type": "number", "exclusiveMinimum": 0, "maximum": 1,
                                 "description": "budget as a share of the private tokens seen so far, "
                                                f"at least {MIN_RATIO_BUDGET} tokens"}
    return entry


def catalog(served: Collection[str], presets: Mapping[str, Mapping]) -> dict:
    """The response body: OpenAI's list shape, plus the named presets."""
    return {"object": "list", "data": [policy_entry(n) for n in policy_names() if n in served],
            "presets": {name: dict(value) for name, value in sorted(presets.items())}}
