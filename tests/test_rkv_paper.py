"""rkv/skipkv with `scoring: "paper"` (policies/skipkv/rkv_paper.py): R-KV's
importance, redundancy and kept set worked by hand from the paper's
equations (R-KV, arXiv 2505.24133, §3: Eq. 1-7), `scoring: "fast"` bit for
bit as before, and the engine's query ring (radix_ext/query_ring.py) through
the real decode pass on CPU, captured-graph replay included."""

import math

import pytest
import torch

from kvsieve.policies import KVPolicyError, Need, Observations, PolicyBatch, SlotView, get_policy, parse_kv_policy
from kvsieve.policies.base import StepRow
from kvsieve.policies.observations import QUERY_WINDOW
from kvsieve.policies.skipkv.rkv_paper import (attention_over, corrected_redundancy, grouped_logits,
                                              own_recent_queries, window_importance)
from kvsieve.policies.skipkv.rkv_scores import keep_recent_and_top, rkv_scores
from kvsieve.radix_ext.region_graphs import RegionGraphs

from helpers.region_pass import TINY, random_qkv, region_pass, run_steps

LN2, LN3, SQRT2 = math.log(2.0), math.log(3.0), math.sqrt(2.0)


def softmax(xs):
    z = sum(math.exp(x) for x in xs)
    return [math.exp(x) / z for x in xs]


def view_of(positions, keys, queries=None, query_positions=None, S=None):
    """One row, one kv head: slots holding `positions` with `keys` [n][D]; the
    ring of queries [W][Hq][D] with their token positions."""
    S = S or len(positions)
    D = len(keys[0])
    valid = torch.zeros(1, 1, S, dtype=torch.bool)
    valid[0, 0, :len(positions)] = True
    position = torch.full((1, 1, S), -1, dtype=torch.int64)
    position[0, 0, :len(positions)] = torch.tensor(positions)
    k = torch.zeros(1, 1, S, D)
    k[0, 0, :len(keys)] = torch.tensor(keys)
    view = SlotView(valid=valid, position=position, score=torch.zeros(1, 1, S),
                    last_hit=torch.zeros(1, 1, S, dtype=torch.int32), keys=k)
    if queries is not None:
        view.queries = torch.tensor(queries, dtype=torch.float32).unsqueeze(0)
        view.query_position = torch.tensor(query_positions).unsqueeze(0)
    return view


def batch_of(name, params, budget, step):
    cls = get_policy(name)
    tensors, maxima = cls.batch_params([cls.Params(**({"buffer": 1} | p)) for p in params])
    R = len(params)
    return cls(), PolicyBatch(layer=0, budget=torch.full((R, 1), budget), step=torch.full((R,), step),
                              params=tensors, maxima=maxima)


def kept(view, evict):
    return set(view.position[0, 0][view.valid[0, 0] & ~evict[0, 0]].tolist())


# ----- the worked example ------------------------------------------------------
# One head, D = 2, tokens at positions 0-6; window 2: positions 5 and 6 (the
# observation tokens, 6 the current one) are protected, the candidates are
# 0-4 (n = 5). Keys: 0, 1 and 3 point along x, 2 and 4 along y (4 twice as
# long: cosines ignore length); 5 and 6 are never scored.
KEYS = [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 2.0], [1.0, 1.0], [-1.0, 1.0]]
# Queries of tokens 5 and 6, scaled so that q.k / sqrt(2) is a log:
# q5 = sqrt2 (0, ln 3): logits over 0-4 = 0, 0, ln 3, 0, 2 ln 3 -> e^: 1, 1, 3, 1, 9 (sum 15)
# q6 = sqrt2 (ln 2, 0): logits over 0-4 = ln 2, ln 2, 0, ln 2, 0 -> e^: 2, 2, 1, 2, 1 (sum 8)
Q5, Q6 = [0.0, SQRT2 * LN3], [SQRT2 * LN2, 0.0]
# The ring (slot = position mod 8) also holds the query of token 4 (older
# than the window) and one of token 9 (a previous request of the same
# req_pool row, which got further): both large, both ignored. The other
# slots are empty (-1).
RING = [[[0.0, 0.0]]] * QUERY_WINDOW
RING_POS = [-1] * QUERY_WINDOW
RING[1], RING_POS[1] = [[-40.0, 40.0]], 9
RING[4], RING_POS[4] = [[50.0, -50.0]], 4
RING[5], RING_POS[5] = [Q5], 5
RING[6], RING_POS[6] = [Q6], 6

