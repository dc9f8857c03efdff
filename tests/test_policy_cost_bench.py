"""bench/policy_cost.py runs every registered compressing policy's decode
decision on its random fixtures, so a policy registered later is timed (or
gets a FIXTURES hook) rather than silently missing from policy-cost.json."""

import importlib.util
from pathlib import Path

import pytest

from kvsieve.policies import get_policy, policy_names

_spec = importlib.util.spec_from_file_location("policy_cost", Path(__file__).parents[1] / "bench/policy_cost.py")
policy_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(policy_cost)

TINY = dict(model="tiny", layers=2, kv_heads=2, q_heads=4, head_dim=8)


@pytest.mark.parametrize("name", [n for n in policy_names() if get_policy(n).compresses])
def test_every_compressing_policy_runs_in_the_cost_bench(name):
    ms = policy_cost.time_policy(name, rows=3, shape=TINY, budget=8, device="cpu", steps=1)
    assert ms >= 0.0


def test_batch_256_on_the_gpu_is_timed_against_a_lower_bound_of_its_step():
    base, source = policy_cost.step_ms("cuda", 256, {})
    assert base == policy_cost.step_ms("cuda", 64, {})[0] and "upper bound" in source
    assert policy_cost.step_ms("cuda", 256, {256: 41.5}) == (41.5, "--step-ms")
