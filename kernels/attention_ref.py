"""Reference attention for a compressed request (PyTorch; a Triton kernel of
the same signature replaces it on GPU).

Queries of one request (one per decode step, or the chunk of its private
prompt being prefilled) attend to two parts: the radix-shared prefix in
SGLang's token pool (dense, visible to every query, since it precedes them)
and the request's private slots in the compressed region (paged; a mask says
which slots each query sees: valid, and causal in an extend). Each part is
reduced on its own (split-KV) and the two are merged with their log-sum-exp,
which gives one softmax over both. Observations for the policy come from
the same pass.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvsieve.policies.observations import LayerObservations, Need

SPARSITY_THRESHOLD = 0.01  # a probability below 1% of its row's maximum counts as sparse
_FLOOR = torch.finfo(torch.float32).min


def _reduce(logits: torch.Tensor, v: torch.Tensor, spec: str):
    """One part's (row max, sum of exp, exp-weighted sum of v); an empty or
    fully masked part weighs nothing after the merge."""
    if logits.shape[-1] == 0:
        m = torch.full((*logits.shape[:-1], 1), _FLOOR, device=logits.device)
    else:
        m = logits.amax(dim=-1, keepdim=True).clamp(min=_FLOOR)
    e = torch.exp(logits - m)
    return m, e.sum(-1, keepdim=True), torch.einsum(spec, e, v.float())


def attend(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    region_k: torch.Tensor,
    region_v: torch.Tensor,
    region_mask: torch.Tensor,
    scale: float,
    needs: Need = Need.NONE,
    observe: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, LayerObservations]:
    """Attention output [T, Hq, Dv] and the region's observations.

    q [T, Hq, D]; prefix_k/v [P, Hkv, D] (P may be 0); region_k/v [Hkv, S, D];
    region_mask [T, Hkv, S], True where query t sees slot s. Query head h
    reads kv head h // (Hq // Hkv). Observations sum over the queries marked
    in `observe` ([T] bool; all if None): attention and ||p v||_1 per slot
    [Hkv, S] (summed over each kv head's query group too), and sparsity per
    query head [Hq] (averaged over the observed queries).
    """
    T, Hq, D = q.shape
    Hkv = region_k.shape[0]
    G = Hq // Hkv
    qg = q.float().view(T, Hkv, G, D)

    lp = torch.einsum("thgd,phd->thgp", qg, prefix_k.float()) * scale  # [T, Hkv, G, P]
    lr = torch.einsum("thgd,hsd->thgs", qg, region_k.float()) * scale  # [T, Hkv, G, S]
    visible = region_mask.unsqueeze(2)  # [T, Hkv, 1, S]
    lr = lr.masked_fill(~visible, float("-inf"))
    mp, sp, op = _reduce(lp, prefix_v, "thgp,phd->thgd")
    mr, sr, orr = _reduce(lr, region_v, "thgs,hsd->thgd")
    m = torch.maximum(mp, mr)
    wp, wr = torch.exp(mp - m), torch.exp(mr - m)
    denom = sp * wp + sr * wr
    out = (op * wp + orr * wr) / denom

    obs = LayerObservations()
    if needs & (Need.ATTENTION | Need.PV_NORM | Need.SPARSITY):
        rows = torch.ones(T, dtype=torch.bool, device=q.device) if observe is None else observe
        # Probabilities of the joint softmax, recovered from the merged statistics.
        pr = (torch.exp(lr - m) / denom)[rows]  # [T', Hkv, G, S]
        if needs & (Need.ATTENTION | Need.PV_NORM):
            mass = pr.sum(dim=(0, 2))  # [Hkv, S]
            if needs & Need.ATTENTION:
                obs.attention = mass
            if needs & Need.PV_NORM:
                # ||p v||_1 = p * ||v||_1 since p >= 0.
                obs.pv_norm = mass * region_v.float().abs().sum(-1)
        if needs & Need.SPARSITY:
            pp = (torch.exp(lp - m) / denom)[rows]
            seen = visible[rows]
            row_max = torch.maximum(pr.amax(-1, keepdim=True), pp.amax(-1, keepdim=True)
                                    if pp.shape[-1] else torch.zeros_like(m[rows]))
            cutoff = SPARSITY_THRESHOLD * row_max
            sparse = (pp < cutoff).sum(-1) + ((pr < cutoff) & seen).sum(-1)  # [T', Hkv, G]
            total = pp.shape[-1] + seen.sum(-1)
            obs.sparsity = (sparse / total).mean(dim=0).reshape(Hq).float()
    return out.reshape(T, Hq, -1).to(q.dtype), obs


def attend_decode(q, prefix_k, prefix_v, region_k, region_v, region_valid, scale, needs=Need.NONE):
    """One decode query q [Hq, D] over the prefix and the valid region slots:
    attend() with T = 1. Output [Hq, Dv]."""
    out, obs = attend(q.unsqueeze(0), prefix_k, prefix_v, region_k, region_v, region_valid.unsqueeze(0),
                      scale, needs)
    return out[0], obs
