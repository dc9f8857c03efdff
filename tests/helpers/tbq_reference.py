"""A reference for ThinKV's TBQ group flush (radix_ext/tbq_store.py)."""

from __future__ import annotations

import torch

from kvsieve.kernels import kv_formats as kvf
from kvsieve.radix_ext import tbq_store


def flush_rows_per_token(pm, table: torch.Tensor, fmt: torch.Tensor) -> torch.Tensor:
    """radix_ext.tbq_store.flush_rows as it was written until 2026-11-26,
    on the same placement (tbq_store.place_groups): each token's
    destination page dequantized, joined and requantized for that token (so
    a page that takes a group of 16 tokens was rebuilt 16 times). The same
    results by a formulation simple enough to check by eye;
    tests/test_tbq.py holds the fast one equal to it."""
    quant = pm.quant
    Rf, H, M = table.shape
    S = pm.config.page_size
    dev = table.device
    if M == 1:
        return pm.valid[table[:, :, 0]].flatten(1).any(-1)
    p = tbq_store.place_groups(pm, table, fmt)
    buffer, ok, page, off = p.buffer, p.ok, p.page, p.off
    f = fmt.view(-1, 1, 1).long()

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

    tbq_store.move_slot_state(pm, p)
    return p.overflow