# Importance (Eq. 1, 4), kernel 3 (each candidate and its neighbours by position):
#   q5: A = (1, 1, 3, 1, 9) / 15 -> pooled (1, 3, 3, 9, 9) / 15
#   q6: A = (2, 2, 1, 2, 1) / 8  -> pooled (2, 2, 2, 2, 2) / 8
#   I = mean of the two = (1/30 + 1/8, 3/30 + 1/8, 3/30 + 1/8, 9/30 + 1/8, 9/30 + 1/8)
IMPORTANCE = [1 / 30 + 1 / 8, 3 / 30 + 1 / 8, 3 / 30 + 1 / 8, 9 / 30 + 1 / 8, 9 / 30 + 1 / 8]
# = 0.158333, 0.225, 0.225, 0.425, 0.425

# Redundancy (Eq. 5, 6), T = 0.5, beta = 1. Cosines of the candidates: 1
# within {0, 1, 3} and within {2, 4}, 0 across; diagonal 0. For each token i,
# its newest near-duplicate j loses S[j, i]:
#   i = 0: {1, 3} -> 3 loses S[3, 0];  i = 1: {0, 3} -> 3 loses S[3, 1]
#   i = 2: {4}    -> 4 loses S[4, 2];  i = 3: {0, 1} -> 1 loses S[1, 3]
#   i = 4: {2}    -> 2 loses S[2, 4]
# Row sums: 0: S[0,1] + S[0,3] = 2;  1: S[1,0] = 1 (S[1,3] lost);
#   2: 0 (S[2,4] lost);  3: 0 (S[3,0], S[3,1] lost);  4: 0 (S[4,2] lost)
# S_bar = (2, 1, 0, 0, 0) / 5; R = softmax(0.4, 0.2, 0, 0, 0):
#   e^.4 = 1.491825, e^.2 = 1.221403, sum 5.713227 -> 0.261118, 0.213785, 0.175032 x 3
# The newest of the x-keys (3) is as unredundant as the lone y-pair; 0 and 1 pay.
REDUNDANCY = softmax([2 / 5, 1 / 5, 0.0, 0.0, 0.0])


def example_view(order=range(7), S=8):
    """The example's slots in `order` (a permutation: scores go by position, not slot), one free slot."""
    order = list(order)
    return view_of(order, [KEYS[p] for p in order], RING, RING_POS, S=S)


def test_importance_by_hand():
    view = example_view()
    candidates = view.valid & (view.position < 5)
    importance = window_importance(view, candidates, step=torch.tensor([6]), window=torch.tensor([2]),
                                   kernel=torch.tensor([3]), max_kernel=3)
    assert importance[0, 0, :5].tolist() == pytest.approx(IMPORTANCE, abs=1e-6)


def test_redundancy_by_hand():
    view = example_view()
    candidates = view.valid & (view.position < 5)
    redundancy = corrected_redundancy(view.keys, candidates, view.position)[0, 0]
    assert redundancy[:5].tolist() == pytest.approx(REDUNDANCY, abs=1e-6)
    assert redundancy[5:].tolist() == [0.0, 0.0, 0.0]  # protected and free slots are not candidates


