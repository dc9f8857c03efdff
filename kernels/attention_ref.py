"""Reference attention for a compressed request (PyTorch; a Triton kernel of
the same signature replaces it on GPU).

One query token per request attends to two parts: the radix-shared prefix in
SGLang's token pool (dense) and the request's private slots in the
compressed region (paged, with a valid mask). Each part is reduced on its
own (split-KV) and the two are merged with their log-sum-exp, giving one
softmax over both. Observations for the policy come from the same pass.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvsieve.policies.observations import LayerObservations, Need

SPARSITY_THRESHOLD = 0.01  # a probability below 1% of its row's maximum counts as sparse


def _part(q: torch.Tensor, k: torch.Tensor, valid: Optional[torch.Tensor], scale: float):
    """Logits of one part. q [Hkv, G, D]; k [Hkv, N, D]; valid [Hkv, N] or None."""
    logits = torch.einsum("hgd,hnd->hgn", q.float(), k.float()) * scale
    if valid is not None:
        logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    return logits


def attend_decode(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    region_k: torch.Tensor,
    region_v: torch.Tensor,
    region_valid: torch.Tensor,
    scale: float,
    needs: Need = Need.NONE,
) -> tuple[torch.Tensor, LayerObservations]:
    """Attention output [Hq, D] and the region's observations.

    q [Hq, D]; prefix_k/v [T, Hkv, D] (T may be 0); region_k/v [Hkv, S, D];
    region_valid [Hkv, S]. Query head h reads kv head h // (Hq // Hkv).
    """
    Hq, D = q.shape
    Hkv = region_k.shape[0]
    G = Hq // Hkv
    qg = q.view(Hkv, G, D)

    # Part 1: prefix. Part 2: region. Each gives (max, sum of exp, weighted sum).
    parts = []
    for k, v, valid in ((prefix_k.transpose(0, 1), prefix_v.transpose(0, 1), None),
                        (region_k, region_v, region_valid)):
        logits = _part(qg, k, valid, scale)  # [Hkv, G, N]
        if logits.shape[-1] == 0:  # an empty part (no shared prefix) weighs nothing
            m = torch.full((*logits.shape[:-1], 1), torch.finfo(torch.float32).min, device=logits.device)
        else:
            m = logits.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min)
        e = torch.exp(logits - m)
        parts.append((logits, m, e.sum(-1, keepdim=True), torch.einsum("hgn,hnd->hgd", e, v.float())))

    (lp, mp, sp, op), (lr, mr, sr, orr) = parts
    m = torch.maximum(mp, mr)
    wp, wr = torch.exp(mp - m), torch.exp(mr - m)
    denom = sp * wp + sr * wr
    out = (op * wp + orr * wr) / denom

    obs = LayerObservations()
    if needs & (Need.ATTENTION | Need.PV_NORM | Need.SPARSITY):
        # Probabilities of the joint softmax, recovered from the merged statistics.
        pr = torch.exp(lr - m) / denom  # [Hkv, G, S]
        if needs & Need.ATTENTION:
            obs.attention = pr.sum(dim=1)
        if needs & Need.PV_NORM:
            # ||p v||_1 = p * ||v||_1 since p >= 0; summed over the query group.
            obs.pv_norm = pr.sum(dim=1) * region_v.float().abs().sum(-1)
        if needs & Need.SPARSITY:
            pp = torch.exp(lp - m) / denom
            row_max = pr.amax(-1, keepdim=True)
            if pp.shape[-1]:
                row_max = torch.maximum(row_max, pp.amax(-1, keepdim=True))
            cutoff = SPARSITY_THRESHOLD * row_max
            sparse = (pp < cutoff).sum(-1) + ((pr < cutoff) & region_valid.unsqueeze(1)).sum(-1)
            total = pp.shape[-1] + region_valid.sum(-1, keepdim=True)
            obs.sparsity = (sparse / total).reshape(Hq).float()
    return out.reshape(Hq, D).to(q.dtype), obs
