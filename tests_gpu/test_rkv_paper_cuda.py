"""rkv/skipkv `scoring: "paper"` on a GPU (tests_gpu/: needs one), at
R1-Distill-Qwen-7B's attention shapes through the real decode pass
(tests/helpers/region_pass.py), as tests_gpu/test_region_pass_cuda.py checks
the graph-safe policies:

* CUDA-graph replay of the pass (the ring written in the attention segment,
  read in the group segments) equals the eager pass bit for bit;
* the pass makes no host sync;
* the cost of one layer's decision, "paper" against "fast", printed
  (pytest -s): budget 1024, 64 rows, bf16 keys and queries.

On the GPU host (see tests_gpu/README.md), from the project root:
    python3 -P -m pytest tests_gpu/test_rkv_paper_cuda.py -q -s -p no:cacheprovider
"""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch

from kvsieve.policies import Observations, PolicyBatch, SlotView, get_policy
from kvsieve.policies.observations import QUERY_WINDOW
from kvsieve.radix_ext.region_graphs import RegionGraphs

from helpers.region_pass import QWEN_7B, random_qkv, region_pass, run_steps


ROWS, PROMPT, STEPS, BUDGET = 64, 128, 48, 16
PAPER = {"scoring": "paper"}  # window 8 < budget 16: the scores choose


@pytest.mark.parametrize("policy", ["rkv", "skipkv"])
def test_paper_graph_replay_equals_the_eager_pass(policy):
    args = dict(rows=ROWS, prompt=PROMPT, steps=STEPS, shapes=QWEN_7B, budget=BUDGET, device="cuda",
                params=PAPER)
    eager = run_steps(policy, **args)
    graphs = RegionGraphs()
    graphed = run_steps(policy, **args, graphs=graphs)
    captures, replays = graphed["captures_replays"]
    assert captures > 0 and replays > 0 and graphs.group_replays > 0
    assert torch.equal(eager["outputs"], graphed["outputs"])
    for a, b in zip(eager["state"], graphed["state"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("policy", ["rkv", "skipkv"])
def test_paper_decode_pass_makes_no_host_sync(policy):
    run = region_pass(policy, ROWS, PROMPT, 32, shapes=QWEN_7B, budget=BUDGET, params=PAPER)
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


def _decision_ms(scoring: str, rows: int, budget: int, reps: int = 20) -> tuple[float, float]:
    """One layer's select_decode (every head full: every step evicts), ms per
    call, and peak MiB above the inputs."""
    cls = get_policy("rkv")
    H, Hq, D = QWEN_7B.kv_heads, QWEN_7B.q_heads, QWEN_7B.head_dim
    tensors, maxima = cls.batch_params([cls.Params(buffer=1, scoring=scoring)] * rows, "cuda")
    S = -(-(budget + 1) // 16) * 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    valid = torch.zeros(rows, H, S, dtype=torch.bool, device="cuda")
    valid[..., :budget + 1] = True
    position = torch.where(valid, torch.arange(S, device="cuda").expand(rows, H, S), -1)
    view = SlotView(valid=valid, position=position, score=torch.rand(rows, H, S, device="cuda", generator=gen),
                    last_hit=torch.full((rows, H, S), 8, dtype=torch.int32, device="cuda"),
                    keys=torch.randn(rows, H, S, D, device="cuda", generator=gen).to(torch.bfloat16))
    view.queries = torch.randn(rows, QUERY_WINDOW, Hq, D, device="cuda", generator=gen).to(torch.bfloat16)
    view.query_position = budget - torch.arange(QUERY_WINDOW, device="cuda").expand(rows, -1)
    batch = PolicyBatch(layer=0, budget=torch.full((rows, H), budget, device="cuda"),
                        step=torch.full((rows,), 100, device="cuda"), params=tensors, maxima=maxima)
    obs = Observations(attention=torch.rand(rows, H, S, device="cuda", generator=gen))
    policy = cls()
    policy.select_decode(batch, view, obs)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        policy.select_decode(batch, view, obs)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, (torch.cuda.max_memory_allocated() - base) / 2**20


@pytest.mark.parametrize("rows", [16, 64])
def test_decision_cost_paper_against_fast(rows):
    fast = _decision_ms("fast", rows, 1024)
    paper = _decision_ms("paper", rows, 1024)
    print(f"\nrkv decision, one layer, {rows} rows, budget 1024, {QWEN_7B.kv_heads} kv heads, "
          f"{QWEN_7B.q_heads} q heads, bf16: fast {fast[0]:.2f} ms ({fast[1]:.0f} MiB peak), "
          f"paper {paper[0]:.2f} ms ({paper[1]:.0f} MiB peak)")
    assert paper[0] > 0 and fast[0] > 0
