"""thinkv past the floor (issue #30 item 5): once every closed segment holds
the schedule's last level and the budget still binds, `floor="drop"` drops
whole segments and `floor="merge"` merges two neighbouring floor-size
segments of one thought type into one (k-means over both), keeping the
floor of every type. Also: the budget never anneals the open segment.
Expected values are worked by hand in the comments."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsieve.policies import get_policy
from kvsieve.policies.thinkv.segments import SegmentBook, Thought
from kvsieve.policies.thinkv.select import merged_segments, tbe_evict

from test_thinkv import drive  # the policy driven as the engine drives it

R_, E_, T_ = Thought.REASONING, Thought.EXECUTION, Thought.TRANSITION


def budget_steps(book, steps, types, budget, start=0):
    """Decode steps [start, steps) with only the budget acting (no
    transition anneal): segment k is typed types[k] when it opens. Returns
    the targets after each step."""
    out = []
    for t in range(start, steps):
        book.add_generated(t).thought = types[t // book.refresh]
        book.fit_budget(budget)
        assert book.held <= budget
        out.append(book.targets())
    return out


# ----- host: which segments merge -------------------------------------------------
def test_merge_keeps_the_floor_of_every_type_where_drop_loses_one():
    # refresh 4, schedule (2,) (floor 2), budget 9; types R T T R R R.
    # Step 9: 4 + 4 + 2 = 10: T segment 1 -> 2 (the open segment 2 is never
    # annealed). Step 11: R segment 0 -> 2. Step 13: T segment 2 -> 2.
    # Step 15: [2, 2, 2, 4] = 10, every closed one at the floor:
    #   merge: T segments 1 and 2 are neighbours of one type: one segment of
    #          2 tokens, held by 1 (target -1 - 1 = -2 for segment 2): 8.
    #   drop:  the least important, oldest: T segment 1 goes: 8.
    # Step 17: R segment 3 -> 2. Step 19: 10:
    #   merge: R segments 0 and 3 (segment 4 is open): 3 -> 0.
    #   drop:  T segment 2 goes: no T token is left.
    # Step 21: R segment 4 -> 2. Step 23: merge 4 -> 0; drop R segment 0.
    types = [R_, T_, T_, R_, R_, R_]
    merge = SegmentBook(refresh=4, retention=(2,), floor="merge")
    targets = budget_steps(merge, 24, types, budget=9)
    assert targets[15] == [2, 2, -2, 4]
    assert targets[19] == [2, 2, -2, -1, 4]
    assert targets[23] == [2, 2, -2, -1, -1, 4]
    assert merge.merge_events == 3 and merge.held == 8
    drop = SegmentBook(refresh=4, retention=(2,), floor="drop")
    targets = budget_steps(drop, 24, types, budget=9)
    assert targets[15] == [2, 0, 2, 4]
    assert targets[19] == [2, 0, 0, 2, 4]
    assert targets[23] == [0, 0, 0, 2, 2, 4]
    assert drop.merge_events == 0


def test_merge_cuts_the_survivor_from_both_segments_tokens():
    # Step 15 above: the device held [2, 2, 2, 4]; segment 1 now keeps 2 of
    # the 4 tokens of segments 1 and 2 (segment 2 is no cut of its own);
    # segment 3 is the newest and holds the current token.
    book = SegmentBook(refresh=4, retention=(2,), floor="merge")
    budget_steps(book, 15, [R_, T_, T_, R_], budget=9)
    before = [s.kept for s in book.segments[:-1]] + [book.segments[-1].kept + 1]
    budget_steps(book, 16, [R_, T_, T_, R_], budget=9, start=15)
    assert before == [2, 2, 2, 4]
    assert book.cuts(before) == [(1, 4, 2)]
    # A second merge into the same segment: it held its 2 and segment 3's 2.
    budget_steps(book, 20, [R_, T_, T_, R_, R_], budget=9, start=16)
    assert [s.merged_into for s in book.segments] == [None, None, 1, 0, None]
    assert book.cuts([2, 2, 0, 2, 4]) == [(0, 4, 2)]


def test_merges_chain_into_the_oldest_and_never_leave_a_chain_of_names():
    # Floor 1 (schedule (1,)), refresh 2, budget 4, all R: every closed
    # segment keeps 1; each merge joins the oldest group to its next R
    # neighbour, so segments 1, 2, 3, ... all name segment 0 directly.
    book = SegmentBook(refresh=2, retention=(1,), floor="merge")
    budget_steps(book, 20, [R_] * 10, budget=4)
    assert [s.merged_into for s in book.segments[1:-2]] == [0] * 7
    assert book.targets()[:1] == [1] and book.held <= 4


def test_the_budget_never_anneals_the_open_segment():
    # refresh 8, schedule (4, 2, 1), budget 10; segment 0 R, segment 1 E,
    # open from step 8. Step 10: 8 + 3 = 11: E is less important, but its
    # segment is the open one: the closed R segment 0 anneals to 4 -> 7.
    # Steps 11-13: 8, 9, 10. Step 14: 11: segment 0 -> 2 (level 1): 9.
    # Segment 1 keeps every token it stored.
    for floor in ("drop", "merge"):
        book = SegmentBook(refresh=8, retention=(4, 2, 1), floor=floor)
        targets = budget_steps(book, 15, [R_, E_], budget=10)
        assert targets[10] == [4, 3] and targets[13] == [4, 6] and targets[14] == [2, 7]
        assert book.segments[1].level == 0


def test_the_open_segment_is_cut_only_when_it_alone_is_over_the_budget():
    # Budget 3, refresh 8: closed segments go first; only then is the open
    # segment cut, to the budget (never below its current token).
    book = SegmentBook(refresh=8, retention=(2,), floor="merge")
    targets = budget_steps(book, 12, [R_, R_], budget=3)
    assert targets[3] == [3]  # segment 0 alone: cut to 3 while open
    assert targets[9] == [0, 2] and targets[11] == [0, 3]


def test_the_prompt_has_no_open_segment():
    # At prefill end every chunk is finished: the newest chunk anneals too
    # (as before): 44 -> 32 -> 16 -> 8 -> 4 (260), then chunk -2 -> 64 (196).
    book = SegmentBook(refresh=128, retention=(64, 32, 16, 8, 4), floor="merge")
    book.add_prompt(300)
    book.fit_budget(200)
    assert book.targets() == [4, 64, 128]


def test_the_newest_segment_is_never_merged_away():
    # Prefill end, prompt 3 in chunks of 2 counted back from its end: [1, 2],
    # budget 1, floor 2. Merging the last chunk into the first and then
    # dropping that one would drop the current token with it: instead chunk
    # -2 goes and the last chunk is cut to 1 (its newest token stays).
    book = SegmentBook(refresh=2, retention=(2,), floor="merge")
    book.add_prompt(3)
    book.fit_budget(1)
    assert book.targets() == [0, 1] and book.merge_events == 0


# ----- host: drop is today's rule ---------------------------------------------------
def reference_fit(book, budget):
    """The rule floor="drop" follows, written out plainly: anneal the closed
    segment (not the open one) of the least important type, oldest first;
    then drop whole segments, never the newest; then cut the newest."""
    floor, last = book.retention[-1], len(book.segments) - 1
    open_ = last if book.segments[last].index >= 0 else None
    while book.held > budget:
        movable = [(s.importance, i) for i, s in enumerate(book.segments)
                   if i != open_ and s.level < len(book.retention) and s.kept > floor]
        if movable:
            book._anneal(book.segments[min(movable)[1]])
            continue
        droppable = [(s.importance, i) for i, s in enumerate(book.segments[:-1]) if s.kept > 0]
        if droppable:
            seg = book.segments[min(droppable)[1]]
            book._keep(seg, 0)
            seg.level = len(book.retention)
            continue
        newest = book.segments[-1]
        book._keep(newest, max(1, budget - (book.held - newest.kept)))
        newest.level = len(book.retention)
        break


@settings(max_examples=30, deadline=None)
@given(refresh=st.integers(1, 12), retention=st.lists(st.integers(1, 16), min_size=1, max_size=4, unique=True),
       budget=st.integers(1, 60), kinds=st.lists(st.sampled_from([R_, E_, T_]), min_size=1, max_size=40),
       prompt=st.integers(0, 40))
def test_drop_is_the_plain_rule_with_transitions_and_prompt(refresh, retention, budget, kinds, prompt):
    retention = tuple(sorted(retention, reverse=True))
    drop, ref = (SegmentBook(refresh=refresh, retention=retention, floor="drop") for _ in range(2))
    if prompt:
        drop.add_prompt(prompt)
        ref.add_prompt(prompt)
    for t in range(200):
        k = t // refresh
        for book in (drop, ref):
            ended = book.generated(k - 1) if t and t % refresh == 0 else None
            if ended is not None and ended.thought == T_:
                book.transition_ended(k - 1)
            book.add_generated(t).thought = kinds[k % len(kinds)]
        drop.fit_budget(budget)
        reference_fit(ref, budget)
        assert drop.targets() == ref.targets() and drop.held == ref.held
        assert [s.level for s in drop.segments] == [s.level for s in ref.segments]


# ----- device: the k-means of a merge -------------------------------------------------
def test_the_device_clusters_a_merged_pair_as_one_segment():
    # Segment 0 holds positions 0, 1 and segment 1 positions 4, 5 (2 each,
    # the floor); position 8 is the current token (segment 2). Segment 1 is
    # merged into 0: targets [2, -1, 1]; the host lists segment 0 holding 4,
    # keeping 2. Members in position order 0, 1, 4, 5; centroids start at
    # ranks floor((2j+1)*4/4) = 1, 3: keys (1,0) and (5,5). Keys: 0 (0,0),
    # 1 (1,0), 4 (.2,0), 5 (5,5): clusters {0, 1, 4} (mean (.4,0)) and {5};
    # nearest the first mean is position 4 (d^2 .04 vs .16, .36). So both
    # survivors come from segment 1: positions 0 and 1 go.
    position = torch.tensor([0, 1, 4, 5, 8, -1]).view(1, 1, 6)
    keys = torch.tensor([[0, 0], [1, 0], [.2, 0], [5, 5], [9, 9], [0, 0]]).view(1, 1, 6, 2)
    seg = torch.tensor([0, 0, 1, 1, 2, 0]).view(1, 1, 6)
    valid, current = position >= 0, position == 8
    cut = dict(cut_segments=torch.tensor([[0]]), cut_members=torch.ones(1, 1, 4, dtype=torch.bool),
               cut_centroids=torch.ones(1, 1, 2, dtype=torch.bool), iters=torch.tensor([4]), max_iters=4)
    evict = tbe_evict(valid, position, keys, seg, current, torch.tensor([[2, -1, 1]]), **cut)
    assert position[evict].tolist() == [0, 1]
    # Without keys the group's newest tokens stay: 4 and 5.
    evict = tbe_evict(valid, position, None, seg, current, torch.tensor([[2, -1, 1]]), **cut)
    assert position[evict].tolist() == [0, 1]
    keys_far = keys.clone()
    keys_far[0, 0, 2] = torch.tensor([5, 5.2])  # now {0, 1} and {4, 5}: their older members stay
    evict = tbe_evict(valid, position, keys_far, seg, current, torch.tensor([[2, -1, 1]]), **cut)
    assert position[evict].tolist() == [1, 5]
    # Unmerged, each segment holds its target: nothing is cut.
    evict = tbe_evict(valid, position, keys, seg, current, torch.tensor([[2, 2, 1]]), **cut)
    assert not evict.any()


def test_merged_segments_is_the_identity_without_merges():
    seg = torch.randint(0, 5, (3, 2, 7))
    targets = torch.randint(0, 9, (3, 5))
    same, t = merged_segments(seg, targets)
    assert torch.equal(same, seg) and torch.equal(t, targets)
    merged, t = merged_segments(seg, torch.tensor([[3, -1, -1, 2, 1]] * 3))
    assert torch.equal(merged, torch.where((seg == 1) | (seg == 2), 0, seg))
    assert t[0].tolist() == [3, 0, 0, 2, 1]


# ----- the policy, as the engine drives it ----------------------------------------------
def test_policy_merges_on_the_device_exactly_what_the_host_decided():
    # refresh 4, schedule (2,), budget 9; types R T T R R R T T R (the
    # policy types a segment two steps after it opens). Past step 15 the
    # budget merges; every head holds what the host decided, and at the end
    # each merged group holds its floor: 2 tokens over its segments' positions.
    params = [{"refresh": 4, "retention": (2,), "floor": "merge"}]
    types = [[R_, T_, T_, R_, R_, R_, T_, T_, R_]]
    for t, view, evict, _, states in drive(params, [9], types, steps=36):
        held = view.valid.sum(-1)
        assert (held <= 9).all() and (held[0] == states[0].book.held).all()
    book = states[0].book
    assert book.merge_events >= 3
    kept_at = view.position[0][view.valid[0]].view(2, -1)  # [heads, kept] positions
    for i, s in enumerate(book.segments):
        if s.merged_into is None:
            group = [j for j, o in enumerate(book.segments) if j == i or o.merged_into == i]
            in_group = sum(((kept_at - 50) // 4 == j).sum(-1) for j in group)
            assert (in_group == s.kept).all()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(budgets=st.lists(st.integers(1, 24), min_size=1, max_size=3),
       refresh=st.integers(1, 6),
       retention=st.lists(st.integers(1, 6), min_size=1, max_size=3, unique=True),
       kinds=st.lists(st.sampled_from([R_, E_, T_]), min_size=1, max_size=12),
       iters=st.integers(0, 4), seed=st.integers(0, 3), prompt=st.integers(0, 20))
def test_policy_with_merge_never_exceeds_the_budget_and_the_device_follows_the_host(
        budgets, refresh, retention, kinds, iters, seed, prompt):
    params = [{"refresh": refresh, "retention": tuple(sorted(retention, reverse=True)), "kmeans_iters": iters,
               "floor": "merge"} for _ in budgets]
    types = [kinds[r:] + kinds[:r] for r in range(len(budgets))]
    masks = []
    for t, view, evict, _, states in drive(params, budgets, types, 60, seed=seed, prompt=prompt):
        held = view.valid.sum(-1)
        assert (held <= torch.tensor(budgets).view(-1, 1)).all()
        assert (view.position.amax(dim=-1) == 50 + t).all()
        for r, state in enumerate(states):
            assert (held[r] == state.book.held).all()
        masks.append(None if evict is None else evict.clone())
    again = [None if e is None else e.clone()
             for _, _, e, _, _ in drive(params, budgets, types, 60, seed=seed, prompt=prompt)]
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(masks, again))


def test_floor_param_is_validated():
    cls = get_policy("thinkv")
    assert cls.Params(floor="merge").floor == "merge"
    with pytest.raises(ValueError):
        cls.Params(floor="keep")


# ----- a long generation ------------------------------------------------------------------
def long_generation(floor, steps, refresh, retention, budget, seed=0):
    """Decode `steps` tokens as the policy does (transitions anneal the
    segments before them, the budget the rest), segment types drawn R 50%,
    E 30%, T 20%. Returns the book."""
    rng = random.Random(seed)
    types = rng.choices([R_, E_, T_], weights=[5, 3, 2], k=steps // refresh + 1)
    book = SegmentBook(refresh=refresh, retention=retention, floor=floor)
    for t in range(steps):
        k = t // refresh
        if t and t % refresh == 0 and types[k - 1] == T_:
            book.transition_ended(k - 1)
        book.add_generated(t).thought = types[k]
        book.fit_budget(budget)
    return book


def tokens_by_type(book):
    closed = book.segments[:-1]
    return {ty: sum(s.kept for s in closed if s.thought == ty) for ty in (R_, E_, T_)}


@pytest.mark.parametrize("refresh,budget,steps", [(16, 128, 6000), (128, 1024, 45000)])
def test_long_generation_merge_keeps_every_type_drop_loses_segments(refresh, budget, steps):
    # The case is refresh 128, budget 1024: the closed segments fill
    # the budget at the floor (224 x 4 + the open one) after about 29K tokens;
    # at 45K drop has dropped 126 whole segments, the transitions' last one
    # among them. The 16/128 case is the same past the floor, 8x shorter.
    retention = (64, 32, 16, 8, 4)
    drop = long_generation("drop", steps, refresh, retention, budget)
    merge = long_generation("merge", steps, refresh, retention, budget)
    for book in (drop, merge):
        assert book.held <= budget
        # every closed segment at the floor but the newest closed one (its first anneals)
        assert all(s.kept <= 4 for s in book.segments[:-2])
    dropped = [s for s in drop.segments[:-1] if s.kept == 0]
    assert len(dropped) > 0.1 * len(drop.segments)  # whole thoughts gone
    assert min(tokens_by_type(drop).values()) == 0  # a type lost every token
    # merge: nothing dropped, every type keeps the floor at least.
    assert merge.merge_events > 0
    assert all(s.kept > 0 for s in merge.segments[:-1] if s.merged_into is None)
    assert min(tokens_by_type(merge).values()) >= 4


# ----- the real decode pass (tests/helpers/region_pass.py) ---------------------------------
MERGING = {"refresh": 2, "retention": [1], "floor": "merge"}  # floor 1: merges from step ~12 at budget 8


def test_the_decode_pass_merges_within_the_budget():
    from helpers.region_pass import TINY, random_qkv, region_pass
    from kvsieve.radix_ext.runtime import RUNTIME

    run = region_pass("thinkv", rows=3, prompt=8, steps=40, shapes=TINY, budget=8, device="cpu",
                      dtype=torch.float32, params=MERGING)
    try:
        gen = torch.Generator().manual_seed(0)
        for s in range(40):
            assert torch.isfinite(run.step(s, *random_qkv(3, TINY, gen, "cpu", torch.float32))).all()
            books = [RUNTIME.requests[rid].state.book for rid in run.rids]
            assert run.held_tokens_per_head() == [book.held for book in books]
        assert all(book.merge_events > 5 for book in books)
    finally:
        run.close()


def test_the_merging_pass_on_captured_static_tensors_equals_the_eager_pass():
    from helpers.region_pass import TINY, run_steps
    from test_region_pass import RerunGraphs

    args = dict(rows=3, prompt=8, steps=40, shapes=TINY, budget=8, device="cpu", dtype=torch.float32,
                params=MERGING)
    eager = run_steps("thinkv", **args)
    graphed = run_steps("thinkv", **args, graphs=RerunGraphs())
    assert graphed["captures_replays"][1] > 0
    assert torch.equal(eager["outputs"], graphed["outputs"])
    for a, b in zip(eager["state"], graphed["state"]):
        assert torch.equal(a, b)
