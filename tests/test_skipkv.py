"""skipkv: the redundant set from sentences of known similarity (the slides'
example and more), sentence segmentation and vectors from known hidden
states, hand-worked whole-sentence evictions, the policy's host/device
hand-off (on_tokens -> step_inputs -> select_decode), and hypothesis
properties (within budget after an eviction step, the current token kept,
deterministic)."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsieve.policies import KVPolicyError, Observations, SlotView, get_policy, parse_kv_policy
from kvsieve.policies.base import ModelInfo, StepRow
from kvsieve.policies.skipkv.select import FAR, skipkv_evict
from kvsieve.policies.skipkv.book import MIN_RANGE, SentenceBook, delimiter_table
from kvsieve.policies.skipkv.sentences import RedundantSpans, redundant_sentences

from test_rkv import apply, batch_of, empty_view, store


def unit_vectors_with(l12, l13, l23):
    """Three unit vectors in R^3 with the given pairwise cosines (by hand:
    v1 = e1; v3 = (l13, sqrt(1 - l13^2), 0); v2 = (l12, y, z) with
    v2.v3 = l12*l13 + y*sqrt(1 - l13^2) = l23 and |v2| = 1)."""
    s = math.sqrt(1 - l13 ** 2)
    y = (l23 - l12 * l13) / s
    z = math.sqrt(1 - l12 ** 2 - y ** 2)
    return torch.tensor([[1.0, 0.0, 0.0], [l12, y, z], [l13, s, 0.0]])


def test_redundant_set_of_the_slides_example():
    # lambda_12 = 0.37, lambda_13 = 0.96, lambda_23 = 0.50, tau 0.9: P = {S1}
    # (S1 has the later S3 above tau; S2's only later sentence is 0.50 away).
    vectors = unit_vectors_with(0.37, 0.96, 0.50)
    redundant, penalty = redundant_sentences(vectors * torch.tensor([[2.0], [0.5], [3.0]]), tau=0.9)  # scale-free
    assert redundant.tolist() == [True, False, False]
    assert penalty.tolist() == pytest.approx([0.96, 0.0, 0.0], abs=1e-6)
    # tau 0.45: S2 joins (0.50 to the later S3); S1's penalty is its largest
    # similarity to a later sentence, 0.96. The last sentence never is redundant.
    redundant, penalty = redundant_sentences(vectors, tau=0.45)
    assert redundant.tolist() == [True, True, False]
    assert penalty.tolist() == pytest.approx([0.96, 0.50, 0.0], abs=1e-6)


def test_redundancy_looks_only_at_later_sentences():
    # v1 = (1, 0), v2 = (0, 1), v3 = 2 * v1, v4 = (0.6, 0.8). Later cosines:
    # S1: S2 0, S3 1.0, S4 0.6 -> 1.0; S2: S3 0, S4 0.8 -> 0.8; S3: S4 0.6;
    # S4: none. tau 0.75: P = {S1, S2}; S3 is as similar to the earlier S1,
    # but no later sentence repeats it.
    vectors = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.6, 0.8]])
    redundant, penalty = redundant_sentences(vectors, tau=0.75)
    assert redundant.tolist() == [True, True, False, False]
    assert penalty.tolist() == pytest.approx([1.0, 0.8, 0.0, 0.0])
    assert redundant_sentences(vectors[:0], tau=0.75)[0].numel() == 0


def feed(book, rs, positions, ids, hidden):
    """One decode step per token, then the step's flush (as the engine runs them)."""
    for p, token, h in zip(positions, ids, hidden):
        book.add(rs, torch.tensor([p]), torch.tensor([token]), torch.tensor([h], dtype=torch.float32))
        book.flush()


