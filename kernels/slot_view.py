"""The slot view of a policy group, one layer: every slot's bookkeeping of
the group's page-table rows, gathered in one kernel.

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


def gather_view_reference(table, valid, position, score, last_hit) -> tuple:
    """The same in PyTorch: one indexed gather per buffer."""
    R, H, M = table.shape

    def flat(buffer):
        return None if buffer is None else buffer[table].reshape(R, H, M * buffer.shape[1])

    return flat(valid), flat(position), flat(score), flat(last_hit)
