"""Crystal-KV adaptive budgets (crystal-kv.txt §5.3, Algorithm 2) for one
request, as a pure host-side tensor function: it runs every
`realloc_interval` steps, never inside the forward.

    eta_l   = sum_h CRF[l, h] / sum_h B[l, h]
    B'_l    = B_total * eta_l / sum_l eta_l
    eta_l,h = CRF[l, h] / B[l, h]
    B'_l,h  = B'_l * eta_l,h / sum_h eta_l,h

Rounding (our decision, policies.md): every head first gets the floor
`min_head_budget` (lowered to B_total // (L*H) when the total cannot pay it),
then the rest of the total is shared in proportion to the real-valued
weights above and rounded by largest remainder (ties: lower flat index
first), so the result sums to B_total exactly. No information (every CRF 0)
keeps the current budgets; a layer whose heads all have CRF 0 gets floors
only; a layer that has a share but CRF 0 in every head cannot happen.
"""

from __future__ import annotations

import torch


def share_weights(crf: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
    """Algorithm 2's weights [L, H] (sum 1): the layer's share of the total
    times the head's share of its layer. `crf` and `budgets` are [L, H]."""
    crf = crf.double().clamp(min=0.0)
    budgets = budgets.double().clamp(min=1.0)
    eta_layer = crf.sum(dim=1) / budgets.sum(dim=1)  # [L]
    layer_share = eta_layer / eta_layer.sum()
    eta_head = crf / budgets  # [L, H]
    head_sum = eta_head.sum(dim=1, keepdim=True)
    head_share = torch.where(head_sum > 0, eta_head / head_sum.clamp(min=1e-300), torch.zeros_like(eta_head))
    return layer_share.unsqueeze(1) * head_share


def largest_remainder(amounts: torch.Tensor, total: int) -> torch.Tensor:
    """Whole numbers (int64, same shape) summing to `total`, each the floor of
    its amount plus one for the largest fractional parts (stable ties)."""
    flat = amounts.flatten()
    whole = flat.floor()
    left = total - int(whole.sum().item())
    order = torch.sort(flat - whole, descending=True, stable=True).indices
    bonus = torch.zeros_like(flat)
    bonus[order[:max(left, 0)]] = 1.0
    return (whole + bonus).to(torch.int64).view_as(amounts)


def reallocate_budgets(crf: torch.Tensor, budgets: torch.Tensor, min_head_budget: int,
                       total: int | None = None) -> torch.Tensor:
    """New per-(layer, head) budgets [L, H] (int64) summing to `total`
    (default: the total of `budgets`; a budget_ratio's total grows between
    reallocations), at least the floor per head. The weights read `budgets`
    only through ratios, so a total other than theirs scales them evenly."""
    budgets = budgets.to(torch.int64)
    held = int(budgets.sum().item())  # host tensors (read back between steps): no device sync
    if total is None:
        total = held
    if not bool((crf > 0).any()):
        if total == held:
            return budgets.clone()
        return largest_remainder(budgets.double() * (total / max(held, 1)), total)
    heads = budgets.numel()
    floor = min(min_head_budget, total // heads)
    weights = share_weights(crf, budgets)
    return floor + largest_remainder(weights * (total - floor * heads), total - floor * heads)