def test_sentences_from_tokens_and_hidden_states():
    # Delimiter id 5. Generated tokens at positions 10..16, ids
    # 1 2 5 | 3 5 | 4 4 (unfinished). Hidden states: S1 (2,0) (0,0) (1,0)
    # -> mean (1, 0); S2 (4,1) (2,-1) -> (3, 0): cosine 1 > 0.9, S1 redundant
    # with penalty 1; S2 is the last finished sentence.
    book = SentenceBook(delimiter_table({5, 9}, "cpu"), hidden=2, device="cpu")
    rs = book.open(3)
    feed(book, rs, range(10, 17), [1, 2, 5, 3, 5, 4, 4], [(2, 0), (0, 0), (1, 0), (4, 1), (2, -1), (7, 7), (1, 1)])
    assert int(book.count[3]) == 2
    lo = rs.base
    assert book.vectors[lo:lo + 2].tolist() == [[1.0, 0.0], [3.0, 0.0]]
    assert book.starts[lo:lo + 2].tolist() == [10, 13] and book.ends[lo:lo + 2].tolist() == [12, 14]
    book.read([(rs, 0.9, 0)])
    book.take([(rs, 0)])
    assert rs.known == 0 and rs.counting is not None  # on its way: taken at step 1
    book.take([(rs, 1)])
    assert rs.known == 2 and len(rs.spans.lists[0]) == 0 and rs.spanning is not None  # spans at step 2
    book.take([(rs, 2)])
    assert rs.spans.starts.tolist() == [10] and rs.spans.ends.tolist() == [12]
    assert rs.spans.penalty.tolist() == pytest.approx([1.0]) and rs.spans.rank.tolist() == [0]
    # A token id outside the delimiter table (>= 10) is no delimiter.
    feed(book, rs, [17], [400], [(1, 1)])
    assert int(book.count[3]) == 2


def test_requests_fold_together_as_they_would_alone():
    # Two requests' tokens queued in the same steps (and one of them twice
    # in one step: two forwards before a flush) give each the sentences it
    # gets alone.
    ids = [[1, 5, 2, 2, 5, 5, 3], [5, 4, 4, 4, 5, 1, 5]]
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 3, generator=gen)
    alone = []
    for r in range(2):
        book = SentenceBook(delimiter_table({5}, "cpu"), hidden=3, device="cpu")
        rs = book.open(0)
        feed(book, rs, range(7), ids[r], hidden[r].tolist())
        n = int(book.count[0])
        alone.append((book.vectors[rs.base:rs.base + n], book.starts[rs.base:rs.base + n], book.ends[rs.base:rs.base + n]))
    book = SentenceBook(delimiter_table({5}, "cpu"), hidden=3, device="cpu")
    a, b = book.open(4), book.open(1)
    for t in range(7):
        book.add(a, torch.tensor([t]), torch.tensor([ids[0][t]]), hidden[0, t:t + 1])
        if t % 2 == 0:  # b's tokens two at a time, as two forwards queued before one flush
            for u in (t, t + 1):
                if u < 7:
                    book.add(b, torch.tensor([u]), torch.tensor([ids[1][u]]), hidden[1, u:u + 1])
        book.flush()
    for rs, row, (vectors, starts, ends) in ((a, 4, alone[0]), (b, 1, alone[1])):
        n = int(book.count[row])
        assert n == vectors.shape[0] > 0
        assert torch.allclose(book.vectors[rs.base:rs.base + n], vectors)
        assert torch.equal(book.starts[rs.base:rs.base + n], starts) and torch.equal(book.ends[rs.base:rs.base + n], ends)


def test_queued_tokens_survive_the_engine_rewriting_its_tensors():
    # The engine hands slices of one forward's tensors (positions, input ids,
    # hidden states) and may write into them before the next step's flush.
    book = SentenceBook(delimiter_table({5}, "cpu"), hidden=2, device="cpu")
    a, b = book.open(0), book.open(1)
    positions, ids = torch.tensor([7, 30]), torch.tensor([5, 5])
    hidden = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    book.add(a, positions[0:1], ids[0:1], hidden[0:1])
    book.add(b, positions[1:2], ids[1:2], hidden[1:2])
    positions += 1
    ids.fill_(0)
    hidden.zero_()
    book.flush()
    assert book.count.tolist()[:2] == [1, 1]
    assert book.ends[a.base].item() == 7 and book.ends[b.base].item() == 30
    assert book.vectors[b.base].tolist() == [3.0, 4.0]


def test_a_request_range_grows_past_its_first_size():
    # Every token a delimiter: 3 * MIN_RANGE one-token sentences, read back
    # only every 50 steps; the range grows before the queued tokens could
    # overflow it, and a second request's range is never written.
    book = SentenceBook(delimiter_table({5}, "cpu"), hidden=2, device="cpu")
    rs, other = book.open(0), book.open(1)
    feed(book, other, [0], [5], [(9.0, 9.0)])
    n = 3 * MIN_RANGE
    for t in range(n):
        book.add(rs, torch.tensor([t]), torch.tensor([5]), torch.tensor([[float(t), 1.0]]))
        book.flush()
        book.take([(rs, t)])
        if t % 50 == 0:
            book.read([(rs, 0.99, t)])
    assert int(book.count[0]) == n and rs.cap >= n
    assert book.vectors[rs.base:rs.base + n, 0].tolist() == [float(t) for t in range(n)]
    assert book.vectors[other.base].tolist() == [9.0, 9.0] and int(book.count[1]) == 1
    base = other.base
    book.close(other)
    assert book.open(2).base == base  # a freed range is reused


