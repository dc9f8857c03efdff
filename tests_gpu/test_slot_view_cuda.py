"""A group's slot view in one kernel (kernels/slot_view.py) compiled for the
GPU, against one PyTorch gather per buffer on the same device, bit for bit:
the interpreted cases' shapes and a 600-row step at budget 1024 (65 columns
of 16), a layer's slice of [R, layers, H, M] tables, with and without slot
state; and inside a CUDA graph, replayed after the region changed. The
decision's write-back in one kernel against one indexed write per buffer
the same way (evictions and/or slot state; 600 rows; a captured write
replayed with new decisions)."""

import pytest
import torch

from kvsieve.kernels import slot_view


def region(pages: int, page: int, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return {"valid": torch.rand(pages, page, generator=gen, device="cuda") < 0.7,
            "position": torch.randint(-1, 1 << 40, (pages, page), generator=gen, device="cuda"),
            "score": torch.rand(pages, page, generator=gen, device="cuda"),
            "last_hit": torch.randint(0, 9, (pages, page), dtype=torch.int32, generator=gen, device="cuda")}


def tables(R, L, H, M, pages, seed):
    gen = torch.Generator(device="cuda").manual_seed(100 + seed)
    t = torch.randint(0, pages - 1, (R, L, H, M), generator=gen, device="cuda")
    t[0, :, :, M // 2:] = pages - 1  # past a row's own columns: the null page
    return t


def assert_same(got, want):
    for name, a, b in zip(("valid", "position", "score", "last_hit"), got, want):
        if b is None:
            assert a is None, name
        else:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


@pytest.mark.parametrize("R, L, H, M, page, state", [
    (3, 4, 2, 5, 16, True), (5, 2, 4, 7, 16, False), (2, 3, 3, 9, 8, True),
    (600, 2, 4, 65, 16, True), (600, 2, 4, 65, 16, False),
])
def test_the_compiled_kernel_gathers_what_pytorch_gathers(R, L, H, M, page, state):
    pages = max(64, R * H * M)
    buffers = region(pages, page, R)
    table = tables(R, L, H, M, pages, R)[:, 1]
    score, last_hit = (buffers["score"], buffers["last_hit"]) if state else (None, None)
    assert_same(slot_view.gather_view(table, buffers["valid"], buffers["position"], score, last_hit),
                slot_view.gather_view_reference(table, buffers["valid"], buffers["position"], score, last_hit))


def test_a_captured_view_replays_the_regions_current_slots():
    buffers = region(2000, 16, 7)
    table = tables(40, 2, 4, 12, 2000, 7)[:, 0]
    args = (table, buffers["valid"], buffers["position"], buffers["score"], buffers["last_hit"])
    slot_view.gather_view(*args)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = slot_view.gather_view(*args)
    for b in buffers.values():  # the region moves on between steps
        b.copy_(torch.roll(b, 1, 0))
    graph.replay()
    torch.cuda.synchronize()
    assert_same(out, slot_view.gather_view_reference(*args))


def engine_region(pages: int, page: int, seed: int) -> dict:
    buffers = region(pages, page, seed)
    buffers["valid"][-1] = False  # the null page: never valid
    buffers["position"][-1] = -1
    return buffers


def distinct_table(R, H, M, pages, seed):
    gen = torch.Generator(device="cuda").manual_seed(200 + seed)
    t = torch.randperm(pages - 1, generator=gen, device="cuda")[:R * 2 * H * M].view(R, 2, H, M).clone()
    t[0, :, :, M // 2:] = pages - 1
    return t[:, 1]  # a layer's slice


def decision(table, buffers, seed):
    view_valid, view_position, _, _ = slot_view.gather_view_reference(table, buffers["valid"], buffers["position"],
                                                                      None, None)
    gen = torch.Generator(device="cuda").manual_seed(300 + seed)
    kept = view_valid & ~(torch.rand(view_valid.shape, generator=gen, device="cuda") < 0.3)
    score = torch.rand(view_valid.shape, generator=gen, device="cuda")
    last_hit = torch.randint(0, 99, view_valid.shape, dtype=torch.int32, generator=gen, device="cuda")
    return kept, view_position, score, last_hit


def assert_same_region(mine, theirs, pages):
    for name in ("valid", "position", "score", "last_hit"):
        rows = slice(None) if name in ("valid", "position") else slice(0, pages - 1)  # the null page's state: any
        assert torch.equal(mine[name][rows], theirs[name][rows]), name


@pytest.mark.parametrize("R, H, M, page, kept, state", [
    (3, 2, 5, 16, True, True), (5, 4, 7, 16, True, False), (2, 3, 9, 8, False, True),
    (600, 4, 65, 16, True, True), (600, 4, 65, 16, True, False),
])
def test_the_compiled_kernel_writes_back_what_pytorch_writes(R, H, M, page, kept, state):
    pages = R * 2 * H * M + 1
    table = distinct_table(R, H, M, pages, R)
    mine, theirs = engine_region(pages, page, R), engine_region(pages, page, R)
    new_kept, position, score, last_hit = decision(table, mine, R)
    for write, b in ((slot_view.write_back, mine), (slot_view.write_back_reference, theirs)):
        write(table, b["valid"], b["position"], b["score"] if state else None, b["last_hit"] if state else None,
              new_kept if kept else None, position, score, last_hit)
    torch.cuda.synchronize()
    assert_same_region(mine, theirs, pages)


def test_a_captured_write_back_replays_the_steps_decision():
    pages = 40 * 2 * 4 * 12 + 1
    table = distinct_table(40, 4, 12, pages, 9)
    mine, theirs = engine_region(pages, 16, 9), engine_region(pages, 16, 9)
    inputs = [t.clone() for t in decision(table, mine, 9)]
    args = lambda b: (table, b["valid"], b["position"], b["score"], b["last_hit"], *inputs)  # noqa: E731
    slot_view.write_back(*args(engine_region(pages, 16, 9)))  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        slot_view.write_back(*args(mine))
    for t, new in zip(inputs, decision(table, mine, 10)):  # the next step's decision, in the captured inputs
        t.copy_(new)
    graph.replay()
    slot_view.write_back_reference(*args(theirs))
    torch.cuda.synchronize()
    assert_same_region(mine, theirs, pages)
