"""Per-head page targets (radix_ext/head_pages.py) on a real PageManager:
compaction packs each head's tokens, pages per head change, the request's
total stays, tokens (K/V and slot state) survive the move."""

import pytest
import torch

from hypothesis import given, settings
from hypothesis import strategies as st

from kvsieve.radix_ext.head_pages import compact_request, fit_budgets_to_pages, page_counts, retarget_pages
from kvsieve.radix_ext.pages import PageManager, RegionConfig

L, H, D, P = 2, 2, 4, 4


def manager():
    return PageManager(RegionConfig(num_layers=L, num_kv_heads=H, head_dim=D, num_pages=32, page_size=P, max_rows=4))


def write_token(m, page, offset, position):
    m.valid[page, offset] = True
    m.position[page, offset] = position
    m.k[page, offset] = float(position)
    m.v[page, offset] = -float(position)
    m.score[page, offset] = position / 10


def tokens_of(m, pages):
    """(position, k, v, score) of each valid slot of one head, in slot order."""
    out = []
    for page in pages.tolist():
        if page == m.null_page:
            continue
        for off in range(P):
            if m.valid[page, off]:
                out.append((int(m.position[page, off]), float(m.k[page, off, 0]), float(m.v[page, off, 0]),
                            round(float(m.score[page, off]), 4)))
    return out


