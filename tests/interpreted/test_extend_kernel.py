"""The Triton extend-attention kernel (kernels/extend_attention.py) against
the PyTorch reference (kernels.attention_ref.attend_rows, called with the mask
radix_ext/backend.py's reference path builds), on CPU through Triton's
interpreter. bench/kernel_check.py runs the same comparison at real shapes
(bf16) on a GPU.

Run by tests/test_triton_kernels.py in a process of its own with
TRITON_INTERPRET=1. Shapes are small: the interpreter runs every program in
Python."""

import os

import pytest
import torch

from kvsieve.kernels import attention_ref
from kvsieve.policies import Need

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}
MASS_TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float16: dict(atol=5e-3, rtol=2e-2)}


@pytest.fixture(scope="module")
def kernel():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_kernels.py"
    from kvsieve.kernels import extend_attention

    return extend_attention


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty returns NaN-filled floats: an output entry the kernel does not write shows."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        x = empty(*args, **kwargs)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", nan_empty)


def random_case(Hq, Hkv, D, page, M, prefix, earlier, chunk, dtype, seed, holes=0.25, window=None, shuffle=False):
    """One row per entry of `prefix`: `prefix[r]` shared tokens in the token
    pool, then `earlier[r]` private tokens of earlier chunks and the
    `chunk[r]` tokens of this chunk in the row's region slots, in slot order
    (positions shuffled among the row's slots with `shuffle`). Each (row,
    head) loses a `holes` share of its earlier private tokens (evicted);
    slots past the row's tokens hold stale keys, some marked valid with
    positions later than every query (a causal mask must hide them). The
    last `window[r]` queries are observed (all if None)."""
    g = torch.Generator().manual_seed(seed)
    R = len(prefix)
    T = max(chunk)
    S = M * page
    pool_slots = sum(prefix) + 8
    pool_k = torch.randn(pool_slots, Hkv, D, generator=g).to(dtype)
    pool_v = torch.randn(pool_slots, Hkv, D, generator=g).to(dtype)
    pages = R * Hkv * M
    region_k = torch.randn(pages + 1, page, D, generator=g).to(dtype)  # + the null page
    region_v = torch.randn(pages + 1, page, D, generator=g).to(dtype)
    valid = torch.zeros(pages + 1, page, dtype=torch.bool)
    position = torch.full((pages + 1, page), -1, dtype=torch.int64)
    table = torch.randperm(pages, generator=g).view(R, Hkv, M)
    prefix_slots = torch.zeros(R, max(prefix), dtype=torch.int64)
    query_pos = torch.full((R, T), -1, dtype=torch.int64)
    observe = torch.zeros(R, T, dtype=torch.bool)
    for r in range(R):
        P, E, n = prefix[r], earlier[r], chunk[r]
        assert E + n <= S
        prefix_slots[r, :P] = torch.randperm(pool_slots, generator=g)[:P]
        query_pos[r, :n] = torch.arange(P + E, P + E + n)
        w = n if window is None else min(window[r], n)
        observe[r, n - w:n] = True
        for h in range(Hkv):
            pos = torch.arange(P, P + E + n)
            if shuffle:
                pos = pos[torch.randperm(E + n, generator=g)]
            flat_valid = torch.zeros(S, dtype=torch.bool)
            flat_pos = torch.full((S,), -1, dtype=torch.int64)
            flat_valid[:E + n] = True
            flat_valid[:E] &= torch.rand(E, generator=g) >= holes
            flat_pos[:E + n] = pos
            stale = torch.rand(S, generator=g) < 0.3
            stale[:E + n] = False
            flat_valid |= stale
            flat_pos[stale] = P + E + n + torch.randint(0, 50, (int(stale.sum()),), generator=g)
            valid[table[r, h]] = flat_valid.view(M, page)
            position[table[r, h]] = flat_pos.view(M, page)
        if M > 1 and E + n <= S - page:  # a head with fewer pages: a null column
            table[r, -1, -1] = pages
    q = torch.randn(R, T, Hq, D, generator=g).to(dtype)
    return dict(q=q, query_pos=query_pos, pool_k=pool_k, pool_v=pool_v, prefix_slots=prefix_slots,
                prefix_len=torch.tensor(prefix), region_k=region_k, region_v=region_v, region_valid=valid,
                region_position=position, table=table), observe