def test_redundancy_threshold_by_hand():
    # Unit keys k0 = (1, 0), k1 = (0.28, 0.96), k2 = (0.6, 0.8): cosines
    # S[0,1] = 0.28 (below T: counted, never lost), S[0,2] = 0.6, S[1,2] = 0.936.
    #   i = 0: near {2}    -> 2 loses S[2, 0]
    #   i = 1: near {2}    -> 2 loses S[2, 1]
    #   i = 2: near {0, 1} -> the newest, 1, loses S[1, 2]
    # Row sums: 0: 0.28 + 0.6 = 0.88;  1: 0.28;  2: 0. Over n = 3, softmaxed.
    view = view_of([0, 1, 2], [[1.0, 0.0], [0.28, 0.96], [0.6, 0.8]])
    redundancy = corrected_redundancy(view.keys, view.valid, view.position)[0, 0]
    assert redundancy.tolist() == pytest.approx(softmax([0.88 / 3, 0.28 / 3, 0.0]), abs=1e-6)


def test_gqa_takes_the_max_logit_of_the_query_group_then_softmaxes():
    # Eq. 3: one kv head read by two query heads, keys (1, 0), (0, 1), (1, 1).
    # g0 = sqrt2 (ln 2, 0): logits ln 2, 0, ln 2;  g1 = sqrt2 (0, ln 4): 0, ln 4, ln 4.
    # Max over the group: ln 2, ln 4, ln 4 -> e^: 2, 4, 4 -> 0.2, 0.4, 0.4
    # (the mean of the two softmaxes would be 0.256, 0.322, 0.422).
    view = view_of([0, 1, 2], [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]],
                   [[[SQRT2 * LN2, 0.0], [0.0, SQRT2 * math.log(4.0)]]], [2])
    attention = attention_over(grouped_logits(view.queries, view.keys), view.valid)
    assert attention[0, 0, 0].tolist() == pytest.approx([0.2, 0.4, 0.4], abs=1e-6)


def test_only_the_rows_own_last_window_queries_count():
    # Newest token 20. Window 3 at decode step 10: positions 18-20. At decode
    # step 1 (two decode tokens so far, 19 and 20): 19-20 only, whatever the
    # ring holds for 18 (a previous request's token). Empty slots (-1) never.
    positions = torch.tensor([[18, 19, 20, 17, 21, -1, 12, 5]])
    newest = torch.tensor([20])
    own = own_recent_queries(positions, newest, torch.tensor([10]), torch.tensor([3]))
    assert own[0].tolist() == [True, True, True, False, False, False, False, False]
    own = own_recent_queries(positions, newest, torch.tensor([1]), torch.tensor([3]))
    assert own[0].tolist() == [False, True, True, False, False, False, False, False]


@pytest.mark.parametrize("budget, kept_positions", [
    # Score (Eq. 7), lambda 0.1: Z = 0.1 I - 0.9 R over candidates 0-4:
    #   0: 0.015833 - 0.235006 = -0.219173
    #   1: 0.0225   - 0.192406 = -0.169906
    #   2: 0.0225   - 0.157529 = -0.135029
    #   3: 0.0425   - 0.157529 = -0.115029
    #   4: 0.0425   - 0.157529 = -0.115029
    # The window (5, 6) plus budget - 2 of the best: 3 and 4, then 2.
    (4, {3, 4, 5, 6}),
    (5, {2, 3, 4, 5, 6}),
])
@pytest.mark.parametrize("name", ["rkv", "skipkv"])
def test_paper_decision_by_hand(name, budget, kept_positions):
    # Slots shuffled (positions 4, 0, 6, 2, 5, 1, 3) and one free: the scores go by position.
    # skipkv with no redundant sentence evicts as rkv does.
    policy, batch = batch_of(name, [{"scoring": "paper", "window": 2, "kernel": 3, "lambda_mix": 0.1}], budget,
                             step=6)
    view = example_view(order=[4, 0, 6, 2, 5, 1, 3])
    evict = policy.select_decode(batch, view, Observations(attention=torch.rand(1, 1, 8) * view.valid))
    assert kept(view, evict) == kept_positions


