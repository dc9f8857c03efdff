"""The compressed region: in-place reuse, per-head pages, exact accounting,
and reference attention over prefix + region equal to one dense softmax."""

import random

import pytest
import torch

from kvsieve.kernels.attention_ref import attend, attend_decode
from kvsieve.policies import Need
from kvsieve.radix_ext.region import CompressedRegion, RegionConfig, RegionFull

L, H, D, P = 2, 2, 8, 4


def region(pages=64):
    return CompressedRegion(RegionConfig(num_layers=L, num_kv_heads=H, head_dim=D, num_pages=pages, page_size=P))


def kv(pos):
    return torch.full((H, D), float(pos)), torch.full((H, D), -float(pos))


def test_store_reuses_an_evicted_slot_in_place():
    r = region()
    r.begin("a")
    for pos in range(6):
        r.store("a", 0, *kv(pos), position=pos)
    assert r.pages_used == 2 * H  # 6 tokens in pages of 4, per head of layer 0
    mask = torch.zeros(H, 2 * P, dtype=torch.bool)
    mask[0, 1] = True  # head 0 drops position 1; head 1 keeps everything
    assert r.evict("a", 0, mask) == 1
    slots = r.store("a", 0, *kv(6), position=6)
    assert slots.tolist() == [1, 6]  # head 0 refills its hole; head 1 appends
    k, v, view = r.layer_slots("a", 0)
    assert view.position[0].tolist() == [0, 6, 2, 3, 4, 5, -1, -1]
    assert torch.equal(k[0, 1], torch.full((D,), 6.0))
    assert r.held_tokens("a").tolist() == [[6, 7], [0, 0]]


def test_emptied_pages_return_to_the_pool_and_holes_are_refilled():
    r = region()
    r.begin("a")
    for pos in range(8):
        r.store("a", 1, *kv(pos), position=pos)
    used = r.pages_used
    mask = torch.zeros(H, 2 * P, dtype=torch.bool)
    mask[1, :P] = True  # head 1 empties its first page
    r.evict("a", 1, mask)
    assert r.pages_used == used - 1
    r.store("a", 1, *kv(8), position=8)
    _, _, view = r.layer_slots("a", 1)
    assert view.valid.shape == (H, 3 * P)  # head 0 grew a third page, head 1 refilled its hole
    assert view.position[1].tolist()[:P] == [8, -1, -1, -1]


def test_exhaustion_raises_and_end_returns_every_page():
    r = region(pages=3)
    r.begin("a")
    r.store("a", 0, *kv(0), position=0)  # one page per head: 2
    r.begin("b")
    with pytest.raises(RegionFull):
        r.store("b", 0, *kv(0), position=0)  # needs 2 more, 1 left
    assert r.end("a") == 2
    r.end("b")
    assert r.pages_free == 3 and r.pages_used == 0


def test_random_operations_keep_exact_accounting():
    rng = random.Random(0)
    r = region(pages=200)
    live = {}
    for step in range(600):
        op = rng.random()
        if op < 0.1 and len(live) < 6:
            rid = f"r{step}"
            r.begin(rid)
            live[rid] = 0
        elif op < 0.15 and live:
            rid = rng.choice(list(live))
            r.end(rid)
            del live[rid]
        elif live:
            rid = rng.choice(list(live))
            layer = rng.randrange(L)
            try:
                r.store(rid, layer, *kv(live[rid]), position=live[rid])
            except RegionFull:
                continue
            live[rid] += 1
            _, _, view = r.layer_slots(rid, layer)
            r.evict(rid, layer, view.valid & (torch.rand(view.valid.shape) < 0.3))
        held = sum(int(r.held_tokens(rid).sum()) for rid in live)
        assert r.pages_used + r.pages_free == 200
        assert held <= r.pages_used * P
    for rid in list(live):
        r.end(rid)
    assert r.pages_free == 200 and not r.valid.any()


def dense_attention(q, keys, values, scale):
    """One softmax over all given keys; GQA by repeating kv heads."""
    Hq = q.shape[0]
    G = Hq // keys.shape[0]
    k = keys.repeat_interleave(G, dim=0)
    v = values.repeat_interleave(G, dim=0)
    p = torch.softmax(torch.einsum("hd,hnd->hn", q, k) * scale, dim=-1)
    return torch.einsum("hn,hnd->hd", p, v), p


