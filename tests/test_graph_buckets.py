"""Step shapes kept in buckets so that captured graphs replay under real
traffic, on CPU through the real step builder and backend pass
(tests/helpers/region_pass.py), graphs replayed by rerunning them:

* deciding groups padded with rows that are not due (Policy.pads_decisions,
  step_meta.decision_bucket): requests that joined at different steps
  reach their cadence (rkv's and skipkv's `buffer`, crystal_kv's
  `evict_interval`) at different steps, so the number of rows that decide
  changes from step to step; the padding rows' select_decode only observes;
* policy groups padded with rows of no request (StepBuilder.pad_groups,
  step_meta.row_bucket): requests joining and ending change the row count;
  padded rows read a page-table row of null pages and their outputs are
  dropped.
Either way every real row's output and the region's state must be the same
as without the padding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvsieve.policies import get_policy, policy_names
from kvsieve.radix_ext import region_graphs, step_meta
from kvsieve.radix_ext.region_graphs import RegionGraphs
from kvsieve.radix_ext.step_meta import MIN_DECISION_BUCKET, decision_bucket, row_bucket

from helpers.region_pass import TINY, _Mode, joining_steps, random_qkv, region_pass

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
                           req_pool_indices=torch.arange(1, len(run.rids) + 1), positions=seq - 1,
                           out_cache_loc=torch.zeros(len(run.rids), dtype=torch.int64))


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
                "sizes": sizes, "replays": graphs.replays, "captures": graphs.captures,
                "group_replays": graphs.group_replays, "group_entries": graphs.group_entries,
                "group_evictions": graphs.group_evictions, "group_recaptures": graphs.group_recaptures}
    finally:
        run.close()


@pytest.mark.parametrize("policy", PADDED)
def test_padded_decisions_change_nothing_but_the_shapes(policy, monkeypatch):
    assert get_policy(policy).pads_decisions
    monkeypatch.setattr(region_graphs, "MAX_GROUP_SHAPES", 4)  # fewer than the group shapes unpadded
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
    # Unpadded, the groups' shapes (six deciding sizes, six observing) take
    # turns, more than the cache keeps here: most group segments run
    # eagerly. Padded, all but the first steps replay them (an eager step
    # and a capture step per shape). The attention segment's shapes (every
    # row) do not change here: it replays either way.
    assert exact["group_replays"] <= STEPS * TINY.layers // 2
    assert padded["group_replays"] >= (STEPS - 6) * TINY.layers * 2
    assert min(exact["replays"], padded["replays"]) >= (STEPS - 2) * TINY.layers
    # The step log's counters say which: unpadded, the cache of 4 drops
    # segments and makes them again; padded, every segment is made once.
    assert exact["group_evictions"] == exact["group_entries"] - 4 and exact["group_recaptures"] > 10
    assert (padded["group_entries"], padded["group_evictions"], padded["group_recaptures"]) == (2, 0, 0)


# ----- row buckets ------------------------------------------------------------------

GRAPH_SAFE = [n for n in policy_names() if get_policy(n).compresses and get_policy(n).graph_safe]
ROWS = 20
#: Row i decodes in steps [START[i], END[i]): rows join and end all along.
START = [2 * (i % 5) for i in range(ROWS)]
END = [STEPS - 3 * (i % 4) for i in range(ROWS)]


def test_row_bucket():
    assert [row_bucket(n) for n in (0, 1, 2, 3, 5, 8, 9, 16, 17, 256, 257, 640, 641)] == \
        [0, 1, 2, 4, 8, 8, 16, 16, 32, 256, 320, 640, 704]


def run_joining(policy: str, pad: bool) -> dict:
    """STEPS decode steps of rows joining and ending, policy groups padded
    to row buckets or not, graphs replayed by rerunning them."""
    return joining_steps(policy, START, END, STEPS, prompt=PROMPT, shapes=TINY, budget=BUDGET, device="cpu",
                         dtype=torch.float32, graphs=RerunGraphs(), pad=pad)


@pytest.mark.parametrize("policy", GRAPH_SAFE)
def test_padded_rows_change_no_real_row(policy, monkeypatch):
    # The prefix table's width bucketed too (prefix_bucket) is checked below:
    # on the PyTorch reference a wider table of masked columns changes the
    # matmuls' summation order, so only padded rows are compared bit for bit.
    monkeypatch.setattr(step_meta, "prefix_bucket", lambda tokens: tokens)
    padded, exact = run_joining(policy, pad=True), run_joining(policy, pad=False)
    for step, (a, b) in enumerate(zip(padded["outputs"], exact["outputs"])):
        assert torch.equal(a, b), f"step {step}"
    for a, b in zip(padded["state"], exact["state"]):
        assert torch.equal(a, b)
    assert sum(exact["padded"]) == 0 and sum(padded["padded"]) > 0
    # Rows join in the first steps and end in the last ones: unpadded, the
    # shapes change at each; padded, the steps in between replay more.
    assert padded["replays"] > exact["replays"]


def test_policy_classes_share_their_padded_rows(monkeypatch):
    # Three classes of 6-7 joining and ending rows: each pads to its own
    # bucket, and the step grows by the most one class needs (then to a
    # multiple of ROWS_STEP), not by their sum; no real row changes.
    monkeypatch.setattr(step_meta, "prefix_bucket", lambda tokens: tokens)
    mix = "h2o+streaming+rkv"
    padded, exact = run_joining(mix, pad=True), run_joining(mix, pad=False)
    for step, (a, b) in enumerate(zip(padded["outputs"], exact["outputs"])):
        assert torch.equal(a, b), f"step {step}"
    for a, b in zip(padded["state"], exact["state"]):
        assert torch.equal(a, b)
    for s, extra in enumerate(padded["padded"]):
        active = [i for i in range(ROWS) if START[i] <= s < END[i]]
        per_class = [sum(1 for i in active if i % 3 == c) for c in range(3)]
        most = max(row_bucket(n) - n for n in per_class)
        assert extra == most + (-(len(active) + most) % step_meta.ROWS_STEP), f"step {s}"
    assert padded["replays"] > exact["replays"]


def test_a_bucketed_prefix_width_reads_the_same_keys():
    # Prompts of 8 tokens in a prefix table 128 wide: the same attention up
    # to the reference path's summation order.
    assert step_meta.prefix_bucket(8) == 128 and step_meta.prefix_bucket(129) == 256
    # Past 512 tokens two widths per doubling: a `full` row growing from 64
    # to 2,112 tokens restarts the step's graphs 9 times, not 17.
    assert [step_meta.prefix_bucket(t) for t in (512, 513, 769, 1025, 2049)] == [512, 768, 1024, 1536, 3072]
    assert len({step_meta.prefix_bucket(t) for t in range(64, 2113)}) == 9
    padded, exact = run_joining("streaming", pad=True), run_joining("streaming", pad=False)
    assert padded["outputs"][0].shape == exact["outputs"][0].shape
    for a, b in zip(padded["outputs"], exact["outputs"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_a_step_with_full_rows_keeps_the_planned_prefix_width():
    # `full` rows grow their prefix a token a step: their steps use the
    # planned width (memory_plan.fold_max_tokens) at any length, so growth
    # never restarts the captured attention; prompts alone are bucketed.
    builder = step_meta.StepBuilder(None, torch.zeros((2, 8192), dtype=torch.int32), "cpu", pad_rows=True)
    builder.fold_max_tokens = 4096
    assert {builder._decode_prefix_width(t, pool_only=True) for t in range(321, 4097)} == {4096}
    assert builder._decode_prefix_width(100, pool_only=False) == 128
    # A prompt past the planned width: as wide as it is (no bucket past the
    # plan), and a bucket never past the token pool's rows.
    assert builder._decode_prefix_width(5000, pool_only=False) == 5000
    builder.fold_max_tokens = 0  # nothing planned: buckets
    assert builder._decode_prefix_width(7000, pool_only=False) == 8192
    assert builder._decode_prefix_width(300, pool_only=True) == 384


def test_thinkv_padded_decisions_change_nothing(monkeypatch):
    # Rows that join at different steps cut at different steps; a row that
    # cuts nothing may run select_decode in a padded deciding group.
    monkeypatch.setattr(step_meta, "prefix_bucket", lambda tokens: tokens)
    thinkv = get_policy("thinkv")
    assert thinkv.pads_decisions
    padded = run_joining("thinkv", pad=False)
    monkeypatch.setattr(thinkv, "pads_decisions", False)
    exact = run_joining("thinkv", pad=False)
    for a, b in zip(padded["outputs"], exact["outputs"]):
        assert torch.equal(a, b)
    for a, b in zip(padded["state"], exact["state"]):
        assert torch.equal(a, b)
    assert padded["replays"] > exact["replays"]


def test_group_segments_read_again_after_the_page_table_grew_are_counted_stale():
    # The page table grows by reallocation (requests growing towards their
    # budgets): group graphs read the old one and are captured again. The
    # step log counts those segments (`group_stale`) apart from new shapes.
    torch.manual_seed(0)
    graphs = RerunGraphs()
    run = region_pass("rkv", len(PHASES), PROMPT, STEPS + 16, shapes=TINY, budget=BUDGET, device="cpu",
                      dtype=torch.float32, graphs=graphs)
    try:
        gen = torch.Generator().manual_seed(0)
        for s in range(6):
            run.run_batch(staggered_batch(run, s), *random_qkv(len(PHASES), TINY, gen, "cpu", torch.float32))
        assert graphs.group_stale == 0 and graphs.group_captures > 0
        version = graphs.table_version
        graphs.watch_table(torch.zeros(1))  # as a reallocated table would
        captures = graphs.group_captures
        run.run_batch(staggered_batch(run, 6), *random_qkv(len(PHASES), TINY, gen, "cpu", torch.float32))
        assert graphs.table_version == version + 2  # the stand-in, then the real table again
        assert graphs.group_stale >= 1 and graphs.group_captures > captures
        assert graphs.group_evictions == 0 and graphs.group_recaptures == 0
    finally:
        run.close()
