"""Quantized pages of the compressed region (ThinKV's TBQ; design:
docs/design/tbq.md).

A request with TBQ owns, per (layer, kv head), one full-precision page (its
first column: the newest tokens, at most one group) and quantized pages (the
other columns). Decode stores each new token in the full-precision page;
every `page_size` (16) decode steps, once the group is whole, `flush` moves
the page's tokens into the head's quantized pages in the group's format and
empties it. Each quantized page has one format (`PageManager.format`); a
group goes, in this order of preference, to free slots of pages of its own
format, to empty pages (which take its format), to free slots of pages of a
higher precision, and last to any free slot. Slots evicted from a quantized
page are refilled this way: keys share per-channel scales over the page, so a
page that takes new tokens is requantized as a whole (its old tokens are
dequantized first; when their channel ranges do not change, their codes stay
the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsieve.kernels import kv_formats as kvf


class QuantPool:
    """K/V codes and scales of the quantized pages, one row per page plus a
    zero row (`null`) that full-precision and null pages map to."""

    def __init__(self, config):
        c = config
        n = c.quant_pages + 1
        width = kvf.code_bytes(c.head_dim, c.quant_bits)
        self.bits = c.quant_bits
        self.head_dim = c.head_dim
        self.dtype = c.dtype
        self.first = c.num_pages + 1  # page id of quantized row 0
        self.null = c.quant_pages
        self.k_codes = torch.zeros(n, c.page_size, width, dtype=torch.uint8, device=c.device)
        self.v_codes = torch.zeros_like(self.k_codes)
        self.k_scale = torch.zeros(n, c.head_dim, dtype=torch.uint8, device=c.device)
        self.v_scale = torch.zeros(n, c.page_size, c.head_dim // kvf.GROUP, dtype=torch.uint8, device=c.device)
        self.page_scale = torch.zeros(n, 2, dtype=torch.float32, device=c.device)

    @staticmethod
    def bytes_per_page(head_dim: int, page_size: int, bits: int) -> int:
        """Bytes one quantized page takes in memory (codes and scales)."""
        return (2 * page_size * kvf.code_bytes(head_dim, bits) + head_dim + page_size * (head_dim // kvf.GROUP)
                + 8)

    def rows_of(self, pages: torch.Tensor) -> torch.Tensor:
        """Quantized row of each page id (the zero row for the others)."""
        return torch.where(pages >= self.first, pages - self.first, torch.full_like(pages, self.null))

    def pages(self, rows: torch.Tensor) -> kvf.QuantPages:
        return kvf.QuantPages(self.k_codes[rows], self.v_codes[rows], self.k_scale[rows], self.v_scale[rows],
                              self.page_scale[rows])

    def write(self, rows: torch.Tensor, q: kvf.QuantPages) -> None:
        self.k_codes[rows] = q.k_codes
        self.v_codes[rows] = q.v_codes
        self.k_scale[rows] = q.k_scale
        self.v_scale[rows] = q.v_scale
        self.page_scale[rows] = q.page_scale

    def dequantize(self, pm, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V float32 [N, page_size, D] of quantized page ids `pages` [N]."""
        return kvf.dequantize_pages(self.pages(self.rows_of(pages)), pm.format[pages].long(), self.head_dim)

    def kv_of(self, pm, table: torch.Tensor, values: bool):
        """PageManager.kv_of with quantized pages: every page of `table`
        read at its precision."""
        flat = table.reshape(-1)
        quantized = (flat >= self.first).view(-1, 1, 1)
        full = flat.clamp(max=pm.null_page)
        k, v = self.dequantize(pm, flat)
        keys = torch.where(quantized, k.to(self.dtype), pm.k[full])
        vals = torch.where(quantized, v.to(self.dtype), pm.v[full]) if values else None
        shape = (*table.shape, *pm.k.shape[1:])
        return keys.view(shape), (vals.view(shape) if values else None)


#: Rows placed per pass: the placement sorts every quantized slot of a
#: row's heads (about 30 KB of temporaries per row and head at 1K slots).
FLUSH_ROWS = 512
#: Destination pages requantized per pass: about 120 KB of fp32 temporaries
#: each (the page dequantized, joined, and quantized in every format). Rows
#: admitted together fill their groups in the same step: a pass of 2,000
#: rows of the TBQ headline, when each token rebuilt its own copy of its
#: destination page, ran an H100 out of memory.
FLUSH_PAGES = 2048


