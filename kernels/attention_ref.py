"""Reference attention for the compressed rows of a batch (PyTorch; the Triton
kernels of [gpu-kernels] take the same inputs).

Queries of each row (one per decode step, or the chunk of its private prompt
being prefilled) attend to two parts: the row's radix-shared prefix in
SGLang's token pool (dense, visible to every query, since it precedes them)
and the row's private slots in the compressed region (paged; a mask says
which slots each query sees: valid, and causal in an extend). Here both parts
go through one masked softmax; a GPU kernel reduces each part on its own and
merges them with their log-sum-exp (split-KV), which gives the same result.
Observations for the policies come from the same pass. Every row of the
batch goes through the same tensor calls: no loop over rows, no host sync.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvsieve.policies.observations import Need, Observations

SPARSITY_THRESHOLD = 0.01  # a probability below 1% of its row's maximum counts as sparse
OBSERVED = Need.ATTENTION | Need.PV_NORM | Need.SPARSITY


def attend_rows(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    prefix_mask: torch.Tensor,
    region_k: torch.Tensor,
    region_v: torch.Tensor,
    region_mask: torch.Tensor,
    scale: float,
    needs: Need = Need.NONE,
    observe: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Observations]:
    """Attention output [R, T, Hq, Dv] and the region's observations.

    q [R, T, Hq, D]; prefix_k/v [R, P, Hkv, D] with prefix_mask [R, P] (True
    where the row has a prefix token; P may be 0); region_k/v [R, Hkv, S, D];
    region_mask [R, T, Hkv, S], True where query t of the row sees slot s.
    Query head h reads kv head h // (Hq // Hkv). A query that sees nothing
    (padding) gets a zero output. Observations sum over the queries marked
    in `observe` ([R, T] bool; all if None): attention and ||p v||_1 per
    slot [R, Hkv, S] (summed over each kv head's query group too), and
    sparsity per query head [R, Hq] (averaged over the observed queries).
    """
    R, T, Hq, D = q.shape
    Hkv = region_k.shape[1]
    G = Hq // Hkv
    P = prefix_k.shape[1]
    keys = torch.cat([prefix_k.transpose(1, 2), region_k], dim=2).float()  # [R, Hkv, P+S, D]
    values = torch.cat([prefix_v.transpose(1, 2), region_v], dim=2).float()
    prefix_seen = prefix_mask.view(R, 1, 1, P).expand(R, T, Hkv, P)
    seen = torch.cat([prefix_seen, region_mask], dim=-1).unsqueeze(3)  # [R, T, Hkv, 1, P+S]
    logits = torch.einsum("rthgd,rhnd->rthgn", q.float().view(R, T, Hkv, G, D), keys) * scale
    p = torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=-1)
    p = torch.where(seen, p, torch.zeros((), dtype=p.dtype, device=p.device))  # padding rows: 0, not NaN
    out = torch.einsum("rthgn,rhnd->rthgd", p, values)

    obs = Observations()
    if needs & OBSERVED:
        if observe is not None:
            p = p * observe.view(R, T, 1, 1, 1)
        pr = p[..., P:]  # the region's share of the joint softmax
        if needs & (Need.ATTENTION | Need.PV_NORM):
            mass = pr.sum(dim=(1, 3))  # [R, Hkv, S]
            if needs & Need.ATTENTION:
                obs.attention = mass
            if needs & Need.PV_NORM:
                # ||p v||_1 = p * ||v||_1 since p >= 0.
                obs.pv_norm = mass * region_v.float().abs().sum(-1)
        if needs & Need.SPARSITY:
            cutoff = SPARSITY_THRESHOLD * p.amax(-1, keepdim=True)
            sparse = ((p < cutoff) & seen).sum(-1).float()  # [R, T, Hkv, G]
            share = sparse / seen.sum(-1).clamp(min=1)
            counted = observe.float() if observe is not None else q.new_ones((R, T), dtype=torch.float32)
            counted = counted * seen.flatten(2).any(-1).float()  # padding queries do not count
            obs.sparsity = ((share * counted.view(R, T, 1, 1)).sum(1) / counted.sum(1).clamp(min=1).view(R, 1, 1)
                            ).reshape(R, Hq)
    return out.reshape(R, T, Hq, -1).to(q.dtype), obs