def test_span_ranks_most_similar_first_then_oldest():
    spans = RedundantSpans.of(torch.tensor([0, 5, 9, 20]), torch.tensor([4, 8, 19, 25]),
                              torch.tensor([True, True, True, False]), torch.tensor([0.92, 0.97, 0.92, 0.0]))
    assert spans.starts.tolist() == [0, 5, 9]
    assert spans.rank.tolist() == [1, 0, 2]  # 0.97 first, then the two 0.92 oldest first


def one_head(positions, budget, window, due=True):
    H, S = 1, len(positions) + 2
    view = empty_view(1, H, S, 1)
    for i, p in enumerate(positions):
        view.valid[0, 0, i] = True
        view.position[0, 0, i] = p
    return view, torch.tensor([[budget]]), torch.tensor([window]), torch.tensor([[due]])


def spans_of(*spans):
    """spans: (start, end, penalty, rank) -> [1, K] tensors."""
    t = lambda i, dtype: torch.tensor([[s[i] for s in spans]], dtype=dtype)  # noqa: E731
    return t(0, torch.int64), t(1, torch.int64), t(2, torch.float32), t(3, torch.int64)


def kept(view, evict):
    return set(view.position[0, 0][view.valid[0, 0] & ~evict[0, 0]].tolist())


@pytest.mark.parametrize("budget, expected", [
    # Positions 0-9 held, window 2 (8, 9 protected). Redundant A = 1-3
    # (penalty 0.95, rank 0) and B = 5-6 (0.92, rank 1).
    # budget 6: 4 to go. A goes whole (3, 1 still to go), then B whole (2):
    # 5 held, one below the budget: sentences are dropped whole.
    (6, {0, 4, 7, 8, 9}),
    # budget 8: 2 to go; A alone frees 3: B stays.
    (8, {0, 4, 5, 6, 7, 8, 9}),
])
def test_whole_redundant_sentences_go_first(budget, expected):
    view, budget_t, window, due = one_head(list(range(10)), budget, 2)
    score = torch.zeros_like(view.score)  # token scores play no part here
    evict = skipkv_evict(view, score, budget_t, window, due, *spans_of((1, 3, 0.95, 0), (5, 6, 0.92, 1)))
    assert kept(view, evict) == expected


def test_protected_sentence_stays_and_penalty_ranks_tokens():
    # Window 6 protects positions 4-9. B = 3-6 (0.92) holds protected tokens:
    # never dropped whole. A = 0-1 (0.95) goes whole: held 8 > budget 7, so
    # one more token of the unprotected {2, 3} goes by score: 2 scores 0.1,
    # 3 scores 0.5 - 0.92 (B's penalty) = -0.42: position 3 goes.
    view, budget, window, due = one_head(list(range(10)), 7, 6)
    score = torch.zeros_like(view.score)
    score[0, 0, 2], score[0, 0, 3] = 0.1, 0.5
    evict = skipkv_evict(view, score, budget, window, due, *spans_of((0, 1, 0.95, 0), (3, 6, 0.92, 1)))
    assert kept(view, evict) == {2, 4, 5, 6, 7, 8, 9}
    # Without the penalty 3 would stay (0.5 > 0.1).
    evict = skipkv_evict(view, score, budget, window, due, *spans_of((0, 1, 0.95, 0), (3, 6, 0.0, 1)))
    assert kept(view, evict) == {3, 4, 5, 6, 7, 8, 9}


def test_a_head_not_due_keeps_everything():
    view, budget, window, _ = one_head(list(range(10)), 4, 1)
    evict = skipkv_evict(view, torch.zeros_like(view.score), budget, window, torch.tensor([[False]]),
                         *spans_of((1, 3, 0.95, 0)))
    assert not evict.any()


# ----- the policy, host and device together ----------------------------------------

