"""The cases TP 2 is checked against TP 1 on: one per registered policy, so a
newly registered policy is covered without editing this list, plus the
variants that exercise other code paths.

Used by tests/test_tensor_parallel.py (CPU, CI) and bench/tp_gpu_check.py
(the same cases on two GPUs). A case is (kv_policy, max_tokens); its prompt
depends on its index (`tp_prompt`), so cases keep their order.
"""

from __future__ import annotations

import kvsieve.policies.catalog  # noqa: F401  (imports every built-in policy into the registry)
from kvsieve.policies.registry import get_policy, policy_names

# Cases a policy's default (budget 8, 24 tokens) would not exercise well.
SPECIAL = {
    "full": ("full", 24),
    # Prompt in the region, cut layer-wide at its end.
    "longflow": ({"name": "longflow", "budget": 8}, 24),
    # Segments of 8 steps: closed segments anneal (TBE) within the budget.
    # With the default refresh 128 a budget of 10 cuts the open segment at
    # every step once it holds 11 (policies/thinkv/segments.py, last
    # resort), a k-means keeping 10 of 11 keys: a near tie that the float
    # order of one rank's heads against two's flipped (2026-11-27).
    "thinkv": ({"name": "thinkv", "budget": 10, "params": {"refresh": 8}}, 24),
    # One index set from every rank's first-layer heads: a 200-token prompt
    # cut to 132 at its end (the probe), then a breath cycle at step 64.
    "crystalcache": ({"name": "crystalcache", "budget": 132}, 72),
}
# The order the cases ran in before the list came from the registry: their
# prompts (which depend on the index) are known to have no near-tied scores
# that the all-reduce's float order could flip.
FIRST = ["full", "longflow", "longflow-noprompt", "thinkv", "h2o", "skipkv", "rkv", "crystalcache", "crystal_kv"]
VARIANTS = {
    "longflow-noprompt": ({"name": "longflow", "budget": 8, "compress_prompt": False}, 24),
    # A covering budget: equal to full.
    "longflow-covering": ({"name": "longflow", "budget": 256}, 24),
}


# The covering case runs last, so its index moves as policies register; its
# prompt is pinned to a first id probed free of ties (TP 2 equals TP 1 even
# with no eviction: the model alone flips first ids 368 and 363 on this prompt).
COVERING_FIRST_ID = 345


def policy_case(name: str) -> tuple:
    if name in SPECIAL:
        return SPECIAL[name]
    if not get_policy(name).takes_budget:
        return (name, 24)
    return ({"name": name, "budget": 8}, 24)


def tp_cases() -> list[tuple]:
    """Every registered policy's case (the known order first, then the rest
    by name), the variants, and the covering budget last."""
    registered = policy_names()
    order = [k for k in FIRST if k in VARIANTS or k in registered]
    order += [name for name in registered if name not in order]
    return [VARIANTS[k] if k in VARIANTS else policy_case(k) for k in order] + [VARIANTS["longflow-covering"]]


def tp_prompt(index: int, policy) -> list[int]:
    """Distinct first ids (no radix hits between cases), all below the tiny
    tokenizer's 512 ids; crystalcache gets a 200-token prompt. (On the
    random model near-tied scores can flip between TP 1 and TP 2 through the
    all-reduce's float order: h2o at budget 132 on this prompt does, though
    it reads one head at a time. This prompt has no such tie; a disagreement
    between ranks shows at once.)"""
    if isinstance(policy, dict) and policy["name"] == "crystalcache":
        return [362] + [(37 * k) % 400 + 1 for k in range(199)]
    first = COVERING_FIRST_ID if policy == VARIANTS["longflow-covering"][0] else 379 - index
    return [first, 12, 250, 31, 8, 77, 190, 64]


def case_label(policy) -> str:
    if isinstance(policy, str):
        return policy
    label = f"{policy['name']}-{policy['budget']}"
    return label + "-noprompt" if policy.get("compress_prompt") is False else label
