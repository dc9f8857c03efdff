"""The page manager (host allocation, device page table) and the batched
reference attention over prefix + region pages."""

import pytest
import torch

from kvsieve.kernels.attention_ref import attend_rows
from kvsieve.policies import Need
from kvsieve.radix_ext.pages import PageManager, RegionConfig, RegionFull

L, H, D, P = 2, 2, 8, 4


def manager(pages=64, rows=8):
    return PageManager(RegionConfig(num_layers=L, num_kv_heads=H, head_dim=D, num_pages=pages, page_size=P,
                                    max_rows=rows))


def test_ceiling_pages_are_allocated_at_admission_and_all_return():
    m = manager(pages=20)
    assert m.can_allocate(2) and not m.can_allocate(6)  # 2 pages x 4 (layer, head) pairs = 8
    m.allocate("a", 2)
    m.allocate("b", 3)
    assert m.pages_used == 8 + 12 and m.pages_free == 0
    with pytest.raises(RegionFull):
        m.allocate("c", 1)
    assert m.free("a") == 8 and m.pages_free == 8
    m.allocate("c", 2)
    assert m.free("b") == 12 and m.free("c") == 8
    assert m.pages_free == 20 and m.free("nobody") == 0


def test_the_table_row_is_written_at_the_next_flush_and_pages_are_cleared():
    m = manager()
    m.allocate("a", 2)
    m.bind("a", row=3)
    assert (m.table[3] == m.null_page).all()  # nothing reaches the device before flush
    pages = m._owned["a"].pages
    m.valid[pages[0, 0, 0]] = True  # stale state of a reused page
    m.flush()
    assert torch.equal(m.table[3, :, :, :2], pages)
    assert not m.valid[pages.flatten()].any()
    # Freed: the row goes back to null at the next flush, and its pages to the free list.
    m.free("a")
    m.flush()
    assert (m.table[3] == m.null_page).all()


def test_a_freed_row_rebound_in_the_same_step_keeps_the_new_pages():
    m = manager()
    m.allocate("a", 1)
    m.bind("a", 0)
    m.flush()
    m.free("a")
    m.allocate("b", 1)
    m.bind("b", 0)
    m.flush()
    assert torch.equal(m.table[0, :, :, :1], m._owned["b"].pages)


def test_held_tokens_of_rows_counts_through_the_device_table_as_held_tokens_does():
    m = manager(pages=80, rows=8)
    m.allocate("a", 2)
    m.allocate("b", 3)
    m.allocate("c", 1)
    m.bind("a", 5)
    m.bind("b", 1)
    m.flush()
    a, b = m._owned["a"].pages, m._owned["b"].pages
    m.valid[a[0, 0, 0], :3] = True
    m.valid[a[1, 1, 1], :] = True
    m.valid[b[0, 1, 2], 1] = True
    # A pending bind (not yet flushed) is counted too: the count flushes first.
    m.bind("c", 2)
    rows = torch.tensor([5, 1, 2])
    assert m.held_tokens_of_rows(rows).tolist() == m.held_tokens(["a", "b", "c"]) == [3 + P, 1, 0]
    # Trimmed columns stop counting once shrunk (null entries at the flush).
    m.shrink("a", 1)
    assert m.held_tokens_of_rows(torch.tensor([5])).tolist() == [3]
    assert m.held_tokens_of_rows(torch.zeros(0, dtype=torch.int64)).tolist() == []


def test_shrink_frees_the_trailing_columns():
    m = manager()
    m.allocate("a", 4)
    m.bind("a", 1)
    m.flush()
    assert m.shrink("a", 1) == 3 * L * H
    assert m.pages_of("a") == L * H and m.columns_of("a") == 1
    m.flush()
    assert (m.table[1, :, :, 1:] == m.null_page).all()
    assert (m.table[1, :, :, 0] != m.null_page).all()


