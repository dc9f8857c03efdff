"""The `kv_policy` request field: parsing and validation into a KVPolicySpec.

Accepted forms (OpenAI request body, top level or inside `extra_body`):
  "h2o"                                   a policy name, or a preset name
  {"name": "h2o", "budget": 256, "params": {...}}
  {"name": "h2o", "budget_ratio": 0.1}
  {"name": "snapkv", "budget": 256, "compress_prompt": false}
Every error names the offending field (`kv_policy.budget`, ...).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .registry import get_policy, policy_names


class KVPolicyError(ValueError):
    """A kv_policy value is invalid; `field` is the dotted path of the culprit."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


#: Budget of a compressing request that names none (tokens per layer and kv head).
DEFAULT_BUDGET = 1024
#: Floor of a budget given as budget_ratio (tokens per layer and kv head).
MIN_RATIO_BUDGET = 16

#: Largest budget accepted (tokens per layer and kv head): far above any
#: context length served today, and small enough that arithmetic on it is safe.
MAX_BUDGET = 1 << 22


class KVPolicySpec(BaseModel):
    """A validated policy choice: what reaches the engine in custom_params.
    Strict types: JSON `true` is not a budget and "64" is not 64."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str
    budget: Optional[int] = Field(default=None, gt=0, le=MAX_BUDGET)
    budget_ratio: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    params: dict[str, Any] = Field(default_factory=dict)
    #: Whether the private prompt goes to the compressed region (and is cut by
    #: the policy at prefill end) or stays in SGLang's radix cache, attended in
    #: full and shared with later requests. None: the policy's default.
    compress_prompt: Optional[bool] = None
    #: The preset this spec came from, if any (reported back in kv_usage).
    #: In a request, {"preset": NAME, ...} starts from that preset and the
    #: other keys override it.
    preset: Optional[str] = None

    @property
    def compresses(self) -> bool:
        return get_policy(self.name).compresses

    @property
    def prompt_compressed(self) -> bool:
        if self.compress_prompt is not None:
            return self.compress_prompt
        return get_policy(self.name).compress_prompt

    def to_custom_params(self) -> dict[str, Any]:
        """JSON-safe form carried by SamplingParams.custom_params["kv_policy"]."""
        return self.model_dump(exclude_none=True)


FULL = KVPolicySpec(name="full")


def _format_pydantic_error(prefix: str, err: ValidationError) -> KVPolicyError:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    field = f"{prefix}.{loc}" if loc else prefix
    if first["type"] == "extra_forbidden":
        return KVPolicyError(field, "unknown field")
    return KVPolicyError(field, first["msg"])


def _from_preset(value: Mapping, presets: Mapping, field: str) -> tuple[dict, str]:
    """{"preset": NAME, ...overrides}: the preset's object with the other
    keys on top (params merged key by key)."""
    name = value["preset"]
    if not isinstance(name, str) or name not in presets:
        known = ", ".join(sorted(presets)) or "none"
        raise KVPolicyError(f"{field}.preset", f"unknown preset {name!r} (presets: {known})")
    base = dict(presets[name])
    overrides = {k: v for k, v in value.items() if k != "preset"}
    if isinstance(base.get("params"), Mapping) and isinstance(overrides.get("params"), Mapping):
        overrides["params"] = {**base["params"], **overrides["params"]}
    if "budget" in overrides or "budget_ratio" in overrides:  # one replaces the other
        base.pop("budget", None)
        base.pop("budget_ratio", None)
    return {**base, **overrides}, name


def parse_kv_policy(
    value: Any,
    presets: Optional[Mapping[str, Mapping[str, Any]]] = None,
    field: str = "kv_policy",
    served: Optional[Collection[str]] = None,
) -> KVPolicySpec:
    """Validate a kv_policy value; None means `full`. Raises KVPolicyError.

    `served`: the policies the engine can run; a registered policy outside it
    is refused rather than silently run as another one."""
    if value is None:
        return FULL
    # presets None: an engine-side re-check of a spec the front end built, whose
    # `preset` is only the label of where it came from.
    resolve = presets is not None
    presets = presets or {}
    preset_name = None
    if isinstance(value, str):
        if value in presets:
            preset_name = value
            value = dict(presets[value])
        else:
            value = {"name": value}
    if not isinstance(value, Mapping):
        raise KVPolicyError(field, "must be a policy or preset name, or an object {name, budget | budget_ratio, params}")
    if "preset" in value and resolve:
        value, preset_name = _from_preset(value, presets, field)
    elif "preset" in value:
        preset_name = value["preset"]

    name = value.get("name")
    if not isinstance(name, str):
        raise KVPolicyError(f"{field}.name", "is required and must be a string")
    try:
        policy = get_policy(name)
    except KeyError:
        known = ", ".join(policy_names())
        hint = f"; presets: {', '.join(sorted(presets))}" if presets else ""
        raise KVPolicyError(f"{field}.name", f"unknown policy {name!r} (policies: {known}{hint})") from None

    if served is not None and name not in served:
        raise KVPolicyError(
            f"{field}.name", f"policy {name!r} is not served by this engine (served: {', '.join(sorted(served))})"
        )
    try:
        spec = KVPolicySpec.model_validate({**value, "preset": preset_name})
    except ValidationError as err:
        raise _format_pydantic_error(field, err) from None

    if spec.budget is not None and spec.budget_ratio is not None:
        raise KVPolicyError(f"{field}.budget_ratio", "give budget or budget_ratio, not both")
    if not policy.takes_budget and (spec.budget is not None or spec.budget_ratio is not None):
        which = "budget" if spec.budget is not None else "budget_ratio"
        raise KVPolicyError(f"{field}.{which}", f"policy {name!r} takes no budget")
    if not policy.compresses and spec.compress_prompt is not None:
        raise KVPolicyError(f"{field}.compress_prompt", f"policy {name!r} does not compress")
    try:
        params = policy.Params.model_validate(spec.params)
    except ValidationError as err:
        raise _format_pydantic_error(f"{field}.params", err) from None
    problem = policy.check_budget(params, spec.budget, spec.budget_ratio)
    if problem is not None:
        which, message = problem
        raise KVPolicyError(f"{field}.{which}", message)
    # Store the params with their defaults filled in, so the engine and the
    # reported usage see exactly what runs.
    return spec.model_copy(update={"params": params.model_dump()})