def test_paper_scores_by_hand():
    policy, batch = batch_of("rkv", [{"scoring": "paper", "window": 2, "kernel": 3, "lambda_mix": 0.1}], 4,
                             step=6)
    view = example_view()
    scores = policy._scores(batch, view)[0, 0, :5]
    expected = [0.1 * i - 0.9 * r for i, r in zip(IMPORTANCE, REDUNDANCY)]
    assert scores.tolist() == pytest.approx(expected, abs=1e-6)


def test_paper_prefill_cut_uses_the_prompt_window_mean_and_the_papers_redundancy():
    # No decode queries at a prefill cut: the importance is the running mean
    # the prompt's last queries started (as "fast"), the redundancy the
    # paper's. lambda 1: importance only, kernel 1, window 2, budget 4 over
    # positions 0-5: attention 0.2 0.9 0.4 0.1 0.6 0.8 summed over 2 queries
    # -> means 0.1 0.45 0.2 0.05 (0.3 0.4): keep 4, 5 and the best two, 1 and 2.
    policy, batch = batch_of("rkv", [{"scoring": "paper", "window": 2, "kernel": 1, "lambda_mix": 1.0}], 4,
                             step=0)
    view = view_of(list(range(6)), [[1.0, 0.0]] * 6)
    evict = policy.select_prefill(batch, view, Observations(attention=torch.tensor([[[0.2, 0.9, 0.4, 0.1, 0.6,
                                                                                      0.8]]])))
    assert kept(view, evict) == {1, 2, 4, 5}


# ----- "fast" unchanged -----------------------------------------------------------

def random_view(R, H, S, D, gen, queries=True):
    valid = torch.rand(R, H, S, generator=gen) < 0.85
    position = torch.where(valid, torch.randperm(S, generator=gen).expand(R, H, S), torch.full((), -1))
    view = SlotView(valid=valid, position=position, score=torch.rand(R, H, S, generator=gen),
                    last_hit=torch.randint(0, 9, (R, H, S), generator=gen, dtype=torch.int32),
                    keys=torch.randn(R, H, S, D, generator=gen))
    if queries:
        view.queries = torch.randn(R, QUERY_WINDOW, 2 * H, D, generator=gen)
        view.query_position = S - 1 - torch.arange(QUERY_WINDOW).expand(R, -1)
    return view


def clone(view):
    return SlotView(*(t.clone() if t is not None else None for t in (view.valid, view.position, view.score,
                                                                       view.last_hit, view.keys, view.queries,
                                                                       view.query_position)))


@pytest.mark.parametrize("seed", range(5))
def test_fast_scoring_is_the_previous_code_bit_for_bit(seed):
    # scoring "fast" (default): the decision is exactly the one before
    # `scoring` existed: observe, rkv_scores, keep_recent_and_top, due heads.
    gen = torch.Generator().manual_seed(seed)
    R, H, S, D = 3, 2, 24, 4
    params = [{"window": 4, "kernel": 3}, {"window": 2, "kernel": 5, "lambda_mix": 0.3}, {}]
    policy, batch = batch_of("rkv", params, 10, step=5)
    assert batch.max_param("paper") == 0
    view = random_view(R, H, S, D, gen)
    attention = torch.rand(R, H, S, generator=gen) * view.valid
    before = clone(view)
    evict = policy.select_decode(batch, view, Observations(attention=attention))

    policy.observe_decode(batch, before, Observations(attention=attention))  # the running mean, as before
    score = rkv_scores(before, before.score, batch.param("lambda_mix"), batch.param("kernel"),
                       batch.max_param("kernel"))
    keep = keep_recent_and_top(before, score, batch.budget, batch.param("window"))
    assert torch.equal(evict, before.valid & ~keep)  # buffer 1: every head over its budget is due
    assert torch.equal(view.score, before.score) and torch.equal(view.last_hit, before.last_hit)