def test_pages_move_between_heads_by_rewriting_the_table():
    m = manager()
    m.allocate("a", 2)
    m.bind("a", 2)
    m.flush()
    before = m.pages_of("a")
    m.move_pages("a", layer=1, src_head=0, dst_head=1, count=1)
    m.flush()
    real = (m.table[2] != m.null_page).sum(dim=-1)
    assert real.tolist() == [[2, 2], [1, 3]]  # layer 1: head 0 gave one page to head 1
    assert m.pages_of("a") == before  # the request's total is unchanged
    with pytest.raises(ValueError):
        m.move_pages("a", layer=1, src_head=0, dst_head=1, count=2)


def dense_reference(q, pk, pv, prefix_len, rk, rv, mask, scale):
    """One row, one query at a time, plain softmax over the visible keys."""
    T, Hq, _ = q.shape
    G = Hq // rk.shape[0]
    out = torch.zeros(T, Hq, rv.shape[-1])
    for t in range(T):
        for h in range(Hq):
            kv = h // G
            keys = torch.cat([pk[:prefix_len, kv], rk[kv][mask[t, kv]]])
            values = torch.cat([pv[:prefix_len, kv], rv[kv][mask[t, kv]]])
            p = torch.softmax(keys @ q[t, h] * scale, dim=0)
            out[t, h] = p @ values
    return out


def test_batched_attention_equals_a_dense_softmax_per_row():
    gen = torch.Generator().manual_seed(0)
    R, T, Hq, Pmax, S = 3, 4, 4, 6, 8
    q = torch.randn(R, T, Hq, D, generator=gen)
    pk, pv = torch.randn(R, Pmax, H, D, generator=gen), torch.randn(R, Pmax, H, D, generator=gen)
    rk, rv = torch.randn(R, H, S, D, generator=gen), torch.randn(R, H, S, D, generator=gen)
    prefix_lens = torch.tensor([6, 0, 3])
    prefix_mask = torch.arange(Pmax).unsqueeze(0) < prefix_lens.unsqueeze(1)
    mask = torch.rand(R, T, H, S, generator=gen) > 0.4
    mask[..., 0] = True  # every query sees at least one slot
    out, obs = attend_rows(q, pk, pv, prefix_mask, rk, rv, mask, 0.3, Need.ATTENTION | Need.PV_NORM)
    for r in range(R):
        want = dense_reference(q[r], pk[r], pv[r], int(prefix_lens[r]), rk[r], rv[r], mask[r], 0.3)
        assert torch.allclose(out[r], want, atol=1e-5)
    # Region mass is a share of each query's softmax: at most 1 per query, and
    # exactly 1 for the row without a prefix.
    per_query_group = obs.attention.sum(-1) / (T * (Hq // H))
    assert torch.allclose(per_query_group[1], torch.ones(H))
    assert (per_query_group <= 1 + 1e-5).all()
    assert torch.allclose(obs.pv_norm, obs.attention * rv.abs().sum(-1))


def test_padding_queries_give_zeros_and_are_not_observed():
    R, T, Hq, S = 2, 3, 2, 4
    q = torch.randn(R, T, Hq, D)
    rk, rv = torch.randn(R, H, S, D), torch.randn(R, H, S, D)
    empty = torch.zeros(R, 0, H, D)
    mask = torch.ones(R, T, H, S, dtype=torch.bool)
    mask[1, 2] = False  # row 1's third query is padding
    observe = torch.ones(R, T, dtype=torch.bool)
    out, obs = attend_rows(q, empty, empty, torch.zeros(R, 0, dtype=torch.bool), rk, rv, mask, 1.0,
                           Need.ATTENTION | Need.SPARSITY, observe=observe)
    assert torch.isfinite(out).all() and (out[1, 2] == 0).all()
    assert torch.allclose(obs.attention.sum(-1), torch.tensor([[3.0, 3.0], [2.0, 2.0]]))  # per query: mass 1
    assert torch.isfinite(obs.sparsity).all()
