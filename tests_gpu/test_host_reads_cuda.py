"""The end-of-think marker watch of crystal_kv makes no host sync on a GPU:
the ids of every watching request of a forward are gathered and copied to
pinned host memory behind an event (policies/host_reads.py) and matched a
forward later."""

import warnings

import torch

from kvsieve.policies.base import ModelInfo, StepRow
from kvsieve.policies.crystal_kv.policy import CrystalKVPolicy

ROWS = 640


def test_the_marker_watch_waits_for_no_kernel():
    policy = CrystalKVPolicy()
    policy.bind_model(ModelInfo(name="t", num_layers=1, num_kv_heads=1, num_q_heads=1, head_dim=4,
                                delimiter_ids=frozenset(), encode=lambda text: [7, 8]))
    states = [policy.begin_request(CrystalKVPolicy.Params(), 1, 1) for _ in range(ROWS)]
    rows = [StepRow(s, step=1, pool_row=r, budget=4, prefill=False) for r, s in enumerate(states)]
    requests = [(s, r, 1) for r, s in enumerate(states)]
    first = torch.full((ROWS,), 7, device="cuda")
    second = torch.where(torch.arange(ROWS, device="cuda") % 2 == 0, 8, 5)  # even rows end their thought
    policy.on_forward_tokens(requests, first, first, None)
    policy.step_inputs(rows, "cuda")  # the first call's allocations, outside the check
    torch.cuda.synchronize()
    syncs = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *a, **k: syncs.append(str(message))
        torch.cuda.set_sync_debug_mode("warn")
        try:
            policy.on_forward_tokens(requests, second, second, None)
            torch.cuda._sleep(50_000_000)  # the GPU is busy with the "forward": a wait would show
            policy.step_inputs(rows, "cuda")  # matches the first forward's ids, landed
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert [s for s in syncs if "synchroniz" in s] == []
    policy.on_forward_tokens(requests, first, first, None)
    thinking = policy.step_inputs(rows, "cuda")["thinking"].tolist()  # the second forward's ids
    assert thinking == [r % 2 == 1 for r in range(ROWS)]


def test_skipkv_sentence_reads_wait_for_no_kernel():
    # 640 requests, every token of every request a delimiter (sentence
    # vectors all equal: each finished sentence makes the older ones
    # redundant), refresh 1: every step reads counts and spans back.
    from kvsieve.policies.skipkv.policy import SkipKVPolicy

    policy = SkipKVPolicy()
    policy.bind_model(ModelInfo(name="t", num_layers=1, num_kv_heads=1, num_q_heads=1, head_dim=2,
                                delimiter_ids=frozenset({5})))
    params = SkipKVPolicy.Params(refresh=1)
    states = [policy.begin_request(params, 1, 1) for _ in range(ROWS)]
    requests = [(s, r, 1) for r, s in enumerate(states)]
    ids = torch.full((ROWS,), 5, device="cuda")
    hidden = torch.ones(ROWS, 2, device="cuda")
    syncs = []
    for step in range(6):
        rows = [StepRow(s, step=step, pool_row=r, budget=4, prefill=False) for r, s in enumerate(states)]
        torch.cuda.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, *a, **k: syncs.append(str(message))
            torch.cuda.set_sync_debug_mode("warn" if step >= 3 else "default")  # first steps allocate
            try:
                torch.cuda._sleep(50_000_000)  # the GPU is busy: a wait would show
                policy.step_inputs(rows, "cuda")
                policy.on_forward_tokens(requests, torch.full((ROWS,), step, device="cuda"), ids, hidden)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    assert [s for s in syncs if "synchroniz" in s] == []
    # Step 5 took the spans computed at step 4 from the count read at step 3
    # (the tokens of forwards 0-2 folded: 3 sentences, the older 2 redundant).
    assert all(len(s.sentences.spans.lists[0]) == 2 for s in states)
