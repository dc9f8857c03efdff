"""Per-request caps from settings.limits: max_tokens, prompt length and
kv_policy budget. Past one: 400 in OpenAI's shape naming the field. (n is
capped at 1 by the protocol itself: one choice per request.)"""

from __future__ import annotations

from typing import Optional

from kvsieve.policies import KVPolicySpec

from .config import LimitsConfig
from .errors import bad_request


class Caps:
    def __init__(self, limits: LimitsConfig):
        self.limits = limits

    def check_prompt(self, prompt_len: int, prompt_param: str) -> None:
        cap = self.limits.max_prompt_tokens
        if cap is not None and prompt_len > cap:
            raise bad_request(f"{prompt_param}: the prompt is {prompt_len} tokens; this server takes at most {cap}",
                              param=prompt_param, code="prompt_too_long")

    def check_policy(self, policy: KVPolicySpec) -> None:
        cap = self.limits.max_kv_budget
        if cap is not None and policy.budget is not None and policy.budget > cap:
            raise bad_request(f"kv_policy.budget: {policy.budget} tokens is above this server's cap of {cap}",
                              param="kv_policy.budget")

    def max_new_tokens(self, requested: Optional[int], resolved: int, param: str) -> int:
        """`resolved`: what the context allows; the server's cap bounds both."""
        cap = self.limits.max_tokens
        if requested is not None and requested > cap:
            raise bad_request(f"{param}: {requested} is above this server's cap of {cap}", param=param)
        return min(resolved, cap)
