"""Deciding groups padded to buckets (Policy.pads_decisions,
step_meta.decision_bucket), on CPU through the real step builder and
backend pass (tests/helpers/region_pass.py).

Requests that joined at different steps reach their cadence (rkv's and
skipkv's `buffer`, crystal_kv's `evict_interval`) at different steps, so
the number of rows that decide changes from step to step, and with it the
step's shapes: graph entries are captured and dropped instead of replayed.
Padding the deciding group with rows whose decision is not due keeps the
shapes, and must change nothing else: those rows' select_decode only
observes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvsieve.policies import get_policy
from kvsieve.radix_ext.region_graphs import RegionGraphs
from kvsieve.radix_ext.step_meta import MIN_DECISION_BUCKET, decision_bucket

from helpers.region_pass import TINY, _Mode, random_qkv, region_pass

PADDED = ["rkv", "skipkv", "crystal_kv"]
# Cadence phase p (0..15) holds p % 6 + 1 rows: between 1 and 6 rows are due
# in a step, more distinct step shapes than the graph cache keeps (4).
PHASES = [p for p in range(16) for _ in range(p % 6 + 1)]
PROMPT, STEPS, BUDGET = 8, 40, 8


class RerunGraphs(RegionGraphs):
    """A "graph" replays by running the captured pass again on the entry's
    static tensors (CUDA recording is the one part that needs a GPU)."""

    def capture(self, static_pass):
        return SimpleNamespace(replay=static_pass)


def test_decision_bucket():
    assert decision_bucket(0, 50) == 0 and decision_bucket(50, 50) == 50
    assert [decision_bucket(n, 100) for n in (1, MIN_DECISION_BUCKET, 9, 16, 17, 40, 64, 65)] == \
        [8, 8, 16, 16, 32, 64, 64, 100]
    assert decision_bucket(5, 6) == 6  # the bucket is past the group: all of it decides


def staggered_batch(run, s: int) -> SimpleNamespace:
    """Decode step s of the batch, row i at its own step s + PHASES[i]."""
    seq = torch.tensor([run.prompt + s + phase + 1 for phase in PHASES])
    return SimpleNamespace(rids=run.rids, forward_mode=_Mode(decode=True), seq_lens_cpu=seq, seq_lens=seq,
                           req_pool_indices=torch.arange(1, len(run.rids) + 1), positions=seq - 1)


def run_staggered(policy: str) -> dict:
    torch.manual_seed(0)
    graphs = RerunGraphs()
    run = region_pass(policy, len(PHASES), PROMPT, STEPS + 16, shapes=TINY, budget=BUDGET, device="cpu",
                      dtype=torch.float32, graphs=graphs)
    try:
        gen = torch.Generator().manual_seed(0)
        sizes, outputs = [], []
        for s in range(STEPS):
            batch = staggered_batch(run, s)
            outputs.append(run.run_batch(batch, *random_qkv(len(PHASES), TINY, gen, "cpu", torch.float32)))
            sizes.append(tuple((g.action, len(g.members)) for g in run.last_step.region.groups))
        return {"outputs": torch.stack(outputs), "state": run.region_state(), "held": run.held_tokens_per_head(),
                "sizes": sizes, "replays": graphs.replays, "captures": graphs.captures}
    finally:
        run.close()


@pytest.mark.parametrize("policy", PADDED)
def test_padded_decisions_change_nothing_but_the_shapes(policy, monkeypatch):
    assert get_policy(policy).pads_decisions
    padded = run_staggered(policy)
    monkeypatch.setattr(get_policy(policy), "pads_decisions", False)
    exact = run_staggered(policy)
    # The same tokens attended, the same slots evicted, the same slot state.
    assert torch.equal(padded["outputs"], exact["outputs"])
    for a, b in zip(padded["state"], exact["state"]):
        assert torch.equal(a, b)
    cls = get_policy(policy)
    ceiling = cls().max_private_tokens(cls.Params(), 0, STEPS + 16, BUDGET)
    assert max(padded["held"]) <= ceiling
    # Unpadded, the deciding group takes 1..6 rows; padded, always 8 (or none).
    decide = {dict(s).get("decide", 0) for s in exact["sizes"]}
    assert {1, 2, 3, 4, 5, 6} <= decide
    assert {dict(s).get("decide", 0) for s in padded["sizes"]} <= {0, MIN_DECISION_BUCKET}
    # Unpadded, no two consecutive steps share their shapes: every step runs
    # eagerly. Padded, all but the first steps replay (an eager step and a
    # capture step per shape).
    assert exact["replays"] == 0
    assert padded["replays"] >= (STEPS - 4) * TINY.layers
