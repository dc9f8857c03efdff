"""rkv (R-KV baseline): hand-worked scores and evictions, the running window
of attention, a plain-Python reference over many steps with several rows of
different budgets and parameters in one batched call, and hypothesis
properties (within budget after an eviction step, the current token kept,
deterministic)."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsieve.policies import Observations, PolicyBatch, SlotView, get_policy, parse_kv_policy, KVPolicyError
from kvsieve.policies.base import StepRow
from kvsieve.policies.skipkv.rkv_scores import key_redundancy, observe_attention


def view_of(positions, keys, S=None):
    """One row, one head per list in positions/keys ([H][n] positions, [H][n][D] keys)."""
    H = len(positions)
    S = S or max(len(p) for p in positions)
    D = len(keys[0][0])
    valid = torch.zeros(1, H, S, dtype=torch.bool)
    position = torch.full((1, H, S), -1, dtype=torch.int64)
    k = torch.zeros(1, H, S, D)
    for h in range(H):
        n = len(positions[h])
        valid[0, h, :n] = True
        position[0, h, :n] = torch.tensor(positions[h])
        k[0, h, :n] = torch.tensor(keys[h], dtype=torch.float32)
    return SlotView(valid=valid, position=position, score=torch.zeros(1, H, S),
                    last_hit=torch.zeros(1, H, S, dtype=torch.int32), keys=k)


def batch_of(name, params, budgets, H):
    """The policy and a batch of rows with `params`. The scoring tests decide
    every step (buffer 1) unless they set a buffer: the decision cadence has
    tests of its own."""
    cls = get_policy(name)
    rows = [cls.Params(**({"buffer": 1} | p)) for p in params]
    tensors, maxima = cls.batch_params(rows)
    budget = torch.tensor(budgets).unsqueeze(1).expand(-1, H).contiguous()
    return cls(), PolicyBatch(layer=0, budget=budget, step=torch.zeros(len(rows), dtype=torch.int64),
                              params=tensors, maxima=maxima)


# Four unit keys: k0 = k1 = (1, 0), k2 = (0, 1), k3 = (0.6, 0.8). Their sum is
# (2.6, 1.8); the sum of cosines to the other keys is k.(2.6, 1.8) - 1:
# 1.6, 1.6, 0.8, 2.0; over 4 held slots: 0.4, 0.4, 0.2, 0.5. Softmax:
# e^.4 = 1.491825, e^.2 = 1.221403, e^.5 = 1.648721, sum 5.853774:
# 0.254848, 0.254848, 0.208652, 0.281651.
KEYS = [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.6, 0.8]]
REDUNDANCY = [0.254848, 0.254848, 0.208652, 0.281651]


def test_key_redundancy_by_hand():
    view = view_of([[0, 1, 2, 3]], [KEYS], S=6)  # two free slots: ignored, 0
    red = key_redundancy(view.keys, view.valid)[0, 0]
    assert red[:4].tolist() == pytest.approx(REDUNDANCY, abs=1e-6)
    assert red[4:].tolist() == [0.0, 0.0]


def test_key_redundancy_ignores_key_length():
    # Cosine: scaling a key changes nothing.
    scaled = [[3.0, 0.0], [0.5, 0.0], [0.0, 7.0], [1.2, 1.6]]
    view = view_of([[0, 1, 2, 3]], [scaled])
    assert key_redundancy(view.keys, view.valid)[0, 0].tolist() == pytest.approx(REDUNDANCY, abs=1e-6)


@pytest.mark.parametrize("lambda_mix, kept", [
    # score = lambda * attention - (1 - lambda) * redundancy, attention
    # (0.5, 0.3, 0.1, 0.1), kernel 1 (no pooling), window 1: position 3 (the
    # current token) is kept, the budget's one other slot goes to the best of
    # positions 0-2.
    # lambda 0.5: 0.25 - 0.127424 = 0.122576, 0.15 - 0.127424 = 0.022576,
    #             0.05 - 0.104326 = -0.054326: keep position 0.
    (0.5, {0, 3}),
    # lambda 0.07 (R-KV's default): 0.035 - 0.237009 = -0.202009,
    #             0.021 - 0.237009 = -0.216009, 0.007 - 0.194046 = -0.187046:
    #             the least redundant key, position 2, wins.
    (0.07, {2, 3}),
])
def test_rkv_evicts_by_hand(lambda_mix, kept):
    policy, batch = batch_of("rkv", [{"lambda_mix": lambda_mix, "kernel": 1, "window": 1}], [2], H=1)
    view = view_of([[0, 1, 2, 3]], [KEYS])
    view.last_hit[:] = 5  # a long-seen window: the mean moves by 1/window = 1, i.e. to the attention
    attention = torch.tensor([[[0.5, 0.3, 0.1, 0.1]]])
    evict = policy.select_decode(batch, view, Observations(attention=attention))
    assert set(view.position[0, 0][~evict[0, 0]].tolist()) == kept


def test_rkv_pools_importance_over_neighbours_by_position():
    # Kernel 3 over positions (slots shuffled): attention by position
    # 0: 0.0, 1: 0.9, 2: 0.0, 3: 0.0, 4: 0.05 (current). lambda 1 (importance
    # only), window 1, budget 3: pooled 0.9, 0.9, 0.9, 0.05, 0.05 -> positions
    # 0, 1, 2 tie at 0.9; ties go to the lower slot. Slots hold positions
    # [4, 2, 0, 3, 1]: the current token (4) and two of {2, 0, 1} by slot: 2, 0.
    policy, batch = batch_of("rkv", [{"lambda_mix": 1.0, "kernel": 3, "window": 1}], [3], H=1)
    view = view_of([[4, 2, 0, 3, 1]], [[[1.0, 0.0]] * 5])
    view.last_hit[:] = 1
    by_position = {0: 0.0, 1: 0.9, 2: 0.0, 3: 0.0, 4: 0.05}
    attention = torch.tensor([[[by_position[p] for p in [4, 2, 0, 3, 1]]]])
    evict = policy.select_decode(batch, view, Observations(attention=attention))
    assert set(view.position[0, 0][~evict[0, 0]].tolist()) == {4, 2, 0}


def test_running_window_mean_by_hand():
    # window 4. Slot 0: new (count 0) -> takes 0.6, count 1. Slot 1: count 2,
    # mean 0.3, sees 0.6 -> 0.3 + 0.3/3 = 0.4, count 3. Slot 2: count 4
    # (saturated), mean 0.2, sees 1.0 -> 0.2 + 0.8/4 = 0.4, count 4. Slot 3 is
    # free: untouched.
    view = view_of([[0, 1, 2]], [[[1.0]] * 3], S=4)
    view.score[0, 0] = torch.tensor([0.0, 0.3, 0.2, 0.0])
    view.last_hit[0, 0] = torch.tensor([0, 2, 4, 0], dtype=torch.int32)
    observe_attention(view, torch.tensor([[[0.6, 0.6, 1.0, 0.9]]]), torch.tensor([4]))
    assert view.score[0, 0].tolist() == pytest.approx([0.6, 0.4, 0.4, 0.0])
    assert view.last_hit[0, 0].tolist() == [1, 3, 4, 0]


def test_prefill_cut_by_hand():
    # A 6-token private prompt, positions 0-5, one head; the attention summed
    # over the prompt's last min(window 2, 6) = 2 queries: 0.2 0.9 0.4 0.1
    # 0.6 0.8 -> running means 0.1 0.45 0.2 0.05 0.3 0.4, each seen twice.
    # lambda 1, kernel 1, budget 4: the newest 2 (4, 5) plus the best 2 of
    # 0-3 by mean: 1 (0.45) and 2 (0.2).
    policy, batch = batch_of("rkv", [{"lambda_mix": 1.0, "kernel": 1, "window": 2}], [4], H=1)
    view = view_of([[0, 1, 2, 3, 4, 5]], [[[1.0, 0.0]] * 6])
    evict = policy.select_prefill(batch, view, Observations(attention=torch.tensor([[[0.2, 0.9, 0.4, 0.1, 0.6, 0.8]]])))
    assert set(view.position[0, 0][~evict[0, 0]].tolist()) == {1, 2, 4, 5}
    assert view.score[0, 0].tolist() == pytest.approx([0.1, 0.45, 0.2, 0.05, 0.3, 0.4])
    assert view.last_hit[0, 0].tolist() == [2] * 6


def test_attention_of_a_query_group_is_averaged():
    # 4 query heads per kv head: the engine's attention is the group's sum;
    # R-KV's importance is the group mean (0.8 / 4 = 0.2).
    from kvsieve.policies.base import ModelInfo

    policy, batch = batch_of("rkv", [{}], [8], H=1)
    policy.bind_model(ModelInfo(name="t", num_layers=1, num_kv_heads=2, num_q_heads=8, head_dim=2))
    view = view_of([[0]], [[[1.0, 0.0]]])
    policy.select_decode(batch, view, Observations(attention=torch.tensor([[[0.8]]])))
    assert view.score[0, 0, 0].item() == pytest.approx(0.2)


def test_buffer_decides_every_buffer_steps_down_to_the_budget():
    # budget 2, buffer 3: the row decides at steps 2, 5, 8 (every 3rd), each
    # time cutting the head back to 2; between, it grows to at most 2 + 3.
    policy, batch = batch_of("rkv", [{"buffer": 3, "window": 1}], [2], H=1)
    view = empty_view(1, 1, 8, 2)
    held = []
    for step in range(9):
        batch.step = torch.tensor([step])
        store(view, step, torch.tensor([[[1.0, float(step)]]]))
        apply(view, policy.select_decode(batch, view, Observations(attention=torch.rand(1, 1, 8) * view.valid)))
        held.append(int(view.held))
    assert held == [1, 2, 2, 3, 4, 2, 3, 4, 2]
    rows = [StepRow(state=None, step=s, pool_row=0, budget=2, prefill=False) for s in range(9)]
    for row in rows:
        row.state = policy.begin_request(get_policy("rkv").Params(buffer=3), 1, 1)
    assert policy.deciding_rows(rows) == [s in (2, 5, 8) for s in range(9)]


def test_observe_decode_folds_attention_as_the_decision_does_and_evicts_nothing():
    # Between decisions a row only observes: the running mean moves exactly
    # as in a decision step's own observation.
    policy, batch = batch_of("rkv", [{"buffer": 4, "window": 2}], [1], H=1)
    observed, decided = empty_view(1, 1, 4, 2), empty_view(1, 1, 4, 2)
    for step in range(3):
        for view in (observed, decided):
            store(view, step, torch.tensor([[[1.0, float(step)]]]))
        attention = torch.rand(1, 1, 4) * observed.valid
        batch.step = torch.tensor([step])  # steps 0-2: no decision is due (buffer 4)
        assert policy.observe_decode(batch, observed, Observations(attention=attention)) is None
        evict = policy.select_decode(batch, decided, Observations(attention=attention.clone()))
        assert not evict.any()
    assert torch.equal(observed.score, decided.score) and torch.equal(observed.last_hit, decided.last_hit)


# ----- a plain-Python reference over many steps ---------------------------------

def reference_keep(held, budget, window, kernel, lam):
    """One head. held: {position: (running mean, key list)}. The kept positions."""
    order = sorted(held)
    if len(order) <= budget:
        return set(order)
    recent = set(order[len(order) - min(window, budget):])
    half = kernel // 2
    keys = {p: [x / (math.sqrt(sum(y * y for y in held[p][1])) + 1e-8) for x in held[p][1]] for p in order}
    mean_sim = {p: sum(sum(a * b for a, b in zip(keys[p], keys[q])) for q in order if q != p) / len(order)
                for p in order}
    z = sum(math.exp(v) for v in mean_sim.values())
    score = {}
    for i, p in enumerate(order):
        pooled = max(held[q][0] for q in order[max(0, i - half):i + half + 1])
        score[p] = lam * pooled - (1 - lam) * math.exp(mean_sim[p]) / z
    rest = sorted((p for p in order if p not in recent), key=lambda p: -score[p])
    return recent | set(rest[:budget - len(recent)])


def empty_view(R, H, S, D):
    return SlotView(valid=torch.zeros(R, H, S, dtype=torch.bool), position=torch.full((R, H, S), -1),
                    score=torch.zeros(R, H, S), last_hit=torch.zeros(R, H, S, dtype=torch.int32),
                    keys=torch.zeros(R, H, S, D))


def store(view, pos, key):
    """Token `pos` with keys key [R, H, D] into each head's first free slot (as the region does)."""
    slot = (~view.valid).int().argmax(dim=-1, keepdim=True)
    view.valid.scatter_(-1, slot, True)
    view.position.scatter_(-1, slot, pos)
    view.score.scatter_(-1, slot, 0.0)
    view.last_hit.scatter_(-1, slot, 0)
    view.keys.scatter_(2, slot.unsqueeze(-1).expand(*slot.shape, view.keys.shape[-1]), key.unsqueeze(2))
    return slot