@pytest.mark.parametrize("prefix_len", [0, 5])
def test_split_attention_equals_one_softmax_and_observations(prefix_len):
    gen = torch.Generator().manual_seed(prefix_len)
    Hq, Hkv, S = 4, 2, 12
    q = torch.randn(Hq, D, generator=gen)
    pk, pv = torch.randn(prefix_len, Hkv, D, generator=gen), torch.randn(prefix_len, Hkv, D, generator=gen)
    rk, rv = torch.randn(Hkv, S, D, generator=gen), torch.randn(Hkv, S, D, generator=gen)
    valid = torch.rand(Hkv, S, generator=gen) < 0.6
    valid[:, 0] = True
    out, obs = attend_decode(q, pk, pv, rk, rv, valid, scale=D ** -0.5,
                             needs=Need.ATTENTION | Need.PV_NORM | Need.SPARSITY)
    for h in range(Hkv):
        keys = torch.cat([pk[:, h], rk[h][valid[h]]])
        vals = torch.cat([pv[:, h], rv[h][valid[h]]])
        ref, p = dense_attention(q[2 * h: 2 * h + 2], keys.unsqueeze(0), vals.unsqueeze(0), D ** -0.5)
        assert torch.allclose(out[2 * h: 2 * h + 2], ref, atol=1e-5)
        p_region = p[:, prefix_len:]
        assert torch.allclose(obs.attention[h][valid[h]], p_region.sum(0), atol=1e-6)
        assert torch.allclose(obs.attention[h][~valid[h]], torch.zeros(()))
        pv_ref = (p_region.unsqueeze(-1) * rv[h][valid[h]]).abs().sum(-1).sum(0)
        assert torch.allclose(obs.pv_norm[h][valid[h]], pv_ref, atol=1e-6)
        sparse_ref = (p < 0.01 * p.amax(-1, keepdim=True)).float().mean(-1)
        assert torch.allclose(obs.sparsity[2 * h: 2 * h + 2], sparse_ref, atol=1e-6)


@pytest.mark.parametrize("prefix_len", [0, 7])
def test_extend_attention_is_causal_over_the_region_and_observes_chosen_queries(prefix_len):
    """A prompt chunk's queries over prefix + region: query t sees the prefix
    and the region slots at positions <= its own, as one dense causal softmax."""
    gen = torch.Generator().manual_seed(prefix_len + 1)
    Hq, Hkv, T = 4, 2, 6
    # Region slots in scrambled order (in-place reuse), positions prefix_len .. prefix_len+T-1.
    S = T + 2
    rk, rv = torch.randn(Hkv, S, D, generator=gen), torch.randn(Hkv, S, D, generator=gen)
    position = torch.full((Hkv, S), -1)
    for h in range(Hkv):
        slots = torch.randperm(S, generator=gen)[:T]
        position[h, slots] = torch.arange(prefix_len, prefix_len + T)
    valid = position >= 0
    q = torch.randn(T, Hq, D, generator=gen)
    pk, pv = torch.randn(prefix_len, Hkv, D, generator=gen), torch.randn(prefix_len, Hkv, D, generator=gen)
    query_pos = torch.arange(prefix_len, prefix_len + T)
    mask = valid.unsqueeze(0) & (position.unsqueeze(0) <= query_pos.view(T, 1, 1))
    observe = torch.zeros(T, dtype=torch.bool)
    observe[-2:] = True
    out, obs = attend(q, pk, pv, rk, rv, mask, D ** -0.5, Need.ATTENTION | Need.SPARSITY, observe=observe)
    attention = torch.zeros(Hkv, S)
    sparsity = torch.zeros(Hq)
    for t in range(T):
        for h in range(Hkv):
            seen = mask[t, h]
            keys = torch.cat([pk[:, h], rk[h][seen]])
            vals = torch.cat([pv[:, h], rv[h][seen]])
            ref, p = dense_attention(q[t, 2 * h: 2 * h + 2], keys.unsqueeze(0), vals.unsqueeze(0), D ** -0.5)
            assert torch.allclose(out[t, 2 * h: 2 * h + 2], ref, atol=1e-5)
            if observe[t]:
                attention[h][seen] += p[:, prefix_len:].sum(0)
                sparsity[2 * h: 2 * h + 2] += (p < 0.01 * p.amax(-1, keepdim=True)).float().mean(-1) / 2
    assert torch.allclose(obs.attention, attention, atol=1e-6)
    assert torch.allclose(obs.sparsity, sparsity, atol=1e-6)
