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


def _drive_crystalcache(device: str, rows: int, steps: int, checked: set, syncs: list) -> torch.Tensor:
    """crystalcache decode steps as the backend runs them (store the token,
    step_inputs, the first layer's decision, on_forward_tokens) for `rows`
    requests with no prompt (trunks from generated tokens only), breath 4,
    budget 8 (the floor with t_max 4).
    The steps in `checked` prepare while the GPU is still busy with the
    forward before them, under the sync debug mode. Returns the valid mask
    [steps, R, H, S] after each step."""
    from kvsieve.policies.crystalcache.policy import CrystalCachePolicy
    from kvsieve.policies.observations import Observations, PolicyBatch, SlotView

    H, S, delim = 2, steps + 1, 9
    policy = CrystalCachePolicy()
    policy.bind_model(ModelInfo(name="t", num_layers=1, num_kv_heads=H, num_q_heads=2 * H, head_dim=4,
                                delimiter_ids=frozenset({delim})))
    params = CrystalCachePolicy.Params(sinks=2, recent=0, breath=4, t_max=4)
    states = [policy.begin_request(params, 1, H) for _ in range(rows)]
    tensors, maxima = CrystalCachePolicy.batch_params([params] * rows, device)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(rows, H, S, 4, generator=g).to(device)
    attention = torch.rand(steps, rows, H, S, generator=g).to(device)
    ids = torch.where(torch.rand(steps, rows, generator=g) < 0.25, delim, 20).to(device)
    valid = torch.zeros(rows, H, S, dtype=torch.bool, device=device)
    position = torch.full((rows, H, S), -1, dtype=torch.int64, device=device)
    score = torch.zeros(rows, H, S, device=device)
    history = []
    for s in range(steps):
        step_rows = [StepRow(st, step=s, pool_row=r, budget=8, prefill=False) for r, st in enumerate(states)]
        if s in checked:
            torch.cuda._sleep(50_000_000)  # the forward before this step still runs: a wait would show
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = lambda message, *a, **k: syncs.append((s, str(message)))
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    inputs = policy.step_inputs(step_rows, device)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        else:
            inputs = policy.step_inputs(step_rows, device)
        due = policy.deciding_rows(step_rows)
        valid[:, :, s], position[:, :, s], score[:, :, s] = True, s, 0.0
        members = torch.tensor([r for r in range(rows) if due[r]], dtype=torch.int64, device=device)
        others = torch.tensor([r for r in range(rows) if not due[r]], dtype=torch.int64, device=device)
        for group, decide in ((members, policy.select_decode), (others, policy.observe_decode)):
            if not len(group):
                continue
            view = SlotView(valid=valid[group], position=position[group], score=score[group],
                            last_hit=None, keys=keys[group])
            batch = PolicyBatch(layer=0, budget=torch.full((len(group), H), 8, device=device),
                                step=torch.full((len(group),), s, device=device),
                                params={k: t[group] for k, t in tensors.items()}, maxima=maxima,
                                inputs={k: t[group] for k, t in inputs.items()})
            evict = decide(batch, view, Observations(attention=attention[s, group] * view.valid))
            score[group] = view.score
            if evict is not None:
                valid[group] = view.valid & ~evict
                position[group] = torch.where(valid[group], view.position, -1)
        policy.on_forward_tokens([(st, r, 1) for r, st in enumerate(states)],
                                 torch.full((rows,), s, device=device), ids[s], None)
        history.append(valid.to("cpu", copy=True))  # outside the checked steps: the test's own read
        if s + 1 in checked:
            torch.cuda.synchronize()  # the forwards before the one still "running" have ended
    return torch.stack(history)


def test_crystalcache_breath_cycles_wait_for_no_kernel():
    # The snapshot of step 3 (breath 4) and the tokens up to it are copied
    # where they are made and read at step 5, two of each request's forwards
    # later: neither the step after the snapshot nor the cycle's step waits
    # for the forward before it. The decisions equal the CPU's.
    steps, syncs = 22, []
    checked = {s for s in range(4, steps) if s % 4 in (0, 1)}
    on_gpu = _drive_crystalcache("cuda", ROWS, steps, checked, syncs)
    assert [s for s in syncs if "synchroniz" in s[1]] == []
    on_cpu = _drive_crystalcache("cpu", ROWS, steps, set(), [])
    assert torch.equal(on_gpu, on_cpu)
    held = on_gpu[:, :, 0].sum(-1)  # [step, row], head 0
    for s in range(5, steps, 4):  # keep tables: B plus the two tokens after the snapshot
        assert int(held[s].max()) <= 8 + 2
    assert bool((held[1:] < held[:-1] + 1).any())  # the cycles evicted