def apply(view, evict):
    if evict is not None:
        view.valid &= ~evict
        view.position[~view.valid] = -1


def test_rkv_matches_reference_per_row_over_many_steps():
    cases = [  # (budget, window, kernel, lambda_mix) of each row
        (6, 2, 3, 0.07), (9, 8, 7, 0.5), (4, 1, 1, 0.9)]
    R, H, S, D = len(cases), 2, 16, 4
    policy, batch = batch_of("rkv", [{"window": w, "kernel": k, "lambda_mix": lam} for _, w, k, lam in cases],
                             [b for b, *_ in cases], H)
    gen = torch.Generator().manual_seed(7)
    view = empty_view(R, H, S, D)
    held = [[dict() for _ in range(H)] for _ in range(R)]  # position -> (mean, key, count)
    for step in range(30):
        key = torch.randn(R, H, D, generator=gen)
        store(view, step, key)
        table = torch.rand(R, H, 64, generator=gen)
        attention = torch.where(view.valid, table.gather(-1, view.position.clamp(min=0)), torch.zeros(()))
        apply(view, policy.select_decode(batch, view, Observations(attention=attention)))
        for r, (budget, window, kernel, lam) in enumerate(cases):
            for h in range(H):
                heads = held[r][h]
                heads[step] = (0.0, key[r, h].tolist(), 0)
                for p, (mean, k, n) in list(heads.items()):
                    n = min(n + 1, window)
                    heads[p] = (mean + (float(table[r, h, p]) - mean) / n, k, n)
                keep = reference_keep({p: (m, k) for p, (m, k, _) in heads.items()}, budget, window, kernel, lam)
                held[r][h] = {p: v for p, v in heads.items() if p in keep}
                got = set(view.position[r, h][view.valid[r, h]].tolist())
                assert got == keep, (step, r, h)


