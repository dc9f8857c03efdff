"""A reference for ThinKV's TBQ group flush (radix_ext/tbq_store.py)."""

from __future__ import annotations

import torch

from kvsieve.kernels import kv_formats as kvf


def flush_rows_per_token(pm, table: torch.Tensor, fmt: torch.Tensor) -> torch.Tensor:
    """radix_ext.tbq_store.flush_rows as it was written until 2026-11-26:
    each token's destination page dequantized, joined and requantized for
    that token (so a page that takes a group of 16 tokens was rebuilt 16
    times). The same results, by a formulation simple enough to check by
    eye; tests/test_tbq.py holds the fast one equal to it."""
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
