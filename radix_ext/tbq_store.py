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


#: Rows flushed per pass: the requantization holds about 3 MB of fp32
#: temporaries per row (its destination pages, dequantized and rebuilt), and
#: rows admitted together fill their groups in the same step (2,000 rows of
#: the TBQ headline in one pass ran an H100 out of memory).
FLUSH_ROWS = 128


def flush(pm, table: torch.Tensor, fmt: torch.Tensor) -> torch.Tensor:
    """flush_rows over the rows in passes of at most FLUSH_ROWS (the number
    of rows is known on the host: no sync)."""
    if table.shape[0] <= FLUSH_ROWS:
        return flush_rows(pm, table, fmt)
    return torch.cat([flush_rows(pm, table[i:i + FLUSH_ROWS], fmt[i:i + FLUSH_ROWS])
                      for i in range(0, table.shape[0], FLUSH_ROWS)])


def flush_rows(pm, table: torch.Tensor, fmt: torch.Tensor) -> torch.Tensor:
    """Move the full-precision page (column 0) of each (row, head) of the
    layer's page-table rows `table` [Rf, H, M] into the rows' quantized
    pages (columns 1..), in formats `fmt` [Rf] (kv_formats ids); the rows
    that found no room [Rf] (never, when admission reserved enough pages).
    Tensor calls only: no host sync."""
    quant = pm.quant
    Rf, H, M = table.shape
    S = pm.config.page_size
    dev = table.device
    buffer = table[:, :, 0]  # [Rf, H]
    qcols = table[:, :, 1:]  # [Rf, H, Mq]
    Mq = M - 1
    moving = pm.valid[buffer]  # [Rf, H, S]
    if Mq == 0:
        return moving.flatten(1).any(-1)
    qvalid = pm.valid[qcols]  # [Rf, H, Mq, S]
    real = qcols > pm.null_page
    page_fmt = pm.format[qcols].long()
    empty = ~qvalid.any(-1)
    f = fmt.view(-1, 1, 1).long()
    preference = torch.where(empty, 1, torch.where(page_fmt == f, 0, torch.where(page_fmt > f, 2, 3)))
    free = ~qvalid & real.unsqueeze(-1)
    rank = torch.where(free, preference.unsqueeze(-1), 4).flatten(2)  # [Rf, H, Mq*S]
    slots = torch.arange(Mq * S, device=dev)
    order = torch.argsort(rank * (Mq * S) + slots, dim=-1)[..., :S]  # the group's destinations, best first
    order_ok = rank.gather(-1, order) < 4
    place = (moving.long().cumsum(-1) - 1).clamp(min=0)  # k-th valid buffer slot -> k-th destination
    dest = order.gather(-1, place)  # [Rf, H, S] per buffer slot
    ok = moving & order_ok.gather(-1, place)
    overflow = (moving & ~ok).flatten(1).any(-1)
    col, off = dest // S, dest % S
    page = torch.where(ok, qcols.gather(-1, col), pm.null_page)  # [Rf, H, S]: destination page per token

    # Each token's destination page, requantized with the tokens that join it.
    old_valid = pm.valid[page]  # [Rf, H, S(page j), S(slot)]
    old_k, old_v = quant.dequantize(pm, page.reshape(-1))
    old_k, old_v = old_k.view(Rf, H, S, S, -1), old_v.view(Rf, H, S, S, -1)
    same = ((page.unsqueeze(-1) == page.unsqueeze(-2)) & ok.unsqueeze(-2)).float()  # [j, t]
    at = (off.unsqueeze(-1) == torch.arange(S, device=dev)).float()  # [t, slot]
    joins = torch.einsum("rhjt,rhto->rhjo", same, at) > 0
    new_k = torch.einsum("rhjt,rhto,rhtd->rhjod", same, at, pm.k[buffer].float())
    new_v = torch.einsum("rhjt,rhto,rhtd->rhjod", same, at, pm.v[buffer].float())
    page_k = torch.where(joins.unsqueeze(-1), new_k, old_k)
    page_v = torch.where(joins.unsqueeze(-1), new_v, old_v)
    page_valid = old_valid | joins
    fmt_after = torch.where(old_valid.any(-1), pm.format[page].long(), f)  # an empty page takes the group's
    q = kvf.quantize_pages(page_k.flatten(0, 2), page_v.flatten(0, 2), page_valid.flatten(0, 2),
                           fmt_after.flatten(), quant.bits)
    rows = quant.rows_of(page.flatten())
    quant.write(rows, q)
    pm.format[page] = torch.where(ok, fmt_after, 0).to(pm.format.dtype)
    _, deq_v = kvf.dequantize_pages(q, fmt_after.flatten(), quant.head_dim)
    pm.vnorm[page] = torch.where(page_valid, deq_v.abs().sum(-1).view(Rf, H, S, S), 0.0)

    # Slot state follows the tokens; the full-precision page is emptied.
    pm.valid[page, off] = ok
    pm.position[page, off] = torch.where(ok, pm.position[buffer], -1)
    pm.score[page, off] = torch.where(ok, pm.score[buffer], 0.0)
    pm.last_hit[page, off] = torch.where(ok, pm.last_hit[buffer], 0)
    pm.prefill_attention[page, off] = pm.const_zero
    still = moving & ~ok
    pm.valid[buffer] = still
    pm.position[buffer] = torch.where(still, pm.position[buffer], -1)
    return overflow
