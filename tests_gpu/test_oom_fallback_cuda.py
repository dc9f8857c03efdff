"""Out of GPU memory inside a decision, for real (radix_ext/faults.py,
backend._group_pass, region_graphs._try_capture): a policy whose decision
over more than LIMIT rows allocates more than the GPU has. The pass retries
on halves of the group down to LIMIT rows and gives the eager result of a
policy that never ran out; inside a CUDA-graph capture the capture is
dropped and those shapes stay eager, with the same outputs. 64 rows at
R1-Distill-Qwen-7B's attention shapes (tests/helpers/region_pass.py)."""

from __future__ import annotations

import pytest
import torch

from kvsieve.policies import register_policy, registry
from kvsieve.policies.h2o import H2OPolicy
from kvsieve.radix_ext import metrics
from kvsieve.radix_ext.region_graphs import RegionGraphs

from helpers.region_pass import QWEN_7B, run_steps

LIMIT = 16


class OutOfMemoryOverRows(H2OPolicy):
    name = "test_oom_over_rows"
    graph_safe = True
    description = "Test policy: H2O whose decision over more than 16 rows runs the GPU out of memory."

    def select_decode(self, batch, view, obs):
        if batch.step.shape[0] > LIMIT:
            # More than the whole GPU: out of memory whatever the caching
            # allocator holds free from earlier tests in this process.
            total = torch.cuda.get_device_properties(0).total_memory
            torch.empty(total + 2**30, dtype=torch.uint8, device="cuda")  # torch.OutOfMemoryError
        return super().select_decode(batch, view, obs)


@pytest.fixture(autouse=True)
def oom_policy():
    """Registered for these tests only: graph_safe, it would otherwise join
    test_region_pass_cuda.py's policies (collected after this module)."""
    register_policy(OutOfMemoryOverRows)
    yield
    registry._POLICIES.pop(OutOfMemoryOverRows.name, None)


ARGS = dict(rows=64, prompt=128, steps=24, shapes=QWEN_7B, budget=16, device="cuda")


def _retries() -> float:
    return sum(s.value for m in metrics.DECISION_RETRIES.collect() for s in m.samples
               if s.name.endswith("_total") and s.labels.get("policy") == OutOfMemoryOverRows.name)


def test_a_decision_out_of_memory_is_retried_on_smaller_chunks():
    reference = run_steps("h2o", **ARGS)
    before = _retries()
    got = run_steps(OutOfMemoryOverRows.name, **ARGS)
    assert _retries() > before
    assert torch.equal(reference["outputs"], got["outputs"])
    for a, b in zip(reference["state"], got["state"]):
        assert torch.equal(a, b)


def test_out_of_memory_while_capturing_leaves_the_shapes_eager():
    reference = run_steps("h2o", **ARGS)
    graphs = RegionGraphs()
    got = run_steps(OutOfMemoryOverRows.name, **ARGS, graphs=graphs)
    # The group's segment could not be captured: it runs eagerly from then
    # on, between replays of the attention segment.
    assert any(g.eager for g in graphs.groups.values()), "the failed capture was not recorded"
    assert graphs.group_replays == 0 and graphs.replays > 0
    assert torch.equal(reference["outputs"], got["outputs"])
    for a, b in zip(reference["state"], got["state"]):
        assert torch.equal(a, b)