def flush(pm, table: torch.Tensor, fmt: torch.Tensor) -> torch.Tensor:
    """flush_rows over the rows in passes of at most FLUSH_ROWS (the number
    of rows is known on the host)."""
    if table.shape[0] <= FLUSH_ROWS:
        return flush_rows(pm, table, fmt)
    return torch.cat([flush_rows(pm, table[i:i + FLUSH_ROWS], fmt[i:i + FLUSH_ROWS])
                      for i in range(0, table.shape[0], FLUSH_ROWS)])


@dataclass
class Placement:
    """Where a flush puts each token of its rows' groups (place_groups)."""

    buffer: torch.Tensor  # [Rf, H] the full-precision page of each (row, head)
    moving: torch.Tensor  # [Rf, H, S] its valid slots: the tokens that move
    ok: torch.Tensor  # [Rf, H, S] the moving tokens that found a slot
    page: torch.Tensor  # [Rf, H, S] each token's destination page (the null page where not ok)
    off: torch.Tensor  # [Rf, H, S] its slot there
    overflow: torch.Tensor  # [Rf] rows with a token that found no slot


def place_groups(pm, table: torch.Tensor, fmt: torch.Tensor) -> Placement:
    """The destinations of the groups in the full-precision page (column 0)
    of each (row, head) of `table` [Rf, H, M] (at least one quantized
    column), in this order of preference: free slots of pages of the
    group's format `fmt` [Rf], empty pages, free slots of pages of a higher
    precision, any free slot; within one preference, in column order, so the
    tokens that go to one page are consecutive among the moving ones."""
    Rf, H, M = table.shape
    S = pm.config.page_size
    buffer = table[:, :, 0]  # [Rf, H]
    qcols = table[:, :, 1:]  # [Rf, H, Mq]
    Mq = M - 1
    moving = pm.valid[buffer]  # [Rf, H, S]
    qvalid = pm.valid[qcols]  # [Rf, H, Mq, S]
    real = qcols > pm.null_page
    page_fmt = pm.format[qcols].long()
    empty = ~qvalid.any(-1)
    f = fmt.view(-1, 1, 1).long()
    preference = torch.where(empty, 1, torch.where(page_fmt == f, 0, torch.where(page_fmt > f, 2, 3)))
    free = ~qvalid & real.unsqueeze(-1)
    rank = torch.where(free, preference.unsqueeze(-1), 4).flatten(2)  # [Rf, H, Mq*S]
    slots = torch.arange(Mq * S, device=table.device)
    order = torch.argsort(rank * (Mq * S) + slots, dim=-1)[..., :S]  # the group's destinations, best first
    order_ok = rank.gather(-1, order) < 4
    place = (moving.long().cumsum(-1) - 1).clamp(min=0)  # k-th valid buffer slot -> k-th destination
    dest = order.gather(-1, place)  # [Rf, H, S] per buffer slot
    ok = moving & order_ok.gather(-1, place)
    col, off = dest // S, dest % S
    page = torch.where(ok, qcols.gather(-1, col), pm.null_page)
    return Placement(buffer=buffer, moving=moving, ok=ok, page=page, off=off,
                     overflow=(moving & ~ok).flatten(1).any(-1))


def move_slot_state(pm, p: Placement) -> None:
    """Slot state follows the tokens; the full-precision page is emptied
    (but for tokens that found no slot)."""
    page, off, ok, buffer = p.page, p.off, p.ok, p.buffer
    pm.valid[page, off] = ok
    pm.position[page, off] = torch.where(ok, pm.position[buffer], -1)
    pm.score[page, off] = torch.where(ok, pm.score[buffer], 0.0)
    pm.last_hit[page, off] = torch.where(ok, pm.last_hit[buffer], 0)
    pm.prefill_attention[page, off] = pm.const_zero
    still = p.moving & ~ok
    pm.valid[buffer] = still
    pm.position[buffer] = torch.where(still, pm.position[buffer], -1)


