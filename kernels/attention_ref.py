"""Reference attention for a compressed request (PyTorch; a Triton kernel of
the same signature replaces it on GPU).

Queries of one request (one per decode step, or the chunk of its private
prompt being prefilled) attend to two parts: the radix-shared prefix in
SGLang's token pool (dense, visible to every query, since it precedes them)
and the request's private slots in the compressed region (paged; a mask says
which slots each query sees: valid, and causal in an extend). Here both parts
go through one masked softmax; a GPU kernel reduces each part on its own and
merges them with their log-sum-exp (split-KV), which gives the same result.
On CPU the single pass is about twice as fast for decode-sized inputs.
Observations for the policy come from the same pass.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvsieve.policies.observations import LayerObservations, Need

SPARSITY_THRESHOLD = 0.01  # a probability below 1% of its row's maximum counts as sparse


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
    region_mask [T, Hkv, S], True where query t sees slot s (every query sees
    at least itself). Query head h reads kv head h // (Hq // Hkv).
    Observations sum over the queries marked in `observe` ([T] bool; all if
    None): attention and ||p v||_1 per slot [Hkv, S] (summed over each kv
    head's query group too), and sparsity per query head [Hq] (averaged over
    the observed queries).
    """
    T, Hq, D = q.shape
    Hkv = region_k.shape[0]
    G = Hq // Hkv
    P = prefix_k.shape[0]
    keys = torch.cat([prefix_k.transpose(0, 1), region_k], dim=1).float()  # [Hkv, P+S, D]
    values = torch.cat([prefix_v.transpose(0, 1), region_v], dim=1).float()
    seen = torch.cat([region_mask.new_ones((T, Hkv, P)), region_mask], dim=-1).unsqueeze(2)  # [T, Hkv, 1, P+S]
    logits = torch.einsum("thgd,hnd->thgn", q.float().view(T, Hkv, G, D), keys) * scale
    p = torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=-1)  # [T, Hkv, G, P+S]
    out = torch.einsum("thgn,hnd->thgd", p, values)

    obs = LayerObservations()
    if needs & (Need.ATTENTION | Need.PV_NORM | Need.SPARSITY):
        rows = slice(None) if observe is None else observe
        p_obs = p[rows]
        pr = p_obs[..., P:]  # the region's share of the joint softmax
        if needs & (Need.ATTENTION | Need.PV_NORM):
            mass = pr.sum(dim=(0, 2))  # [Hkv, S]
            if needs & Need.ATTENTION:
                obs.attention = mass
            if needs & Need.PV_NORM:
                # ||p v||_1 = p * ||v||_1 since p >= 0.
                obs.pv_norm = mass * region_v.float().abs().sum(-1)
        if needs & Need.SPARSITY:
            visible = seen[rows]
            cutoff = SPARSITY_THRESHOLD * p_obs.amax(-1, keepdim=True)
            sparse = ((p_obs < cutoff) & visible).sum(-1)  # [T', Hkv, G]
            obs.sparsity = (sparse / visible.sum(-1)).mean(dim=0).reshape(Hq).float()
    return out.reshape(T, Hq, -1).to(q.dtype), obs


def attend_decode(q, prefix_k, prefix_v, region_k, region_v, region_valid, scale, needs=Need.NONE):
    """One decode query q [Hq, D] over the prefix and the valid region slots:
    attend() with T = 1. Output [Hq, Dv]."""
    out, obs = attend(q.unsqueeze(0), prefix_k, prefix_v, region_k, region_v, region_valid.unsqueeze(0),
                      scale, needs)
    return out[0], obs