# ----- properties -------------------------------------------------------------------

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), budgets=st.lists(st.integers(1, 10), min_size=1, max_size=3),
       window=st.integers(1, 12), buffer=st.integers(1, 4), steps=st.integers(1, 24))
def test_properties_budget_current_token_determinism(seed, budgets, window, buffer, steps):
    R, H, S, D = len(budgets), 2, 16, 3
    policy, batch = batch_of("rkv", [{"window": window, "buffer": buffer}] * R, budgets, H)
    gen = torch.Generator().manual_seed(seed)
    view = empty_view(R, H, S, D)
    budget = torch.tensor(budgets).view(-1, 1)
    for step in range(steps):
        batch.step = torch.full((R,), step)
        store(view, step, torch.randn(R, H, D, generator=gen))
        attention = torch.rand(R, H, S, generator=gen) * view.valid
        before = SlotView(view.valid.clone(), view.position.clone(), view.score.clone(), view.last_hit.clone(),
                          view.keys.clone())
        evict = policy.select_decode(batch, view, Observations(attention=attention))
        again = policy.select_decode(batch, before, Observations(attention=attention.clone()))
        assert torch.equal(evict, again) and torch.equal(view.score, before.score)  # deterministic
        assert not (evict & (view.position == step)).any()  # never the current token
        assert not (evict & ~view.valid).any()
        evicted = evict.any(dim=-1)
        apply(view, evict)
        assert (view.held[evicted] <= budget.expand(-1, H)[evicted]).all()  # within budget after evicting
        assert (view.held <= budget + buffer - 1).all()  # never reaches budget + buffer after a step


def test_ceiling_and_params():
    cls = get_policy("rkv")
    assert cls().max_private_tokens(cls.Params(), 10, 100, 32) == 48  # budget + buffer 16
    assert cls().max_private_tokens(cls.Params(buffer=128), 10, 1000, 32) == 160
    assert cls().max_private_tokens(cls.Params(), 50, 100, 32) == 50  # the whole prompt until it is cut
    spec = parse_kv_policy({"name": "rkv", "budget": 64})
    assert spec.params == {"window": 8, "kernel": 7, "lambda_mix": 0.07, "buffer": 16, "scoring": "fast"}
    assert not spec.prompt_compressed  # decode-time: the prompt stays in the radix cache by default
    for bad in ({"kernel": 4}, {"window": 0}, {"lambda_mix": 1.5}, {"buffer": 0}, {"retain_ratio": 0.1}):
        with pytest.raises(KVPolicyError) as info:
            parse_kv_policy({"name": "rkv", "params": bad})
        assert info.value.field == f"kv_policy.params.{next(iter(bad))}"