@pytest.mark.parametrize("name", ["rkv", "skipkv"])
def test_fast_rows_decide_alike_beside_paper_rows(name):
    # A "fast" row in a batch with a "paper" row evicts exactly what it
    # evicts in a batch of its own (rows are decided apart).
    gen = torch.Generator().manual_seed(3)
    R, H, S, D = 2, 2, 24, 4
    view = random_view(R, H, S, D, gen)
    attention = torch.rand(R, H, S, generator=gen) * view.valid
    _, mixed = batch_of(name, [{"window": 4}, {"window": 4, "scoring": "paper"}], 10, step=7)
    policy, alone = batch_of(name, [{"window": 4}], 10, step=7)
    assert mixed.max_param("paper") == 1
    both = clone(view)
    evict_both = policy.select_decode(mixed, both, Observations(attention=attention))
    first = SlotView(*(t[:1].clone() for t in (view.valid, view.position, view.score, view.last_hit, view.keys,
                                                view.queries, view.query_position)))
    evict_alone = policy.select_decode(alone, first, Observations(attention=attention[:1]))
    assert torch.equal(evict_both[:1], evict_alone)
    # and the paper row did decide by the paper: its kept set differs from a fast decision's
    _, fast = batch_of(name, [{"window": 4}] * 2, 10, step=7)
    assert not torch.equal(evict_both[1], policy.select_decode(fast, clone(view),
                                                               Observations(attention=attention))[1])


@pytest.mark.parametrize("name", ["rkv", "skipkv"])
def test_queries_are_asked_for_only_in_steps_with_a_paper_row(name):
    cls = get_policy(name)
    policy = cls()

    def rows(*scorings):
        return [StepRow(state=policy.begin_request(cls.Params(scoring=s), 1, 1), step=3, pool_row=1, budget=8,
                        prefill=False) for s in scorings]
    policy.deciding_rows(rows("fast", "fast"))
    assert policy.needs == cls.needs and not policy.needs & Need.QUERIES
    policy.deciding_rows(rows("fast", "paper"))
    assert policy.needs == cls.needs | Need.QUERIES
    policy.deciding_rows(rows("fast"))
    assert policy.needs == cls.needs  # the paper request ended: fast traffic keeps no queries
    assert not cls.needs & Need.QUERIES  # the class itself never changes


def test_scoring_param():
    assert parse_kv_policy({"name": "rkv", "params": {"scoring": "paper"}}).params["scoring"] == "paper"
    assert parse_kv_policy({"name": "skipkv"}).params["scoring"] == "fast"
    for params, why in [({"scoring": "exact"}, "'fast' or 'paper'"),
                        ({"scoring": "paper", "window": 16}, "window must be at most 8")]:
        for name in ("rkv", "skipkv"):
            with pytest.raises(KVPolicyError) as info:
                parse_kv_policy({"name": name, "params": params})
            assert info.value.field == "kv_policy.params.scoring" and why in str(info.value)
    assert parse_kv_policy({"name": "rkv", "params": {"window": 16}}).params["window"] == 16  # fast: any window


# ----- the engine's query ring, through the real decode pass (CPU) --------------

ROWS, PROMPT, STEPS, BUDGET = 3, 8, 24, 8
PAPER = {"scoring": "paper", "buffer": 4, "window": 4}  # window < budget: scores choose