def flush_rows(pm, table: torch.Tensor, fmt: torch.Tensor) -> torch.Tensor:
    """Move the full-precision page (column 0) of each (row, head) of the
    page-table rows `table` [Rf, H, M] into the rows' quantized pages
    (columns 1..), in formats `fmt` [Rf] (kv_formats ids); the rows that
    found no room [Rf] (never, when admission reserved enough pages).

    Each destination page is dequantized, joined by its tokens and
    requantized once. One host sync (the number of destination pages): the
    flush runs eagerly, outside any captured graph, once per group of
    `page_size` steps. Its rows may be of several layers (the table rows of
    every layer of a step stacked): pages are per (layer, head)."""
    Rf, H, M = table.shape
    S = pm.config.page_size
    if M == 1:
        return pm.valid[table[:, :, 0]].flatten(1).any(-1)
    p = place_groups(pm, table, fmt)
    ok, page = p.ok, p.page
    # A run's first token stands for its page (at most S pages per head, mostly one).
    at = torch.arange(S, device=table.device).expand(Rf, H, S)
    before = _carry_forward(torch.where(ok, at, -1))  # the last moving token up to each token
    before = torch.cat([torch.full_like(before[..., :1], -1), before[..., :-1]], dim=-1)  # ... before it
    prev = torch.where(before >= 0, page.gather(-1, before.clamp(min=0)), -1)
    first = ok & (page != prev)  # [Rf, H, S]
    which = first.flatten().cumsum(0).view(Rf, H, S) - 1  # the destination index of each run's tokens
    run = torch.where(ok, _carry_forward(torch.where(first, which, -1)), 0)  # [Rf, H, S]
    pages = page[first]  # [U]: one host sync, the count of destination pages
    U = pages.shape[0]
    if U == 0:
        return p.overflow
    row_of_page = torch.arange(Rf, device=table.device).view(Rf, 1, 1).expand(Rf, H, S)[first]

    # Each destination page, requantized once with the tokens that join it.
    t_run, t_off = run[ok], p.off[ok]
    src_page, src_slot = p.buffer.unsqueeze(-1).expand(Rf, H, S)[ok], at[ok]  # where each moving token is now
    group_fmt = fmt.long()[row_of_page]
    for u0 in range(0, U, FLUSH_PAGES):
        u1 = min(u0 + FLUSH_PAGES, U)
        mine = (t_run >= u0) & (t_run < u1)
        _requantize(pm, pages[u0:u1], group_fmt[u0:u1], t_run[mine] - u0, t_off[mine], src_page[mine],
                    src_slot[mine])
    move_slot_state(pm, p)
    return p.overflow


def _requantize(pm, pages: torch.Tensor, group_fmt: torch.Tensor, run: torch.Tensor, off: torch.Tensor,
                src_page: torch.Tensor, src_slot: torch.Tensor) -> None:
    """Quantized pages `pages` [U] joined by the tokens in full-precision
    slots (src_page, src_slot) at their slots `off` of pages[run]:
    dequantized, joined and requantized, in their format (an empty page in
    its group's, `group_fmt`)."""
    quant = pm.quant
    old_valid = pm.valid[pages]  # [U, S]
    page_k, page_v = quant.dequantize(pm, pages)  # [U, S, D] float32
    page_k[run, off] = pm.k[src_page, src_slot].float()
    page_v[run, off] = pm.v[src_page, src_slot].float()
    joins = torch.zeros_like(old_valid)
    joins[run, off] = True
    page_valid = old_valid | joins
    fmt_after = torch.where(old_valid.any(-1), pm.format[pages].long(), group_fmt)
    q = kvf.quantize_pages(page_k, page_v, page_valid, fmt_after, quant.bits)
    quant.write(quant.rows_of(pages), q)
    pm.format[pages] = fmt_after.to(pm.format.dtype)
    _, deq_v = kvf.dequantize_pages(q, fmt_after, quant.head_dim)
    pm.vnorm[pages] = torch.where(page_valid, deq_v.abs().sum(-1), 0.0)


def _carry_forward(x: torch.Tensor) -> torch.Tensor:
    """Along the last dim, each -1 replaced by the last value >= 0 before it
    (values ascend along it where set)."""
    return x.cummax(dim=-1).values
