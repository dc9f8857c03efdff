"""The slot view of a policy group, one layer: every slot's bookkeeping of
the group's page-table rows, gathered in one kernel, and what the group's
decision changed written back in one kernel.

A group pass (radix_ext/backend.py, `_view`) reads, per layer, `valid` and
`position` of every slot of its rows' pages, and `score` and `last_hit`
where the policy keeps slot state. In PyTorch that is one indexed gather
per buffer (`buffer[table]`), and each costs what its number of pages
costs, not its bytes: at 600 rows x 4 kv heads x 65 columns on an H200,
0.10 ms a buffer whether it moves 2.5 MB (valid) or 20 MB (position), 0.40
ms a layer and 11.2 ms a step for the four (bench/view_gather.py,
bench/results/logs/h200-2026-12-03c/call2-view-gather.json). Here one
program per block of slots reads each slot's page from the table once and
copies the requested buffers' slot, so a layer's view is one launch.

Same values as `gather_view_reference` (tests/interpreted/test_slot_view.py):
a copy, bit for bit, null pages and pages past a row's columns included.

The write-back after the decision (`write_back`; `write_back_reference` is
the PyTorch form, one indexed write per buffer) has the same shape and the
same cost in PyTorch: `valid` and `position` where the group decided,
`score` and `last_hit` where its policy keeps slot state, each an index_put
of ~0.1 ms whatever its bytes (rkv at 600 rows on an H200: 1.9 ms a step).
A page the table names twice gets one of its entries' values, as with
index_put; the only such page in the engine's tables is the null page,
whose slots are never valid (every entry writes it invalid, at -1).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kvsieve.env_flags import flag

from . import interpreter_compat

interpreter_compat.apply()

#: KVSIEVE_FUSED_VIEW=0 keeps the PyTorch gathers on the GPU too (A/B timings,
#: a fallback). Read at each call.
ENV = "KVSIEVE_FUSED_VIEW"
#: Slots a program copies.
BLOCK_SLOTS = 1024


def enabled() -> bool:
    return flag(ENV)


@triton.jit(do_not_specialize=["total", "H", "M", "st_r", "st_h"])
def _view_kernel(Table, Valid, Position, Score, LastHit, OutValid, OutPosition, OutScore, OutLastHit,
                 total, H, M, st_r, st_h, PAGE: tl.constexpr, BLOCK: tl.constexpr, STATE: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # flat [R, H, M, PAGE] index
    ok = i < total
    entry = i // PAGE
    slot = i % PAGE
    m = entry % M
    h = (entry // M) % H
    r = entry // (M * H)
    page = tl.load(Table + r * st_r + h * st_h + m, mask=ok, other=0).to(tl.int64)
    src = page * PAGE + slot
    tl.store(OutValid + i, tl.load(Valid + src, mask=ok), mask=ok)
    tl.store(OutPosition + i, tl.load(Position + src, mask=ok), mask=ok)
    if STATE:
        tl.store(OutScore + i, tl.load(Score + src, mask=ok), mask=ok)
        tl.store(OutLastHit + i, tl.load(LastHit + src, mask=ok), mask=ok)


def gather_view(table: torch.Tensor, valid: torch.Tensor, position: torch.Tensor, score: Optional[torch.Tensor],
                last_hit: Optional[torch.Tensor]) -> tuple:
    """(valid, position, score, last_hit) of the slots of `table` [R, H, M]
    (page ids into buffers of [pages, PAGE]), each [R, H, M * PAGE]; score
    and last_hit None when not given."""
    if table.stride(2) != 1:  # a layer's slice of the step's [R, layers, H, M] tables has its columns in a row
        table = table.contiguous()
    R, H, M = table.shape
    page = valid.shape[1]
    shape = (R, H, M * page)
    state = score is not None
    out_valid = torch.empty(shape, dtype=torch.uint8, device=valid.device)
    out_position = torch.empty(shape, dtype=position.dtype, device=valid.device)
    out_score = torch.empty(shape, dtype=score.dtype, device=valid.device) if state else out_position
    out_last_hit = torch.empty(shape, dtype=last_hit.dtype, device=valid.device) if state else out_position
    total = R * H * M * page
    if total:
        grid = (triton.cdiv(total, BLOCK_SLOTS),)
        _view_kernel[grid](table, valid.view(torch.uint8), position, score if state else position,
                           last_hit if state else position, out_valid, out_position, out_score, out_last_hit,
                           total, H, M, table.stride(0), table.stride(1), PAGE=page, BLOCK=BLOCK_SLOTS,
                           STATE=state)
    return (out_valid.view(torch.bool), out_position, out_score if state else None,
            out_last_hit if state else None)


@triton.jit(do_not_specialize=["total", "H", "M", "st_r", "st_h"])
def _write_back_kernel(Table, Kept, ViewPosition, ViewScore, ViewLastHit, Valid, Position, Score, LastHit,
                       total, H, M, st_r, st_h, PAGE: tl.constexpr, BLOCK: tl.constexpr, KEPT: tl.constexpr,
                       STATE: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # flat [R, H, M, PAGE] index
    ok = i < total
    entry = i // PAGE
    slot = i % PAGE
    m = entry % M
    h = (entry // M) % H
    r = entry // (M * H)
    page = tl.load(Table + r * st_r + h * st_h + m, mask=ok, other=0).to(tl.int64)
    dst = page * PAGE + slot
    if KEPT:
        kept = tl.load(Kept + i, mask=ok, other=0)
        tl.store(Valid + dst, kept, mask=ok)
        position = tl.load(ViewPosition + i, mask=ok, other=-1)
        tl.store(Position + dst, tl.where(kept != 0, position, -1), mask=ok)
    if STATE:
        tl.store(Score + dst, tl.load(ViewScore + i, mask=ok), mask=ok)
        tl.store(LastHit + dst, tl.load(ViewLastHit + i, mask=ok), mask=ok)


def write_back(table: torch.Tensor, valid: torch.Tensor, position: torch.Tensor, score: Optional[torch.Tensor],
               last_hit: Optional[torch.Tensor], kept: Optional[torch.Tensor], view_position: torch.Tensor,
               view_score: Optional[torch.Tensor], view_last_hit: Optional[torch.Tensor]) -> None:
    """A group's decision written into the region's buffers ([pages, PAGE])
    at the slots of `table` [R, H, M], from [R, H, M * PAGE] views: with
    `kept`, valid = kept and position = view_position where kept, else -1;
    with `score` (slot state), score and last_hit from the view's."""
    state = score is not None
    if kept is None and not state:
        return
    if table.stride(2) != 1:
        table = table.contiguous()
    R, H, M = table.shape
    page = valid.shape[1]
    total = R * H * M * page
    if not total:
        return
    kept_bytes = kept.contiguous().view(torch.uint8) if kept is not None else valid.view(torch.uint8)
    view_position = view_position.to(position.dtype).contiguous()
    view_score = view_score.to(score.dtype).contiguous() if state else view_position
    view_last_hit = view_last_hit.to(last_hit.dtype).contiguous() if state else view_position
    _write_back_kernel[(triton.cdiv(total, BLOCK_SLOTS),)](
        table, kept_bytes, view_position, view_score, view_last_hit, valid.view(torch.uint8), position,
        score if state else position, last_hit if state else position,
        total, H, M, table.stride(0), table.stride(1), PAGE=page, BLOCK=BLOCK_SLOTS, KEPT=kept is not None,
        STATE=state)


def write_back_reference(table, valid, position, score, last_hit, kept, view_position, view_score,
                         view_last_hit) -> None:
    """The same in PyTorch: one indexed write per buffer."""
    shape = (*table.shape, valid.shape[1])
    if score is not None:
        score[table] = view_score.reshape(shape).to(score.dtype)
        last_hit[table] = view_last_hit.reshape(shape).to(last_hit.dtype)
    if kept is not None:
        valid[table] = kept.reshape(shape)
        position[table] = torch.where(kept, view_position, -1).reshape(shape).to(position.dtype)


def gather_view_reference(table, valid, position, score, last_hit) -> tuple:
    """The same in PyTorch: one indexed gather per buffer."""
    R, H, M = table.shape

    def flat(buffer):
        return None if buffer is None else buffer[table].reshape(R, H, M * buffer.shape[1])

    return flat(valid), flat(position), flat(score), flat(last_hit)