def bound_policy(**params):
    policy, batch = batch_of("skipkv", [params], [5], H=1)
    policy.bind_model(ModelInfo(name="t", num_layers=1, num_kv_heads=1, num_q_heads=1, head_dim=2,
                                delimiter_ids=frozenset({5})))
    return policy, batch, policy.begin_request(policy.Params(**params), 1, 1)


def test_policy_drops_the_repeated_sentence_whole():
    # Generated tokens at positions 0-11, ids "1 2 5" "3 5" "4 4 5" "6 6 6 6"
    # (delimiter 5): S1 = 0-2, S2 = 3-4, S3 = 5-7. Hidden states: S1 (1, 0),
    # S2 (0, 1), S3 (2, 0): cos(S1, S3) = 1 > 0.9, S1 is redundant once S3 is
    # finished (after step 7; refresh 1 reads the count at step 8, the spans
    # are computed at step 9 and reach the decision at step 10). Budget 5,
    # window 1, lambda 1 (importance only), kernel 1: attention 0.9 on S1's
    # tokens, 0.1 elsewhere (ties: lower slot, i.e. older here).
    # step 5: 0-5 held, 5 protected, keep 0 1 2 3: evict 4 (slot 4)
    # step 6: 6 in slot 4; keep 0 1 2 3 (slot 3 before slot 5): evict 5
    # step 7: 7 in slot 5; keep 0 1 2 3: evict 6
    # step 8: 8 in slot 4; keep 0 1 2 3 (slot 3 before slot 5): evict 7
    # step 9: 9 in slot 5; keep 0 1 2 3: evict 8
    # step 10: 10 in slot 4; one token to go and S1 is redundant: S1 goes
    #          whole (0, 1, 2), though its attention is the highest
    # step 11: 11 in slot 0; 4 held: nothing.
    policy, batch, state = bound_policy(refresh=1, window=1, kernel=1, lambda_mix=1.0)
    ids = [1, 2, 5, 3, 5, 4, 4, 5, 6, 6, 6, 6]
    hidden = [(1, 0)] * 3 + [(0, 1)] * 2 + [(2, 0)] * 3 + [(1, 1)] * 4
    view = empty_view(1, 1, 12, 2)
    drops = []
    for step, (token, h) in enumerate(zip(ids, hidden)):
        batch.inputs = policy.step_inputs([StepRow(state=state, step=step, pool_row=0, budget=5, prefill=False)],
                                          "cpu")
        store(view, step, torch.ones(1, 1, 2))
        attention = torch.where(view.position.clamp(min=0) <= 2, 0.9, 0.1) * view.valid
        evict = policy.select_decode(batch, view, Observations(attention=attention))
        drops.append(set(view.position[0, 0][evict[0, 0]].tolist()))
        apply(view, evict)
        policy.on_tokens(state, torch.tensor([step]), torch.tensor([token]), torch.tensor([h], dtype=torch.float32))
    assert drops == [set()] * 5 + [{4}, {5}, {6}, {7}, {8}, {0, 1, 2}, set()]
    assert set(view.position[0, 0][view.valid[0, 0]].tolist()) == {3, 9, 10, 11}
    # One redundant span, padded to 4 (a power of two: captured shapes change rarely).
    assert batch.inputs["span_starts"].tolist() == [[0, FAR, FAR, FAR]]
    assert batch.inputs["span_ends"].tolist() == [[2, FAR, FAR, FAR]]
    assert batch.inputs["span_penalty"][0].tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0])


def test_policy_before_any_sentence_is_rkv():
    # No sentence finished: skipkv keeps exactly what rkv keeps.
    skip, sbatch = batch_of("skipkv", [{}], [4], H=2)
    rkv, rbatch = batch_of("rkv", [{}], [4], H=2)
    gen = torch.Generator().manual_seed(11)
    sview, rview = empty_view(1, 2, 8, 3), empty_view(1, 2, 8, 3)
    for step in range(12):
        key = torch.randn(1, 2, 3, generator=gen)
        store(sview, step, key)
        store(rview, step, key)
        attention = torch.rand(1, 2, 8, generator=gen)
        s = skip.select_decode(sbatch, sview, Observations(attention=attention * sview.valid))
        r = rkv.select_decode(rbatch, rview, Observations(attention=attention * rview.valid))
        assert torch.equal(s, r)
        apply(sview, s)
        apply(rview, r)


