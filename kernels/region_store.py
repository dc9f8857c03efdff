"""The new token of every compressed row into the region: one kernel a layer.

A decode step's first act per layer (radix_ext/backend.py, `decode_attend`)
puts each (row, kv head)'s new key and value in the first free slot of the
row's pages and sets that slot's bookkeeping: valid, position, |v|_1 (the
vnorm LongFlow and R-KV read), score and last hit reset. In PyTorch that is
an argmax over the row's valid bits, a gather of the page, and seven indexed
writes: about fifteen small kernels a layer, 420 a step of a 28-layer model,
2.3 ms of a 16 ms mixed step at 128 rows on an H200 (launch-bound: each is a
few microseconds even replayed from a graph; the bytes are ~4 MB).

Here one program per (row, kv head): a scan of the head's slots (up to the
row's own columns, not the step's width, which a mixed batch's widest row
sets) for the lowest free one (a slot of a full-precision page whose valid bit is
clear; the page table's null page and quantized pages, ids >= null_page,
never offer one), then the writes. What the PyTorch form does, this does,
edge cases included (the reference is `store_new_tokens_reference`,
tests/interpreted/test_region_store.py compares them, bit for bit but for
|v|_1, an fp32 sum in another order):
- a head with no free slot writes slot 0 of its first column (the argmax of
  all-false), and a row with such a head is flagged in
  `overflow_flags[pool_row]` (the runtime ends it);
- padded rows (only the null page in their tables) write the null page's
  slot 0 and leave it invalid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvsieve.env_flags import flag

from . import interpreter_compat

interpreter_compat.apply()

#: KVSIEVE_FUSED_STORE=0 keeps the PyTorch store on the GPU too (A/B timings,
#: a fallback). Read at each call.
ENV = "KVSIEVE_FUSED_STORE"
#: Slots scanned at once for the first free one: a 7B model's row at budget
#: 1024 (~70 columns of 16) in two passes, at 256 in one.
BLOCK_SLOTS = 1024


def enabled() -> bool:
    return flag(ENV)


@triton.jit(do_not_specialize=["M", "st_r", "st_h", "sk_b", "sk_h", "sv_b", "sv_h"],  # the shapes' integers
            # per-row views into the step's shipped bytes (decode_attention._partial_kernel)
            do_not_specialize_on_alignment=["BatchIndex", "Positions", "PoolRows", "RowColumns"])
def _store_kernel(Table, BatchIndex, Positions, PoolRows, RowColumns, K, V, RegK, RegV, Valid, VNorm, Position, Score,
                  LastHit, Overflow, M, null_page, st_r, st_h, sk_b, sk_h, sv_b, sv_h,
                  PAGE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_S: tl.constexpr, OWN_COLUMNS: tl.constexpr):
    # One program per (row, kv head): the kernel lasts as long as its slowest
    # program, and a row's heads scanned in series made a mixed batch's widest
    # rows (crystal_kv's) set every step's store time.
    r = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(BatchIndex + r).to(tl.int64)
    position = tl.load(Positions + r)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    # The new token's K and V do not depend on the scan: their loads overlap it.
    k = tl.load(K + b * sk_b + h * sk_h + d, mask=d_ok, other=0.0)
    v = tl.load(V + b * sv_b + h * sv_h + d, mask=d_ok, other=0.0)
    columns = M
    if OWN_COLUMNS:
        # A row scans its own columns only: past them its table holds null
        # pages (no free slot), and in a mixed batch the widest row's width
        # would make every row scan that far.
        columns = tl.minimum(M, tl.load(RowColumns + r))
    slots = columns * PAGE
    row_table = Table + r.to(tl.int64) * st_r + h * st_h
    first = slots  # the lowest free slot so far; `slots`: none
    for start in range(0, slots, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        in_row = s < slots
        block_pages = tl.load(row_table + s // PAGE, mask=in_row, other=null_page).to(tl.int64)
        real = in_row & (block_pages < null_page)
        taken = tl.load(Valid + block_pages * PAGE + s % PAGE, mask=real, other=1)
        free = real & (taken == 0)
        first = tl.minimum(first, tl.min(tl.where(free, s, slots), axis=0))
    found = first < slots
    slot = tl.where(found, first, 0)
    page = tl.load(row_table + slot // PAGE).to(tl.int64)
    at = page * PAGE + slot % PAGE
    tl.store(RegK + at * D + d, k.to(RegK.dtype.element_ty), mask=d_ok)
    tl.store(RegV + at * D + d, v.to(RegV.dtype.element_ty), mask=d_ok)
    tl.store(VNorm + at, tl.sum(tl.abs(v.to(tl.float32)), axis=0))
    tl.store(Valid + at, (page != null_page).to(tl.uint8))
    tl.store(Position + at, position)
    tl.store(Score + at, 0.0)
    tl.store(LastHit + at, 0)
    # A head without room flags its row (each such head stores the same 1).
    tl.store(Overflow + tl.load(PoolRows + r), 1, mask=~found)


def _bytes(flags: torch.Tensor) -> torch.Tensor:
    return flags.view(torch.uint8) if flags.dtype == torch.bool else flags


def store_new_tokens(table, batch_index, positions, pool_rows, k, v, region_k, region_v, valid, vnorm, position,
                     score, last_hit, overflow_flags, null_page: int, zero=None, zero_int=None,
                     row_columns=None) -> None:
    """Write each row's new token (k, v [B, H, D] of the step's batch, row r
    at batch_index[r]) into the first free slot of its layer's pages
    `table` [R, H, M], in place, as the PyTorch form of backend.decode_attend.
    region_k/v [pages, PAGE, D]; valid, vnorm, position, score, last_hit
    [ids, PAGE]; overflow_flags [max_rows] bool, set for rows with a head
    that found no free slot. zero, zero_int: accepted for the reference's
    signature; the kernel writes its own zeros. row_columns [R] int or None:
    the page-table columns each row holds; a row's slots past them are not
    offered (None: every row's M columns)."""
    R, H, M = table.shape
    if R == 0:
        return
    D, page = region_k.shape[2], region_k.shape[1]
    assert k.stride(2) == 1 and v.stride(2) == 1 and table.stride(2) == 1, "the last dims must be contiguous"
    for t in (region_k, region_v, valid, vnorm, position, score, last_hit):
        assert t.is_contiguous(), "the region's per-slot arrays are contiguous"
    own_columns = row_columns is not None
    _store_kernel[(R, H)](
        table, batch_index, positions, pool_rows, row_columns if own_columns else pool_rows, k, v, region_k, region_v,
        _bytes(valid), vnorm, position, score, last_hit, _bytes(overflow_flags), M, null_page,
        table.stride(0), table.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        PAGE=page, D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_S=BLOCK_SLOTS, OWN_COLUMNS=own_columns)


def store_new_tokens_reference(table, batch_index, positions, pool_rows, k, v, region_k, region_v, valid, vnorm,
                               position, score, last_hit, overflow_flags, null_page: int, zero=0.0,
                               zero_int=0, row_columns=None) -> None:
    """The same writes in PyTorch (the CPU path and the kernel's reference).
    zero, zero_int: the values score and last_hit restart from (the region's
    0-d device constants, so no scalar is made for each write)."""
    R, H, M = table.shape
    P = region_k.shape[1]
    real = table < null_page  # full-precision pages (TBQ: the first column only)
    if row_columns is not None:
        real = real & (torch.arange(M, device=table.device) < row_columns.unsqueeze(-1)).unsqueeze(1)
    real = real.unsqueeze(-1)
    free = (~valid[table] & real).reshape(R, H, M * P)
    slot = free.int().argmax(dim=-1)  # [R, H]; 0 where none is free
    overflow_flags[pool_rows] |= ~free.any(dim=-1).all(dim=-1)  # some head found no free slot
    page = table.gather(2, (slot // P).unsqueeze(-1)).squeeze(-1)
    offset = slot % P
    region_k[page, offset] = k[batch_index].to(region_k.dtype)
    region_v[page, offset] = v[batch_index].to(region_v.dtype)
    vnorm[page, offset] = v[batch_index].float().abs().sum(-1)
    # Padded rows (step_meta.StepBuilder.pad_groups) hold only the null page:
    # what they store there must never be valid.
    valid[page, offset] = page != null_page
    position[page, offset] = positions.unsqueeze(1)
    score[page, offset] = zero
    last_hit[page, offset] = zero_int
