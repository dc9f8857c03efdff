"""Padded rows on a GPU (step_meta.row_bucket, StepBuilder.pad_groups), outside
SGLang (tests/helpers/region_pass.py), at R1-Distill-Qwen-7B's attention
shapes: 48 rows joining over the first steps and ending over the last ones,
budget 16, every `graph_safe` policy. With policy groups padded and the
pass replayed from real CUDA graphs, every real row's output and the
region's state equal the eager pass without padding, bit for bit (the
prefix table's width is left unbucketed: it changes the decode kernel's
split of the keys, so its sums' order). tests/test_graph_buckets.py checks
the same on CPU with graphs replayed by rerunning them."""

from __future__ import annotations

import pytest
import torch

from kvsieve.policies import get_policy, policy_names
from kvsieve.radix_ext import step_meta
from kvsieve.radix_ext.region_graphs import RegionGraphs

from helpers.region_pass import QWEN_7B, joining_steps

GRAPH_SAFE = [n for n in policy_names() if get_policy(n).compresses and get_policy(n).graph_safe]
ROWS, PROMPT, STEPS, BUDGET = 48, 128, 64, 16
START = [3 * (i % 8) for i in range(ROWS)]
END = [STEPS - 4 * (i % 6) for i in range(ROWS)]


@pytest.mark.parametrize("policy", GRAPH_SAFE)
def test_padded_rows_replayed_change_no_real_row(policy, monkeypatch):
    monkeypatch.setattr(step_meta, "prefix_bucket", lambda tokens: tokens)
    args = dict(prompt=PROMPT, shapes=QWEN_7B, budget=BUDGET, device="cuda", dtype=torch.bfloat16)
    padded = joining_steps(policy, START, END, STEPS, **args, graphs=RegionGraphs(), pad=True)
    eager = joining_steps(policy, START, END, STEPS, **args, graphs=None, pad=False)
    assert sum(padded["padded"]) > 0 and padded["replays"] > 0
    for step, (a, b) in enumerate(zip(padded["outputs"], eager["outputs"])):
        assert torch.equal(a, b), f"step {step}"
    for a, b in zip(padded["state"], eager["state"]):
        assert torch.equal(a, b)
