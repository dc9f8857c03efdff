"""The compressed decode pass on a GPU, outside SGLang (tests/helpers/
region_pass.py: the real page manager, step builder and backend pass), at
R1-Distill-Qwen-7B's attention shapes, 64 rows, budget 16 (every policy
evicts), for every policy marked `graph_safe`:

* CUDA-graph replay (radix_ext/region_graphs.py) equals the eager pass, bit
  for bit, in every layer's output and in the region's final state; skipkv
  also with redundant sentences, so that the replayed pass drops whole
  sentences. A policy sets `graph_safe` only once this passes for it.
  crystalcache (`observe_graph_safe`) across breath cycles: its steps
  between cycles replay, its two deciding steps per cycle run eagerly.
* The pass makes no host sync (torch.cuda's sync debug mode); for
  crystalcache on the steps between its breath cycles."""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch

from kvsieve.policies import get_policy, policy_names
from kvsieve.radix_ext.region_graphs import RegionGraphs

from helpers.region_pass import QWEN_7B, random_qkv, redundant_sentences, region_pass, run_steps

GRAPH_SAFE = [n for n in policy_names() if get_policy(n).compresses and get_policy(n).graph_safe]
ROWS, PROMPT, STEPS, BUDGET = 64, 128, 48, 16


def _assert_replay_equals_eager(policy: str) -> None:
    args = dict(rows=ROWS, prompt=PROMPT, steps=STEPS, shapes=QWEN_7B, budget=BUDGET, device="cuda")
    eager = run_steps(policy, **args)
    graphed = run_steps(policy, **args, graphs=RegionGraphs())
    captures, replays = graphed["captures_replays"]
    assert captures > 0 and replays > 0
    assert torch.equal(eager["outputs"], graphed["outputs"])
    for a, b in zip(eager["state"], graphed["state"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("policy", GRAPH_SAFE)
def test_graph_replay_equals_the_eager_pass(policy):
    _assert_replay_equals_eager(policy)


def test_a_mixed_batch_replays_its_segments_equal_to_the_eager_pass():
    # Every graph-safe policy in one batch (rows dealt in turn): the set of
    # deciding groups changes from step to step; each segment replays.
    args = dict(rows=ROWS, prompt=PROMPT, steps=STEPS, shapes=QWEN_7B, budget=BUDGET, device="cuda")
    mixed = "+".join(GRAPH_SAFE)
    eager = run_steps(mixed, **args)
    graphs = RegionGraphs()
    graphed = run_steps(mixed, **args, graphs=graphs)
    assert graphs.replays > QWEN_7B.layers * STEPS // 2 and graphs.group_replays > QWEN_7B.layers * STEPS
    assert torch.equal(eager["outputs"], graphed["outputs"])
    for a, b in zip(eager["state"], graphed["state"]):
        assert torch.equal(a, b)


def test_a_mixed_batch_with_groups_after_the_stack_replays_equal_to_the_eager_pass():
    # RegionGraphs.defer_groups: attention per layer, then each group's
    # every layer as one captured graph (what a decode step does where the
    # decoder stack is captured whole).
    args = dict(rows=ROWS, prompt=PROMPT, steps=STEPS, shapes=QWEN_7B, budget=BUDGET, device="cuda")
    mixed = "+".join(GRAPH_SAFE)
    eager = run_steps(mixed, **args)
    graphs = RegionGraphs()
    graphs.defer_groups = True
    graphed = run_steps(mixed, **args, graphs=graphs)
    assert graphs.replays > QWEN_7B.layers * STEPS // 2 and graphs.group_replays > QWEN_7B.layers * STEPS
    assert torch.equal(eager["outputs"], graphed["outputs"])
    for a, b in zip(eager["state"], graphed["state"]):
        assert torch.equal(a, b)


def test_skipkv_graph_replay_equals_the_eager_pass_with_redundant_sentences(monkeypatch):
    monkeypatch.setattr(get_policy("skipkv"), "step_inputs", redundant_sentences(PROMPT))
    _assert_replay_equals_eager("skipkv")


def test_crystalcache_graph_replay_equals_the_eager_pass_across_breath_cycles():
    # observe_graph_safe: the steps between cycles replay; breath 16 and
    # budget 62 make cycles at steps 64, 80 and 96 evict.
    args = dict(rows=ROWS, prompt=PROMPT, steps=100, shapes=QWEN_7B, budget=62, device="cuda",
                params={"sinks": 0, "recent": 0, "breath": 16}, token_ids=True)
    eager = run_steps("crystalcache", **args)
    graphed = run_steps("crystalcache", **args, graphs=RegionGraphs())
    captures, replays = graphed["captures_replays"]
    assert captures > 0 and replays > QWEN_7B.layers * 50
    assert torch.equal(eager["outputs"], graphed["outputs"])
    for a, b in zip(eager["state"], graphed["state"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("policy", GRAPH_SAFE)
def test_the_decode_pass_makes_no_host_sync(policy):
    """From the step's metadata to the last layer's eviction; the fake
    ForwardBatch (SGLang's, already on the device) is made before."""
    _assert_no_host_sync(policy, BUDGET)


def test_a_mixed_decode_pass_makes_no_host_sync():
    # Every graph-safe policy in one batch: a mixed step splits its rows
    # into a group per policy (and per deciding/observing), work the solo
    # runs above never do. A mixed batch of 128 rows spent ~10 ms a step on
    # the host with the GPU idle (bench/results/logs/h200-2026-11-29c/).
    _assert_no_host_sync("+".join(GRAPH_SAFE), BUDGET)


def test_crystalcache_steps_between_breath_cycles_make_no_host_sync():
    # 32 steps of the default breath (64): every step observes, tokens
    # handed over once per forward; the reads of a cycle step are between steps.
    _assert_no_host_sync("crystalcache", 132, token_ids=True)


def _assert_no_host_sync(policy: str, budget: int, token_ids: bool = False) -> None:
    run = region_pass(policy, ROWS, PROMPT, 32, shapes=QWEN_7B, budget=budget, token_ids=token_ids)
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