@pytest.mark.parametrize("name", ["rkv", "skipkv"])
def test_the_decode_pass_keeps_each_rows_queries_in_its_ring(name):
    run = region_pass(name, rows=ROWS, prompt=PROMPT, steps=STEPS, shapes=TINY, budget=BUDGET, device="cpu",
                      dtype=torch.float32, params=PAPER)
    try:
        gen = torch.Generator().manual_seed(0)
        queries = []
        for s in range(10):
            q, k, v = random_qkv(ROWS, TINY, gen, "cpu", torch.float32)
            run.step(s, q, k, v)
            queries.append(q)
        ring = run.backend.query_ring
        assert ring is not None and ring.queries.shape == (ROWS + 1, TINY.layers, QUERY_WINDOW, TINY.q_heads,
                                                           TINY.head_dim)
        for s in range(2, 10):  # the last 8 steps, in every layer (the step's q is the same in each here)
            pos = PROMPT + s
            for row in range(ROWS):  # request r has req_pool row r + 1
                assert torch.equal(ring.queries[row + 1, :, pos % QUERY_WINDOW], queries[s][row].expand(
                    TINY.layers, -1, -1))
                assert ring.position[row + 1, :, pos % QUERY_WINDOW].tolist() == [pos] * TINY.layers
        held = run.held_tokens_per_head()
        cls = get_policy(name)
        assert all(n <= cls().max_private_tokens(cls.Params(**PAPER), 0, STEPS, BUDGET) for n in held)
    finally:
        run.close()


def test_fast_traffic_makes_no_ring():
    run = region_pass("rkv", rows=ROWS, prompt=PROMPT, steps=4, shapes=TINY, budget=BUDGET, device="cpu",
                      dtype=torch.float32)
    try:
        gen = torch.Generator().manual_seed(0)
        for s in range(4):
            run.step(s, *random_qkv(ROWS, TINY, gen, "cpu", torch.float32))
        assert run.backend.query_ring is None
    finally:
        run.close()


def test_paper_scoring_changes_what_the_pass_keeps():
    # Same inputs, fast against paper: the decisions read the queries (else
    # they would agree whenever the redundancies do).
    args = dict(rows=ROWS, prompt=PROMPT, steps=STEPS, shapes=TINY, budget=BUDGET, device="cpu",
                dtype=torch.float32)
    fast = run_steps("rkv", **args, params={"buffer": 4, "window": 4})
    paper = run_steps("rkv", **args, params=PAPER)
    assert not torch.equal(fast["state"][1], paper["state"][1])  # the positions held


class RerunGraphs(RegionGraphs):
    """Replays by running the captured pass again on the static tensors (CPU)."""

    def capture(self, static_pass):
        from types import SimpleNamespace

        return SimpleNamespace(replay=static_pass)


@pytest.mark.parametrize("policy", ["rkv", "skipkv", "rkv+skipkv+h2o"])
def test_paper_pass_on_captured_static_tensors_equals_the_eager_pass(policy):
    # The ring is written in the attention segment and read in the group
    # segments: replayed, they equal the eager pass bit for bit (also in a
    # batch where h2o's rows keep no queries of their own).
    eager = paper_steps(policy)
    graphed = paper_steps(policy, graphs=RerunGraphs())
    captures, replays = graphed["captures_replays"]
    assert captures >= TINY.layers and replays > TINY.layers * STEPS // 2
    assert torch.equal(eager["outputs"], graphed["outputs"])
    for a, b in zip(eager["state"], graphed["state"]):
        assert torch.equal(a, b)


def paper_steps(policy, graphs=None):
    """run_steps (helpers/region_pass.py) with the rkv and skipkv rows
    scoring as the paper (region_pass gives every row the same params, which
    h2o does not take)."""
    from kvsieve.radix_ext.runtime import RUNTIME

    torch.manual_seed(0)
    run = region_pass(policy, ROWS, PROMPT, STEPS, shapes=TINY, budget=BUDGET, device="cpu",
                      dtype=torch.float32, graphs=graphs)
    try:
        for rid in run.rids:
            req = RUNTIME.requests[rid]
            if req.policy.name in ("rkv", "skipkv"):
                req.params = req.state.params = req.params.model_copy(update=PAPER)
        gen = torch.Generator().manual_seed(0)
        outputs = torch.stack([run.step(s, *random_qkv(ROWS, TINY, gen, "cpu", torch.float32))
                               for s in range(STEPS)])
        stats = (graphs.captures, graphs.replays) if graphs is not None else (0, 0)
        return {"outputs": outputs, "state": run.region_state(), "captures_replays": stats}
    finally:
        run.close()