def reference(case, scale, observe):
    """attend_rows with the mask radix_ext/backend.py's reference path builds (fp32)."""
    R, P = case["prefix_slots"].shape
    table, page = case["table"], case["region_k"].shape[1]
    Hkv, M = table.shape[1:]
    S = M * page
    prefix_mask = torch.arange(P).unsqueeze(0) < case["prefix_len"].unsqueeze(1)
    pk = case["pool_k"][case["prefix_slots"]].float()
    pv = case["pool_v"][case["prefix_slots"]].float()
    rk = case["region_k"][table].reshape(R, Hkv, S, -1).float()
    rv = case["region_v"][table].reshape(R, Hkv, S, -1).float()
    valid = case["region_valid"][table].reshape(R, Hkv, S)
    position = case["region_position"][table].reshape(R, Hkv, S)
    pos = case["query_pos"]
    mask = valid.unsqueeze(1) & (position.unsqueeze(1) <= pos.view(R, -1, 1, 1)) & (pos >= 0).view(R, -1, 1, 1)
    out, obs = attention_ref.attend_rows(case["q"].float(), pk, pv, prefix_mask, rk, rv, mask, scale,
                                         Need.ATTENTION, observe=observe)
    return out, obs.attention


def check(kernel, case, observe, dtype, **blocks):
    D = case["q"].shape[-1]
    scale = D ** -0.5
    out, attention = kernel.extend_attention(**case, scale=scale, observe=observe, **blocks)
    ref_out, ref_attention = reference(case, scale, observe)
    real = case["query_pos"] >= 0
    assert out.dtype == dtype and out.shape == ref_out.shape
    torch.testing.assert_close(out[real].float(), ref_out[real], **TOLERANCE[dtype])
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))  # padding queries: 0, not NaN
    torch.testing.assert_close(attention, ref_attention, **MASS_TOLERANCE[dtype])
    return out, attention


CASES = [
    # Hq, Hkv, D, page, M, prefix, earlier, chunk, window, shuffle, block_m, block_n
    (4, 2, 16, 8, 4, [5, 0, 19], [0, 6, 3], [9, 4, 13], [3, 4, 20], False, 16, 16),  # G=2, ragged, prefix 0 and >0
    (3, 3, 32, 32, 1, [0, 0], [10, 0], [20, 7], None, False, 16, 16),  # G=1, no prefix, all observed, page > block
    (7, 1, 16, 4, 6, [33, 2], [0, 4], [5, 11], [2, 5], True, 16, 16),  # G=7 padded to 8, positions not in slot order
    (8, 2, 16, 16, 3, [0, 40], [17, 0], [21, 1], [8, 1], False, 32, 16),  # a 1-token chunk: tiles of padding only
]


@pytest.mark.parametrize("Hq,Hkv,D,page,M,prefix,earlier,chunk,window,shuffle,block_m,block_n", CASES)
def test_kernel_matches_the_reference(kernel, poisoned, Hq, Hkv, D, page, M, prefix, earlier, chunk, window,
                                      shuffle, block_m, block_n):
    case, observe = random_case(Hq, Hkv, D, page, M, prefix, earlier, chunk, torch.float32,
                                seed=Hq * 100 + sum(chunk), window=window, shuffle=shuffle)
    check(kernel, case, observe, torch.float32, block_m=block_m, block_n=block_n)


def test_half_precision_inputs_stay_within_half_precision_error(kernel, poisoned):
    # fp16 here: the CPU interpreter mis-reads bf16 (NumPy has no bf16);
    # bench/kernel_check.py checks bf16 on the GPU.
    case, observe = random_case(4, 2, 32, 8, 3, [7, 0], [3, 5], [12, 6], torch.float16, seed=11, window=[5, 6])
    check(kernel, case, observe, torch.float16, block_m=16, block_n=16)


def test_observations_are_only_computed_when_asked(kernel, poisoned):
    case, observe = random_case(4, 2, 16, 8, 2, [3, 0], [2, 0], [6, 3], torch.float32, seed=5, window=[2, 3])
    out, attention = kernel.extend_attention(**case, scale=0.25, block_m=16, block_n=16)
    assert attention is None
    out_observed, attention = kernel.extend_attention(**case, scale=0.25, observe=observe, block_m=16, block_n=16)
    torch.testing.assert_close(out, out_observed)
    # Nothing observed: zero mass everywhere (every slot written).
    _, none = kernel.extend_attention(**case, scale=0.25, observe=torch.zeros_like(observe), block_m=16, block_n=16)
    assert torch.equal(none, torch.zeros_like(none))


def test_a_query_that_sees_nothing_gets_zeros(kernel, poisoned):
    # No prefix and every region slot invalid: the reference's softmax over
    # nothing is 0, and so is the kernel's output.
    case, observe = random_case(4, 2, 16, 8, 2, [0, 4], [0, 0], [3, 5], torch.float32, seed=3)
    case["region_valid"][case["table"][0].flatten()] = False
    out, attention = check(kernel, case, observe, torch.float32, block_m=16, block_n=16)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isfinite(out).all() and torch.isfinite(attention).all()
