"""Per-request KV usage as the scheduler sees it, shipped back with each token.

SGLang forwards `Req.customized_info[key]` (one entry per output token) to the
tokenizer manager, which exposes it as `meta_info[key]`. kvsieve uses that
channel so `kv_usage` in API responses comes from the engine, not from a
front-end estimate.
"""

from __future__ import annotations

from typing import Any, Optional

#: meta_info key carrying the usage record (one entry per output token; the
#: record is in the entry of the last token, earlier entries are None).
KV_USAGE_KEY = "kvsieve_kv_usage"


def policy_name_of(custom_params: Optional[dict]) -> Optional[str]:
    """The kv_policy name carried in SamplingParams.custom_params, if any."""
    if not custom_params:
        return None
    spec = custom_params.get("kv_policy")
    if isinstance(spec, dict) and isinstance(spec.get("name"), str):
        return spec["name"]
    return None


def full_kv_usage(
    policy: str, prompt_tokens: int, cached_tokens: int, output_tokens: int
) -> dict[str, Any]:
    """Usage of a request on SGLang's own path: nothing is evicted."""
    private = prompt_tokens - cached_tokens + output_tokens
    return {
        "policy": policy,
        "prompt_tokens": prompt_tokens,
        "prefix_cache_hit_tokens": cached_tokens,
        "private_tokens": private,
        "retained_tokens": private,
        "evicted_tokens": 0,
    }


def last_kv_usage(meta_info: dict) -> Optional[dict]:
    """The newest usage record in a response's meta_info, if the engine sent one."""
    records = meta_info.get(KV_USAGE_KEY)
    if not records:
        return None
    for record in reversed(records):
        if record is not None:
            return record
    return None