def test_compaction_then_pages_move_between_heads_and_layers_total_kept():
    m = manager()
    m.allocate("a", 2)  # 2 pages x 4 heads = 8 pages, 8 slots per head
    m.bind("a", row=1)
    m.flush()
    pages = m._owned["a"].pages.clone()
    # Layer 0 head 0 keeps tokens 3 (slot 1), 5 (slot 4), 7 (slot 6): spread over both pages.
    for slot, pos in ((1, 3), (4, 5), (6, 7)):
        write_token(m, pages[0, 0, slot // P], slot % P, pos)
    # Layer 1 head 1 keeps 2 tokens in its second page.
    for slot, pos in ((5, 9), (7, 11)):
        write_token(m, pages[1, 1, slot // P], slot % P, pos)
    before = tokens_of(m, pages[0, 0]), tokens_of(m, pages[1, 1])
    compact_request(m, "a")
    # Packed in slot order into the first slots: head (0, 0) slots 0-2, head (1, 1) slots 0-1.
    assert [int(p) for p in m.position[pages[0, 0, 0]]] == [3, 5, 7, -1]
    assert not m.valid[pages[0, 0, 1]].any() and not m.valid[pages[1, 1, 1]].any()
    assert (tokens_of(m, pages[0, 0]), tokens_of(m, pages[1, 1])) == before
    # Head (0, 0) and (1, 1) give a page each: (0, 1) gets 3, (1, 0) gets 3.
    retarget_pages(m, "a", torch.tensor([[1, 3], [3, 1]]))
    assert page_counts(m, "a").tolist() == [[1, 3], [3, 1]]
    assert m.pages_of("a") == 8 and m.pages_used == 8
    owned = m._owned["a"].pages
    assert sorted(owned[owned != m.null_page].tolist()) == sorted(pages.flatten().tolist())  # same pages
    m.flush()
    assert torch.equal(m.table[1, :, :, :3], owned)
    assert (tokens_of(m, m.table[1, 0, 0]), tokens_of(m, m.table[1, 1, 1])) == before
    assert m.free("a") == 8 and m.pages_free == 32


def test_page_targets_must_keep_the_total():
    m = manager()
    m.allocate("a", 2)
    with pytest.raises(ValueError):
        retarget_pages(m, "a", torch.tensor([[3, 3], [3, 1]]))


def test_budgets_fit_to_pages_keep_the_total_and_cap_short_heads():
    # Budgets [[5, 1], [2, 12]] (20) + 1 room each, 8 pages of 4 (32 slots).
    # Need 6, 2, 3, 13 (24); a budget of 1 needs one page: one each, the other 4 by need:
    # 4 * [6, 2, 3, 13] / 24 = 1, .333, .5, 2.167 -> floors 1, 0, 0, 2 (3),
    # the last to the largest remainder (.5, head (1, 0)) -> pages 2, 1, 2, 3.
    # Capped: min(5, 7), min(1, 3), min(2, 7), min(12, 11) = 5, 1, 2, 11.
    pages, capped = fit_budgets_to_pages(torch.tensor([[5, 1], [2, 12]]), extra=1, page_size=4, total_pages=8)
    assert pages.tolist() == [[2, 1], [2, 3]] and capped.tolist() == [[5, 1], [2, 11]]
    with pytest.raises(ValueError):
        fit_budgets_to_pages(torch.tensor([[5, 1], [2, 12]]), extra=1, page_size=4, total_pages=3)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 40), st.integers(0, 8), st.integers(1, 8),
       st.integers(0, 2**16))
def test_fitted_pages_keep_the_total_and_hold_each_capped_budget(layers, heads, budget, extra, size, seed):
    # A uniform admission (ceil((budget + extra) / size) pages per head) then
    # any re-dealt budgets of the same total: pages sum to what is owned, each
    # head's pages hold its capped budget + extra, and budgets never grow.
    g = torch.Generator().manual_seed(seed)
    owned = layers * heads * -(-(budget + extra) // size)
    weights = torch.rand(layers, heads, generator=g) + 0.01
    new = 1 + (weights / weights.sum() * (budget - 1) * layers * heads).floor().to(torch.int64)  # >= 1 each
    pages, capped = fit_budgets_to_pages(new, extra, size, owned)
    assert int(pages.sum()) == owned and int(pages.min()) >= 1
    assert bool((capped <= new).all()) and int(new.sum()) <= budget * layers * heads
    assert bool((capped + extra <= pages * size).all()) and int(capped.min()) >= 1


def test_crystal_kv_realloc_moves_pages_a_step_later_through_plan_head_pages():
    # The engine's hook with the real policy and a real PageManager: budget 6
    # per head (+1 room: 2 pages of 4 each, 8 pages), CRF sums making layer 0
    # head 0 the busiest. Step 4 (realloc_interval 4): Algorithm 2 with floor 1
    # gives weights [[6, 1], [1, 0]]/8 of 24 - 4 floors = 15, 2.5, 2.5, 0 ->
    # 15, 2, 2, 0, the one left to the .5 tie's first -> +1 each = [[16, 4], [3, 1]]; pages dealt by
    # need (+1 room) over 8 - 4 base pages: 4 * [17, 5, 4, 2] / 28 = 2.43, .71,
    # .57, .29 -> 2, 0, 0, 0, the 2 left to .71 and .57 -> [[3, 2], [2, 1]];
    # capped budgets min(16, 11), min(4, 7), min(3, 7), min(1, 3) = 11, 4, 3, 1.
    from types import SimpleNamespace

    from kvsieve.policies import parse_kv_policy
    from kvsieve.policies.base import ModelInfo
    from kvsieve.policies.crystal_kv.policy import CrystalKVPolicy
    from kvsieve.radix_ext.head_pages import plan_head_pages

    m = manager()
    policy = CrystalKVPolicy()
    policy.bind_model(ModelInfo(name="t", num_layers=L, num_kv_heads=H, num_q_heads=H, head_dim=D))
    spec = parse_kv_policy({"name": "crystal_kv", "budget": 6, "params": {
        "adaptive": True, "realloc_interval": 4, "min_head_budget": 1, "think_end": "", "evict_interval": 1}})
    params = CrystalKVPolicy.Params(**spec.params)
    req = SimpleNamespace(rid="a", policy=policy, params=params, state=policy.begin_request(params, L, H))
    m.allocate("a", 2)
    m.bind("a", row=2)
    m.flush()
    policy._crf_sums = torch.zeros(4, L, H)
    policy._crf_sums[2] = torch.tensor([[6.0, 1.0], [1.0, 0.0]])
    plan_head_pages(m, req, step=3, pool_row=2, budget=6)
    assert req.state.head_budgets is None and page_counts(m, "a").tolist() == [[2, 2], [2, 2]]
    plan_head_pages(m, req, step=4, pool_row=2, budget=6)
    assert req.state.head_budgets.tolist() == [[11, 4], [3, 1]] and req.state.realloc_now
    assert page_counts(m, "a").tolist() == [[2, 2], [2, 2]]  # pages wait for this step's eviction
    plan_head_pages(m, req, step=5, pool_row=2, budget=6)
    assert page_counts(m, "a").tolist() == [[3, 2], [2, 1]] and m.pages_of("a") == 8
    m.flush()
    assert torch.equal((m.table[2] != m.null_page).sum(-1), torch.tensor([[3, 2], [2, 1]]))
