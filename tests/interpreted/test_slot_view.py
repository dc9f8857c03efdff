"""A policy group's slot view gathered in one kernel (kernels/slot_view.py)
against one PyTorch gather per buffer, bit for bit, on CPU through Triton's
interpreter: a layer's slice of the step's [R, layers, H, M] tables (rows and
heads strided), null pages and repeated pages, views with and without slot
state, a page size of 8, and a table whose slots do not fill the last block.

Run by tests/test_triton_kernels.py in a process of its own with
TRITON_INTERPRET=1."""

import os

import pytest
import torch


@pytest.fixture(scope="module")
def slot_view():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_triton_kernels.py"
    from kvsieve.kernels import slot_view

    return slot_view


def region(pages: int, page: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return {"valid": torch.rand(pages, page, generator=gen) < 0.7,
            "position": torch.randint(-1, 1 << 40, (pages, page), generator=gen),
            "score": torch.rand(pages, page, generator=gen),
            "last_hit": torch.randint(0, 9, (pages, page), dtype=torch.int32, generator=gen)}


@pytest.mark.parametrize("R, L, H, M, page, state, seed", [
    (3, 4, 2, 5, 16, True, 0),
    (5, 2, 4, 7, 16, False, 1),   # no slot state (streaming, snapkv, longflow)
    (2, 3, 3, 9, 8, True, 2),     # pages of 8; 2*3*9*8 slots: not a whole block
    (1, 1, 1, 1, 16, True, 3),
])
def test_the_kernel_gathers_what_pytorch_gathers(slot_view, R, L, H, M, page, state, seed):
    pages = 40
    buffers = region(pages, page, seed)
    null_page = pages - 1
    gen = torch.Generator().manual_seed(100 + seed)
    tables = torch.randint(0, pages - 1, (R, L, H, M), generator=gen)
    tables[0, :, :, M // 2:] = null_page  # a row's columns past its own: the null page
    tables[-1, :, 0, 0] = tables[0, :, 0, 0]  # one page read by two entries
    table = tables[:, L // 2]  # a layer's slice, as the backend passes it
    score, last_hit = (buffers["score"], buffers["last_hit"]) if state else (None, None)
    got = slot_view.gather_view(table, buffers["valid"], buffers["position"], score, last_hit)
    want = slot_view.gather_view_reference(table, buffers["valid"], buffers["position"], score, last_hit)
    for name, a, b in zip(("valid", "position", "score", "last_hit"), got, want):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape == (R, H, M * page), name
        assert torch.equal(a, b), name


def test_an_empty_group_gathers_nothing(slot_view):
    buffers = region(4, 16, 0)
    got = slot_view.gather_view(torch.zeros((0, 2, 3), dtype=torch.int64), buffers["valid"], buffers["position"],
                                buffers["score"], buffers["last_hit"])
    assert [tuple(t.shape) for t in got] == [(0, 2, 48)] * 4
