"""`full`: no compression. The request takes SGLang's own KV path."""

from __future__ import annotations

from .base import Policy
from .registry import register_policy


@register_policy
class FullPolicy(Policy):
    name = "full"
    compresses = False
    takes_budget = False
    description = "No compression: every KV entry is kept (SGLang's own path)."
