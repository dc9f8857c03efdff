"""A policy group's slot view gathered in one kernel (kernels/slot_view.py)
against one PyTorch gather per buffer, bit for bit, on CPU through Triton's
interpreter: a layer's slice of the step's [R, layers, H, M] tables (rows and
heads strided), null pages and repeated pages, views with and without slot
state, a page size of 8, and a table whose slots do not fill the last block.
The decision's write-back in one kernel against one indexed write per
buffer: evictions, slot state, both, neither, on the same shapes.

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


def engine_region(pages: int, page: int, seed: int) -> dict:
    """region() with the engine's null page (the last): no valid slot, at -1."""
    buffers = region(pages, page, seed)
    buffers["valid"][-1] = False
    buffers["position"][-1] = -1
    return buffers


def distinct_tables(R, L, H, M, pages, seed):
    """Page ids as the engine's: each page in one entry, the null page for
    columns past a row's own (here the first row's second half)."""
    gen = torch.Generator().manual_seed(200 + seed)
    tables = torch.randperm(pages - 1, generator=gen)[:R * L * H * M].view(R, L, H, M).clone()
    tables[0, :, :, M // 2:] = pages - 1
    return tables


@pytest.mark.parametrize("R, L, H, M, page, kept, state, seed", [
    (3, 4, 2, 5, 16, True, True, 0),    # rkv, h2o, skipkv: evictions and slot state
    (5, 2, 4, 7, 16, True, False, 1),   # streaming, longflow, snapkv: evictions only
    (2, 3, 3, 9, 8, False, True, 2),    # an observing group: slot state only; pages of 8
    (1, 1, 1, 1, 16, False, False, 3),  # nothing to write
])
def test_the_kernel_writes_back_what_pytorch_writes(slot_view, R, L, H, M, page, kept, state, seed):
    pages = R * L * H * M + 1
    table = distinct_tables(R, L, H, M, pages, seed)[:, L // 2]
    mine, theirs = engine_region(pages, page, seed), engine_region(pages, page, seed)
    view_valid, view_position, _, _ = slot_view.gather_view_reference(table, mine["valid"], mine["position"],
                                                                      None, None)
    gen = torch.Generator().manual_seed(300 + seed)
    chosen = torch.rand(view_valid.shape, generator=gen) < 0.3
    new_kept = view_valid & ~chosen if kept else None
    new_score = torch.rand(view_valid.shape, generator=gen)
    new_last_hit = torch.randint(0, 99, view_valid.shape, dtype=torch.int32, generator=gen)
    for write, b in ((slot_view.write_back, mine), (slot_view.write_back_reference, theirs)):
        write(table, b["valid"], b["position"], b["score"] if state else None, b["last_hit"] if state else None,
              new_kept, view_position, new_score, new_last_hit)
    before = engine_region(pages, page, seed)
    for name in ("valid", "position", "score", "last_hit"):
        # The null page is named by many entries: its state gets one of theirs.
        rows = slice(None) if name in ("valid", "position") else slice(0, pages - 1)
        assert torch.equal(mine[name][rows], theirs[name][rows]), name
        changed = not torch.equal(mine[name][rows], before[name][rows])
        assert changed == (kept if name in ("valid", "position") else state), name
    assert not mine["valid"][-1].any() and (mine["position"][-1] == -1).all()
