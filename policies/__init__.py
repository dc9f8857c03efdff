"""Compression policies: pure PyTorch, engine-agnostic (import kvsieve.policies)."""

from . import full  # noqa: F401  (registers the policy)
from .base import Policy, PolicyParams
from .registry import get_policy, policy_names, register_policy
from .spec import FULL, KVPolicyError, KVPolicySpec, parse_kv_policy

__all__ = [
    "FULL",
    "KVPolicyError",
    "KVPolicySpec",
    "Policy",
    "PolicyParams",
    "get_policy",
    "parse_kv_policy",
    "policy_names",
    "register_policy",
]
