"""Compression policies: pure PyTorch, engine-agnostic (import kvsieve.policies)."""

# One module per simple policy, one package per seed method (thinkv, crystal_kv,
# skipkv with rkv, crystalcache): importing them registers the policies.
from . import full, h2o, longflow, snapkv, streaming  # noqa: F401
from . import crystal_kv, crystalcache, skipkv, thinkv  # noqa: F401
from .base import Policy, PolicyParams, RequestState
from .observations import Need, Observations, PolicyBatch, PromptAttention, SlotView
from .registry import POLICY_MODULES_ENV, get_policy, load_policy_modules, policy_names, register_policy
from .spec import FULL, KVPolicyError, KVPolicySpec, parse_kv_policy

__all__ = [
    "FULL",
    "KVPolicyError",
    "POLICY_MODULES_ENV",
    "KVPolicySpec",
    "Need",
    "Observations",
    "Policy",
    "PolicyBatch",
    "PolicyParams",
    "RequestState",
    "SlotView",
    "get_policy",
    "load_policy_modules",
    "parse_kv_policy",
    "policy_names",
    "register_policy",
]
