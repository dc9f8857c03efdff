"""The compressed decode pass on a GPU, outside SGLang (tests/helpers/
region_pass.py: the real page manager, step builder and backend pass):

* CUDA-graph replay (radix_ext/region_graphs.py) equals the eager pass, bit
  for bit, in every layer's output and in the region's final state, for
  every policy marked `graph_safe`; skipkv also with redundant sentences, so
  that the replayed pass drops whole sentences. A policy sets `graph_safe`
  only once this passes for it.
* The pass makes no host sync (torch.cuda's sync debug mode).

At R1-Distill-Qwen-7B's attention shapes, 64 rows, budget 16 (every policy
evicts). These need CUDA and are skipped without it; on a GPU host
(../shared/gpu/README.md) run `python -m pytest tests/test_region_pass_gpu.py`.
The first test runs the same harness on CPU at tiny shapes, so it stays in
step with the backend in every CI run."""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch

from kvsieve.policies import get_policy, policy_names
from kvsieve.policies.observations import to_device
from kvsieve.radix_ext.region_graphs import RegionGraphs

from helpers.region_pass import QWEN_7B, TINY, random_qkv, region_pass

GRAPH_SAFE = [n for n in policy_names() if get_policy(n).compresses and get_policy(n).graph_safe]
ROWS, PROMPT, STEPS, BUDGET = 64, 128, 48, 16
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and host syncs exist only on a GPU")


@pytest.mark.parametrize("policy", GRAPH_SAFE)
def test_the_harness_runs_the_pass_on_cpu_and_holds_the_budget(policy):
    steps, budget = 16, 8
    run = region_pass(policy, rows=3, prompt=8, steps=steps, shapes=TINY, budget=budget, device="cpu",
                      dtype=torch.float32)
    try:
        gen = torch.Generator().manual_seed(0)
        for s in range(steps):
            out = run.step(s, *random_qkv(3, TINY, gen, "cpu", torch.float32))
            assert torch.isfinite(out).all()
        held = run.held_tokens_per_head()
        if policy == "snapkv":  # selects at prefill only: every generated token stays
            assert held == [steps] * 3
        else:  # at most the policy's ceiling per (layer, kv head): the budget, its slack and the new token
            cls = get_policy(policy)
            ceiling = cls().max_private_tokens(cls.Params(), 0, steps, budget)
            assert all(n <= ceiling for n in held) and max(held) > 0
    finally:
        run.close()


def _replay_or_eager(policy: str, graphs: bool) -> dict:
    torch.manual_seed(0)  # the token pool's random prefix K/V: the same in both runs
    run = region_pass(policy, ROWS, PROMPT, STEPS, shapes=QWEN_7B, budget=BUDGET,
                      graphs=RegionGraphs() if graphs else None)
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        outputs = torch.stack([run.step(s, *random_qkv(ROWS, QWEN_7B, gen, "cuda")) for s in range(STEPS)])
        torch.cuda.synchronize()
        stats = (run.backend.graphs.captures, run.backend.graphs.replays) if graphs else (0, 0)
        return {"outputs": outputs, "state": run.region_state(), "captures_replays": stats}
    finally:
        run.close()


def _assert_replay_equals_eager(policy: str) -> None:
    eager = _replay_or_eager(policy, graphs=False)
    graphed = _replay_or_eager(policy, graphs=True)
    captures, replays = graphed["captures_replays"]
    assert captures > 0 and replays > 0
    assert torch.equal(eager["outputs"], graphed["outputs"])
    for a, b in zip(eager["state"], graphed["state"]):
        assert torch.equal(a, b)


@cuda
@pytest.mark.parametrize("policy", GRAPH_SAFE)
def test_graph_replay_equals_the_eager_pass(policy):
    _assert_replay_equals_eager(policy)


@cuda
def test_skipkv_graph_replay_equals_the_eager_pass_with_redundant_sentences(monkeypatch):
    """No forward runs here, so no sentence ever ends and skipkv's spans stay
    empty; this hands every row four redundant sentences over its generated
    positions, in a different eviction order per row."""
    def spans_for_every_row(self, rows, device):
        R = len(rows)
        starts = torch.tensor([[PROMPT + 2, PROMPT + 8, PROMPT + 14, PROMPT + 22]] * R)
        ends = starts + torch.tensor([4, 5, 7, 3])
        penalty = torch.tensor([[0.95, 0.93, 0.97, 0.91]] * R)
        rank = torch.tensor([[(i + r) % 4 for i in range(4)] for r in range(R)])
        return {"span_starts": to_device(starts, torch.int64, device), "span_ends": to_device(ends, torch.int64, device),
                "span_penalty": to_device(penalty, torch.float32, device),
                "span_rank": to_device(rank, torch.int64, device)}

    monkeypatch.setattr(get_policy("skipkv"), "step_inputs", spans_for_every_row)
    _assert_replay_equals_eager("skipkv")


@cuda
@pytest.mark.parametrize("policy", GRAPH_SAFE)
def test_the_decode_pass_makes_no_host_sync(policy):
    """From the step's metadata to the last layer's eviction; the fake
    ForwardBatch (SGLang's, already on the device) is made before."""
    run = region_pass(policy, ROWS, PROMPT, 32, shapes=QWEN_7B, budget=BUDGET)
    syncs: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            ours = [f for f in traceback.extract_stack()[:-1] if "site-packages" not in f.filename
                    and "/lib/python" not in f.filename and "region_pass" not in f.filename]
            syncs.append(f"{ours[-1].filename}:{ours[-1].lineno} {ours[-1].line}" if ours else "?")

    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        for s in range(32):
            batch, qkv = run.batch(s), random_qkv(ROWS, QWEN_7B, gen, "cuda")
            torch.cuda.synchronize()
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record if s >= 2 else (lambda *a, **k: None)  # first steps allocate
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    run.run_batch(batch, *qkv)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
    finally:
        run.close()
    assert syncs == []