def test_prompt_tokens_make_no_sentences():
    policy, _, state = bound_policy()
    policy.step_inputs([StepRow(state=state, step=0, pool_row=0, budget=5, prefill=True)], "cpu")
    policy.on_tokens(state, torch.arange(3), torch.tensor([1, 5, 5]), torch.ones(3, 2))
    assert state.sentences is None
    policy.step_inputs([StepRow(state=state, step=0, pool_row=0, budget=5, prefill=False)], "cpu")
    policy.on_tokens(state, torch.tensor([3]), torch.tensor([5]), torch.ones(1, 2))
    policy.step_inputs([StepRow(state=state, step=1, pool_row=0, budget=5, prefill=False)], "cpu")
    assert int(policy.book.count[0]) == 1
    policy.end_request(state)


# ----- properties -------------------------------------------------------------------

@st.composite
def span_tables(draw, R, max_pos):
    """Per row: disjoint sorted spans with penalties and a rank permutation, padded to one K."""
    rows = []
    for _ in range(R):
        cuts = sorted(set(draw(st.lists(st.integers(0, max_pos), max_size=8))))
        spans = [(a, b) for a, b in zip(cuts[::2], cuts[1::2])]
        pen = [draw(st.floats(0.9, 1.0)) for _ in spans]
        rows.append((spans, pen))
    K = max(len(s) for s, _ in rows)
    starts = torch.full((R, K), FAR)
    ends = torch.full((R, K), FAR)
    penalty = torch.zeros(R, K)
    rank = torch.arange(K).repeat(R, 1)
    for r, (spans, pen) in enumerate(rows):
        if spans:
            starts[r, :len(spans)] = torch.tensor([a for a, _ in spans])
            ends[r, :len(spans)] = torch.tensor([b for _, b in spans])
            penalty[r, :len(spans)] = torch.tensor(pen)
            perm = draw(st.permutations(list(range(len(spans)))))
            rank[r, :len(spans)] = torch.tensor(perm)
    return {"span_starts": starts, "span_ends": ends, "span_penalty": penalty, "span_rank": rank}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**31 - 1), budgets=st.lists(st.integers(1, 10), min_size=1, max_size=3),
       window=st.integers(1, 6), buffer=st.integers(1, 3), steps=st.integers(1, 30))
def test_properties_budget_current_token_determinism(data, seed, budgets, window, buffer, steps):
    R, H, S, D = len(budgets), 2, 16, 3
    policy, batch = batch_of("skipkv", [{"window": window, "buffer": buffer}] * R, budgets, H)
    gen = torch.Generator().manual_seed(seed)
    view = empty_view(R, H, S, D)
    budget = torch.tensor(budgets).view(-1, 1)
    for step in range(steps):
        batch.step = torch.full((R,), step)
        batch.inputs = data.draw(span_tables(R, step + 1))
        store(view, step, torch.randn(R, H, D, generator=gen))
        attention = torch.rand(R, H, S, generator=gen) * view.valid
        before = SlotView(view.valid.clone(), view.position.clone(), view.score.clone(), view.last_hit.clone(),
                          view.keys.clone())
        evict = policy.select_decode(batch, view, Observations(attention=attention))
        again = policy.select_decode(batch, before, Observations(attention=attention.clone()))
        assert torch.equal(evict, again)  # deterministic
        assert not (evict & (view.position == step)).any()  # never the current token
        assert not (evict & ~view.valid).any()
        evicted = evict.any(dim=-1)
        apply(view, evict)
        assert (view.held[evicted] <= budget.expand(-1, H)[evicted]).all()  # within budget after evicting
        assert (view.held <= budget + buffer - 1).all()


def test_ceiling_and_params():
    cls = get_policy("skipkv")
    assert cls().max_private_tokens(cls.Params(), 10, 100, 32) == 48
    spec = parse_kv_policy({"name": "skipkv", "budget": 64})
    assert spec.params == {"window": 8, "kernel": 7, "lambda_mix": 0.07, "buffer": 16, "scoring": "fast",
                           "tau": 0.9, "refresh": 16,
                           "steering": False, "alpha": 1.25, "alpha_step": 0.02, "alpha_max": 2.0, "layer": None}
    for bad in ({"tau": 1.5}, {"refresh": 0}, {"sigma": 0.5}):
        with pytest.raises(KVPolicyError) as info:
            parse_kv_policy({"name": "skipkv", "params": bad})
        assert info.value.field == f"kv_policy.params.{next(iter(bad))}"
