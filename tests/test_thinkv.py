"""thinkv (ThinKV's TBE): segment bookkeeping, calibration, the k-means cut,
and the whole policy driven step by step as the engine drives it (host
step_inputs, then the per-layer decision on a simulated region). Expected
values are worked by hand in the comments."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsieve.policies import Observations, PolicyBatch, SlotView, get_policy
from kvsieve.policies.base import StepRow
from kvsieve.policies.thinkv.calibration import Calibration, calibrate, density_of
from kvsieve.policies.thinkv.segments import SegmentBook, Thought, classify
from kvsieve.policies.thinkv.select import kmeans_medoids, tbe_evict

R_, E_, T_ = Thought.REASONING, Thought.EXECUTION, Thought.TRANSITION


# ----- host bookkeeping ---------------------------------------------------------
def grow(book, steps, types):
    """Decode steps [0, steps) as ThinKVPolicy._advance runs them, with
    segment k typed types[k] as soon as it opens (the policy learns it one
    step later; the anneals only look at ended segments)."""
    for t in range(steps):
        k = t // book.refresh
        if t and t % book.refresh == 0 and book.generated(k - 1).thought == T_:
            book.transition_ended(k - 1)
        book.add_generated(t).thought = types[k]


def test_anneal_across_two_transitions():
    # refresh 8, schedule (4, 2, 1). Segments: 0 R, 1 T, 2 E, 3 T, 4 R.
    # Step 16 ends T segment 1: segment 0 (8 tokens) anneals to level 1 -> 4.
    # Step 24 ends E segment 2: nothing. Step 32 ends T segment 3: every
    # earlier segment goes one level down: seg 0 4 -> 2 (level 2), seg 1 8 -> 4,
    # seg 2 8 -> 4 (level 1); seg 3 keeps its 8, seg 4 has step 32's token.
    book = SegmentBook(refresh=8, retention=(4, 2, 1))
    grow(book, 17, [R_, T_, E_, T_, R_])
    assert book.targets() == [4, 8, 1]
    grow_more = SegmentBook(refresh=8, retention=(4, 2, 1))
    grow(grow_more, 33, [R_, T_, E_, T_, R_])
    assert grow_more.targets() == [2, 4, 4, 8, 1]
    assert [s.level for s in grow_more.segments] == [2, 1, 1, 0, 0]
    assert grow_more.anneal_events == 2


def test_budget_anneals_the_oldest_least_important_segment():
    # refresh 8, schedule (4, 2, 1), budget 20; segments R, E, R (open from
    # step 16), R (open from step 24). The open segment is never annealed.
    # Step 20: 8 + 8 + 5 = 21 > 20: E is the least important type present:
    # segment 1 -> 4 (17). Step 24: 8 + 4 + 8 + 1 = 21: segment 1 -> 2 (19).
    # Step 26: 21: segment 1 -> 1 (20). Step 27: 21: segment 1 is past the
    # schedule, so the oldest R segment anneals: segment 0 -> 4 (17).
    book = SegmentBook(refresh=8, retention=(4, 2, 1))
    for t in range(28):
        book.add_generated(t).thought = [R_, E_, R_, R_][t // 8]
        book.fit_budget(20)
        assert book.held <= 20
        if t == 20:
            assert book.targets() == [8, 4, 5]
        if t == 26:
            assert book.targets() == [8, 1, 8, 3]
    assert book.targets() == [4, 1, 8, 4]


def test_past_the_schedule_whole_segments_go_and_the_newest_keeps_its_token():
    # Budget 3, schedule (2,), refresh 4. Step 9 (segment 2's 2nd token):
    # segments hold [2 (annealed), 2 (annealed), 2] = 6 > 3. Segment 2 -> 2
    # is no cut (level 0 keeps 2). Nothing movable: drop segment 0 -> 4,
    # then segment 1 -> 2 <= 3.
    book = SegmentBook(refresh=4, retention=(2,))
    for t in range(10):
        book.add_generated(t).thought = R_
        book.fit_budget(3)
        assert book.held <= 3
    assert book.targets() == [0, 0, 2]
    tiny = SegmentBook(refresh=4, retention=(2,))
    for t in range(6):
        tiny.add_generated(t).thought = R_
        tiny.fit_budget(1)
        assert tiny.held == 1 and tiny.segments[-1].kept == 1  # the current token


def test_prompt_chunks_count_back_from_the_prompt_end():
    book = SegmentBook(refresh=128, retention=(64, 32, 16, 8, 4))
    book.add_prompt(300)  # 44 + 128 + 128
    assert [(s.index, s.size) for s in book.segments] == [(-3, 44), (-2, 128), (-1, 128)]
    # Budget 200: R everywhere, oldest first: 44 -> 32 (skips 64): 288;
    # -> 16: 272; -> 8: 264; -> 4: 260; then chunk -2: 128 -> 64: 196.
    book.fit_budget(200)
    assert book.targets() == [4, 64, 128]


def test_thought_types_from_thresholds():
    assert classify(0.95, 0.45, 0.75) == T_
    assert classify(0.75, 0.45, 0.75) == T_
    assert classify(0.6, 0.45, 0.75) == R_
    assert classify(0.2, 0.45, 0.75) == E_


# ----- calibration --------------------------------------------------------------
def mixture(rng, centres, sd, n):
    return np.concatenate([rng.normal(c, sd, n) for c in centres])


def test_calibration_finds_the_trimodal_layers_and_the_minima_between_modes():
    # Layers 1 and 3: three equal, equally wide modes at 0.3, 0.6, 0.9, so by
    # symmetry the density's minima lie at the midpoints 0.45 and 0.75.
    # Layer 0 is unimodal, layer 2 bimodal: neither qualifies. Layer 3's
    # modes are wider (sd 0.05 vs 0.03): shallower minima.
    rng = np.random.default_rng(0)
    traces = []
    for _ in range(3):  # prompts
        cols = [rng.normal(0.5, 0.05, 600), mixture(rng, (0.3, 0.6, 0.9), 0.03, 200),
                mixture(rng, (0.3, 0.8), 0.03, 300), mixture(rng, (0.3, 0.6, 0.9), 0.05, 200)]
        traces.append(np.stack(cols, axis=1).clip(0, 1))
    layers, (low, high) = calibrate(traces, max_layers=4)
    assert layers == [1, 3]
    assert low == pytest.approx(0.45, abs=0.02) and high == pytest.approx(0.75, abs=0.02)
    assert calibrate(traces, max_layers=1)[0] == [1]  # the deepest minima
    assert len(density_of(traces[0][:, 2]).modes) == 2
    with pytest.raises(ValueError, match="no layer"):
        calibrate([t[:, [0, 2]] for t in traces])
    # The thresholds type steps of the trace's modes as E, R and T.
    assert [classify(s, low, high) for s in (0.3, 0.6, 0.9)] == [E_, R_, T_]


# ----- the device cut -------------------------------------------------------------
def test_kmeans_keeps_the_token_nearest_each_cluster_centre():
    # Segment 0 = positions 0-5 (target 2 + nothing current), position 6 is the
    # current token (segment 1). Keys: A = (0,0) (.1,0) (0,.1); B = (5,5)
    # (5.1,5) (5,5.2). Init ranks floor((2j+1)*6/4) = 1, 4: one centroid in
    # each cluster; their means (.033,.033) and (5.033,5.067): nearest members
    # (0,0) at position 0 (d^2 .0022 vs .0056) and (5,5) at position 3
    # (.0056 vs .0089, .0189). Evicted: 1, 2, 4, 5.
    keys = torch.tensor([[0, 0], [.1, 0], [0, .1], [5, 5], [5.1, 5], [5, 5.2], [9, 9], [0, 0]]).view(1, 1, 8, 2)
    position = torch.tensor([0, 1, 2, 3, 4, 5, 6, -1]).view(1, 1, 8)
    valid = position >= 0
    seg = torch.tensor([0, 0, 0, 0, 0, 0, 1, 0]).view(1, 1, 8)
    current = position == 6
    cut = dict(targets=torch.tensor([[2, 1]]), cut_segments=torch.tensor([[0]]),
               cut_members=torch.ones(1, 1, 6, dtype=torch.bool), cut_centroids=torch.ones(1, 1, 2, dtype=torch.bool),
               iters=torch.tensor([3]), max_iters=3)
    evict = tbe_evict(valid, position, keys, seg, current, **cut)
    assert position[evict].tolist() == [1, 2, 4, 5]
    # Without keys the newest tokens of the segment stay.
    evict = tbe_evict(valid, position, None, seg, current, **cut)
    assert position[evict].tolist() == [0, 1, 2, 3]
    # A second head whose keys swap the clusters' order keeps the same medoids.
    keys2 = torch.cat([keys, keys[:, :, [3, 4, 5, 0, 1, 2, 6, 7]]], dim=1)
    two = lambda t: torch.cat([t, t], dim=1)  # noqa: E731
    evict = tbe_evict(two(valid), two(position), keys2, two(seg), two(current), **cut)
    assert two(position)[0, 1][evict[0, 1]].tolist() == [1, 2, 4, 5]  # (5,5) at 0 and (0,0) at 3



def test_kmeans_cut_does_not_follow_float_noise_in_the_keys():
    # A two-member cluster's centroid is their midpoint: both are its nearest
    # member in exact arithmetic, and float32 rounding used to pick one, so a
    # ulp of noise in the keys (the K projection of a different batch, TP's
    # all-reduce) moved the kept token: greedy output depended on the batch
    # and on TP. Ties up to rounding keep the older member. Segment 0: 10
    # tokens cut to 7 (plus the current token, position 10), 2 heads.
    gen = torch.Generator().manual_seed(0)
    n, t, S = 10, 7, 12
    position = torch.cat([torch.arange(n + 1), torch.tensor([-1])]).view(1, 1, S).expand(1, 2, S)
    valid, seg, current = position >= 0, torch.zeros(1, 2, S, dtype=torch.int64), position == n
    cut = dict(targets=torch.tensor([[t + 1]]), cut_segments=torch.tensor([[0]]),
               cut_members=torch.ones(1, 1, n, dtype=torch.bool), cut_centroids=torch.ones(1, 1, t, dtype=torch.bool),
               iters=torch.tensor([8]), max_iters=8)
    for _ in range(20):
        keys = torch.randn(1, 2, S, 16, generator=gen)
        noisy = keys * (1 + 1e-6 * torch.randn(keys.shape, generator=gen))
        evict = tbe_evict(valid, position, keys, seg, current, **cut)
        assert (evict.sum(-1) == n - t).all()
        assert torch.equal(evict, tbe_evict(valid, position, noisy, seg, current, **cut))
    # Two clusters of two: the older member of each stays, whatever rounds which way.
    a, b = torch.randn(2, 16, generator=gen), torch.randn(2, 16, generator=gen) + 8
    for pair in ((a, b), (a * (1 + 1e-7), b * (1 - 1e-7))):
        keys = torch.cat(pair).view(1, 1, 1, 4, 16)  # members 0, 1 near a; 2, 3 near b
        nearest, nonempty = kmeans_medoids(keys, torch.ones(1, 1, 1, 4, dtype=torch.bool),
                                           torch.ones(1, 1, 1, 2, dtype=torch.bool), torch.tensor([0, 2]).view(1, 1, 1, 2),
                                           torch.tensor([3]), 3)
        assert nearest.flatten().tolist() == [0, 2] and nonempty.all()

# ----- the policy, as the engine drives it ----------------------------------------
H, D = 2, 4
SPARSITY = {T_: 0.9, R_: 0.6, E_: 0.2}


def drive(params, budgets, types, steps, seed=0, prompt=0):
    """Run decode steps 0..steps-1 of len(budgets) rows, generated tokens at
    positions 50, 51, ...; with `prompt`, the prompt's last `prompt` tokens
    (positions 50-prompt..49) are private and selected first (prefill end,
    yielded as step -1); the rest of it is shared (radix cache). Segment k
    of row r has sparsity SPARSITY[types[r][k]]. Yields after each step
    (t, view, evict mask, policy, states)."""
    cls = get_policy("thinkv")
    policy = cls()
    policy.use_calibration(Calibration(model="t", layers=(0,), thresholds=(0.45, 0.75)))
    R = len(budgets)
    S = max(max(budgets) + 2, prompt + 1)
    rows = [cls.Params(**p) for p in params]
    tensors, maxima = cls.batch_params(rows)
    states = [policy.begin_request(p, 1, H) for p in rows]
    gen = torch.Generator().manual_seed(seed)
    view = SlotView(valid=torch.zeros(R, H, S, dtype=torch.bool), position=torch.full((R, H, S), -1),
                    score=torch.zeros(R, H, S), last_hit=torch.zeros(R, H, S, dtype=torch.int32),
                    keys=torch.zeros(R, H, S, D))
    def batch(t, inputs):
        return PolicyBatch(layer=0, budget=torch.tensor(budgets).view(R, 1).expand(R, H),
                           step=torch.full((R,), max(t, 0)), params=tensors, maxima=maxima, inputs=inputs,
                           pool_rows=torch.arange(R), max_rows=R)

    def apply(evict):
        if evict is not None:
            view.valid &= ~evict
            view.position[~view.valid] = -1

    if prompt:
        view.valid[:, :, :prompt] = True
        view.position[:, :, :prompt] = torch.arange(50 - prompt, 50)
        view.keys[:, :, :prompt] = torch.randn(R, H, prompt, D, generator=gen)
        inputs = policy.step_inputs([StepRow(state=states[r], step=0, pool_row=r, budget=budgets[r], prefill=True,
                                             private_tokens=prompt) for r in range(R)], "cpu")
        evict = policy.select_prefill(batch(-1, inputs), view, Observations())
        apply(evict)
        yield -1, view, evict, policy, states
    for t in range(steps):
        step_rows = [StepRow(state=states[r], step=t, pool_row=r, budget=budgets[r], prefill=False,
                             private_tokens=prompt + t + 1) for r in range(R)]
        inputs = policy.step_inputs(step_rows, "cpu")
        free = (~view.valid).int().argmax(-1, keepdim=True)  # the region's store: first free slot
        assert (~view.valid).any(-1).all(), "a head ran out of slots"
        view.valid.scatter_(-1, free, True)
        view.position.scatter_(-1, free, 50 + t)
        view.keys.scatter_(2, free.unsqueeze(-1).expand(R, H, 1, D), torch.randn(R, H, 1, D, generator=gen))
        sparsity = torch.tensor([SPARSITY[types[r][min(t // rows[r].refresh, len(types[r]) - 1)]]
                                 for r in range(R)]).view(R, 1).expand(R, 2 * H)
        evict = policy.select_decode(batch(t, inputs), view, Observations(sparsity=sparsity))
        apply(evict)
        yield t, view, evict, policy, states


def test_policy_rows_follow_their_own_schedules_in_one_batch():
    # Row 0: refresh 4, schedule (2, 1), budget 100 (never binding), types R T E ..
    #   step 8 ends T segment 1: segment 0 (4 tokens) -> 2.
    # Row 1: refresh 4, budget 6, all R: held after each step <= 6.
    params = [{"refresh": 4, "retention": (2, 1)}, {"refresh": 4, "retention": (2, 1)}]
    types = [[R_, T_, E_, E_], [R_] * 4]
    for t, view, _, _, states in drive(params, [100, 6], types, steps=12):
        held = view.valid.sum(-1)
        assert (held[1] <= 6).all()
        if t == 7:
            assert (held[0] == 8).all()
        if t == 8:
            assert (held[0] == 2 + 4 + 1).all()
            assert states[0].book.targets() == [2, 4, 1]
        # Segment 0's type comes from step 0's sparsity, copied to the host before step 1, read at step 2.
        assert states[0].book.segments[0].thought == (None if t <= 1 else R_)
    assert states[0].book.segments[1].thought == T_ and states[0].book.segments[2].thought == E_


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(budgets=st.lists(st.integers(1, 24), min_size=1, max_size=3),
       refresh=st.integers(1, 9),
       retention=st.lists(st.integers(1, 12), min_size=1, max_size=4, unique=True),
       kinds=st.lists(st.sampled_from([R_, E_, T_]), min_size=1, max_size=12),
       iters=st.integers(0, 4),
       seed=st.integers(0, 3),
       prompt=st.integers(0, 30))
def test_policy_never_exceeds_the_budget_never_evicts_the_current_token_and_is_deterministic(
        budgets, refresh, retention, kinds, iters, seed, prompt):
    params = [{"refresh": refresh, "retention": tuple(sorted(retention, reverse=True)), "kmeans_iters": iters}
              for _ in budgets]
    types = [kinds[r:] + kinds[:r] for r in range(len(budgets))]  # each row its own order
    steps = 40
    masks = []
    for t, view, evict, _, states in drive(params, budgets, types, steps, seed=seed, prompt=prompt):
        held = view.valid.sum(-1)  # [R, H]
        assert (held <= torch.tensor(budgets).view(-1, 1)).all()
        assert (view.position.amax(dim=-1) == 50 + t).all()  # the current (or last prompt) token, in every head
        # The device holds exactly what the host decided, in every head.
        for r, state in enumerate(states):
            assert (held[r] == state.book.held).all()
        masks.append(None if evict is None else evict.clone())
    again = [None if e is None else e.clone()
             for _, _, e, _, _ in drive(params, budgets, types, steps, seed=seed, prompt=prompt)]
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(masks, again))


def test_params_are_validated():
    cls = get_policy("thinkv")
    for bad in ({"refresh": 0}, {"retention": (4, 8)}, {"retention": ()}, {"kmeans_iters": -1}, {"nope": 1}):
        with pytest.raises(ValueError):
            cls.Params(**bad)


@settings(max_examples=20, deadline=None)
@given(low=st.floats(0.05, 0.3), gap1=st.floats(0.2, 0.3), gap2=st.floats(0.2, 0.3), seed=st.integers(0, 99))
def test_calibration_thresholds_separate_any_three_clear_modes(low, gap1, gap2, seed):
    rng = np.random.default_rng(seed)
    centres = (low, low + gap1, low + gap1 + gap2)
    traces = [mixture(rng, centres, 0.02, 300).reshape(-1, 1) for _ in range(2)]
    layers, (theta_low, theta_high) = calibrate(traces)
    assert layers == [0]
    assert centres[0] < theta_low < centres[1] < theta_high < centres[2]
    assert [classify(c, theta_low, theta_high) for c in centres] == [E_, R_, T_]


def test_cut_shapes_keep_the_gathered_keys_within_what_the_rows_hold():
    # The cut shapes start at a segment's width (N 128, so segments halving
    # keep one shape), but never past twice what a cutting row holds per
    # head: 40 annealed segments of 4 tokens cut at once (165 held) gather
    # Kc 64 x N 4 keys, not 64 x 128. The engine chunks a decision by the
    # larger of its view and what it gathers (decision_gather_slots).
    from kvsieve.radix_ext.step_meta import decision_key_slots
    policy = get_policy("thinkv")()
    params = policy.Params()

    def inputs(*rows):
        step_rows = []
        for cuts, held in rows:
            state = policy.begin_request(params, 2, 2)
            row = StepRow(state=state, step=0, pool_row=0, budget=64, prefill=True, private_tokens=held)
            state.last_key = (True, 0, held, 64)
            state.last_row = ([2] * (len(cuts) + 1), 0, cuts, held)
            step_rows.append(row)
        return policy.step_inputs(step_rows, "cpu")

    annealed = [(k, 4, 2) for k in range(40)]
    one_segment = [(0, 64, 32)]
    assert inputs((one_segment, 300))["cut_members"].shape == (1, 1, 128)
    many = inputs((annealed, 165))
    assert many["cut_members"].shape == (1, 64, 4) and many["cut_centroids"].shape == (1, 64, 2)
    assert decision_key_slots(policy, many, 300) == 300
    # Rows padded to each other's cuts: 64 segments x 64 tokens, more than
    # either row's 300 slots: the decision's chunks are sized for 4,096.
    both = inputs((annealed, 165), (one_segment, 300))
    assert both["cut_members"].shape == (2, 64, 64)
    assert decision_key_slots(policy, both, 300) == 64 * 64
    assert decision_key_slots(get_policy("rkv")(), both, 300) == 300
