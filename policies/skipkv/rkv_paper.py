"""R-KV's token scores as the paper computes them (rkv/skipkv `scoring: "paper"`),
batched over [R, H, S] slots. Section and equation numbers are R-KV's
(Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Reasoning
Models", arXiv 2505.24133, §3).

Candidates (§3.1): the valid slots outside the protected newest `window`
(R-KV's α observation tokens, always kept). Both scores are computed over
the candidates only, as the paper scores its n candidate keys.

importance (§3.2, Eq. 1-4), recomputed at each decision from the row's last
  min(window, decode steps so far) queries of the layer (SlotView.queries):
  per query head the logits q.k / sqrt(d) over the candidates; over a kv
  head's group of query heads their max (GQA, Eq. 3); softmax over the
  candidates; each query's row max-pooled over `kernel` neighbours in
  position order (Eq. 4, a centred odd window where the paper writes
  i-W .. i+W-1); then the mean over the queries.
redundancy (§3.3, Eq. 5-6): S = cosine similarities of the candidate keys,
  diagonal 0. For each token i, of the tokens j with S[j, i] > T the beta
  newest (largest position) get S[j, i] = 0: the newest copy of a
  near-duplicate is not penalised for the older ones, which are.
  Each token's redundancy is the mean of its row, S_bar[j] = sum_i S[j, i] / n,
  softmaxed over the candidates.
score (§3.4, Eq. 7) = lambda_mix * importance - (1 - lambda_mix) * redundancy.

Decisions (the paper gives no value for T or beta): T = 0.5 and beta = 1,
R-KV's public defaults (its code spares the single newest similar key);
beta = 1 is a max over the column, not a top-k.

Cost: the importance is one [R, H, G x W, S] product per decision; the
redundancy needs the S x S matrix, computed in column blocks of at most
_BLOCK_ELEMENTS similarities so that it never holds [R, H, S, S] at once.
No host sync: every shape and loop bound is known on the host.
"""

from __future__ import annotations

import torch

from ..observations import SlotView
from ..snapkv import pool_by_position

#: T: cosine above which two keys are near-duplicates.
SIMILARITY_THRESHOLD = 0.5
#: Added to key norms before dividing (Eq. 5's epsilon).
_EPS = 1e-8
#: Similarities held at once by the redundancy's column blocks (128 MiB of float32).
_BLOCK_ELEMENTS = 1 << 25


def dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, D] . b [..., N, D] -> [..., M, N] float32. 16-bit inputs
    on a GPU stay 16-bit (fp32 accumulation): a float32 copy of every key
    would triple the decision's memory traffic."""
    lead = a.shape[:-2]
    a3, b3 = a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])
    if a3.is_cuda and a3.dtype == b3.dtype and a3.dtype in (torch.bfloat16, torch.float16):
        out = torch.bmm(a3, b3.transpose(1, 2), out_dtype=torch.float32)
    else:
        out = torch.bmm(a3.float(), b3.float().transpose(1, 2))
    return out.view(*lead, a.shape[-2], b.shape[-2])


# ----- importance (§3.2) ------------------------------------------------------

def own_recent_queries(query_position: torch.Tensor, newest: torch.Tensor, step: torch.Tensor,
                       window: torch.Tensor) -> torch.Tensor:
    """[R, W] the ring slots holding the row's last min(window, step + 1)
    decode queries: positions newest - count + 1 .. newest. A slot whose
    position is outside (older, or a previous request's) is not the row's."""
    count = torch.minimum(window, step + 1)
    first = (newest - count + 1).unsqueeze(1)
    return (query_position >= first) & (query_position <= newest.unsqueeze(1)) & (query_position >= 0)


def grouped_logits(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[R, H, W, S]: q.k / sqrt(d) of the queries [R, W, Hq, D] and keys
    [R, H, S, D], the max over each kv head's G = Hq / H query heads (Eq. 2-3;
    query head h*G + g reads kv head h)."""
    R, W, Hq, D = queries.shape
    H = keys.shape[1]
    G = Hq // H
    q = queries.view(R, W, H, G, D).permute(0, 2, 3, 1, 4).reshape(R, H, G * W, D)
    logits = dots(q, keys) * D ** -0.5  # [R, H, G*W, S]
    return logits.view(R, H, G, W, -1).amax(dim=2)


def attention_over(logits: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Softmax of each query's logits [R, H, W, S] over its head's candidates
    [R, H, S] (Eq. 1 and 3); 0 elsewhere and in a head with no candidate."""
    masked = logits.masked_fill(~candidates.unsqueeze(2), float("-inf"))
    return torch.nan_to_num(torch.softmax(masked, dim=-1), nan=0.0)


def pool_each_query(attention: torch.Tensor, position: torch.Tensor, candidates: torch.Tensor,
                    kernel: torch.Tensor, max_kernel: int) -> torch.Tensor:
    """Eq. 4's max-pooling of each query's attention [R, H, W, S] over
    `kernel` ([R]) neighbouring candidates in position order."""
    R, H, W, S = attention.shape

    def per_query(t):
        return t.unsqueeze(2).expand(R, H, W, S).reshape(R, H * W, S)
    flat = SlotView(valid=per_query(candidates), position=per_query(position), score=None, last_hit=None)
    return pool_by_position(attention.reshape(R, H * W, S), flat, kernel, max_kernel).view(R, H, W, S)


def window_importance(view: SlotView, candidates: torch.Tensor, step: torch.Tensor, window: torch.Tensor,
                      kernel: torch.Tensor, max_kernel: int) -> torch.Tensor:
    """[R, H, S] I_i of Eq. 4 from the row's own recent queries (view.queries)."""
    newest = torch.where(view.valid, view.position, torch.full_like(view.position, -1)).amax(dim=(1, 2))
    own = own_recent_queries(view.query_position, newest, step, window)  # [R, W]
    attention = attention_over(grouped_logits(view.queries, view.keys), candidates)
    pooled = pool_each_query(attention, view.position, candidates, kernel, max_kernel)
    weight = own.float() / own.sum(dim=-1, keepdim=True).clamp(min=1)  # the mean over the row's queries
    return torch.einsum("rhws,rw->rhs", pooled, weight)


# ----- redundancy (§3.3) ------------------------------------------------------

def unit_keys(keys: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Eq. 5's K / (|K| + eps) for candidate slots, 0 elsewhere (so that a
    non-candidate is similar to nothing); in the keys' dtype."""
    norm = torch.linalg.vector_norm(keys, dim=-1, keepdim=True, dtype=torch.float32)
    unit = keys.float() / (norm + _EPS) * candidates.unsqueeze(-1)
    return unit.to(keys.dtype) if keys.is_cuda else unit


def spare_newest_duplicates(sim: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """sim [R, H, S, b]: column i holds S[j, i] for every token j. Of the j
    with S[j, i] > T, the newest (beta = 1) gets S[j, i] = 0. Positions of a
    head's slots are distinct, so the newest is one slot."""
    newness = torch.where(sim > SIMILARITY_THRESHOLD, position.int().unsqueeze(-1), -1)  # int32: half the bytes
    newest = newness.amax(dim=-2, keepdim=True)
    return sim.masked_fill((newness == newest) & (newest >= 0), 0.0)


def corrected_redundancy(keys: torch.Tensor, candidates: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """[R, H, S] R_i of Eq. 6 over each head's candidates (0 elsewhere)."""
    R, H, S, _ = keys.shape
    unit = unit_keys(keys, candidates)
    row_sum = torch.zeros((R, H, S), dtype=torch.float32, device=keys.device)
    block = max(1, min(S, _BLOCK_ELEMENTS // max(1, R * H * S)))
    rows = torch.arange(S, device=keys.device).unsqueeze(1)
    for start in range(0, S, block):  # column blocks: bounded by S, known on the host
        stop = min(S, start + block)
        sim = dots(unit, unit[:, :, start:stop])  # [R, H, S, b] = S[j, i], i in the block
        sim = sim.masked_fill(rows == torch.arange(start, stop, device=keys.device), 0.0)  # S[i, i] = 0
        row_sum += spare_newest_duplicates(sim, position).sum(dim=-1)
    n = candidates.sum(dim=-1, keepdim=True).clamp(min=1)
    mean = (row_sum / n).masked_fill(~candidates, float("-inf"))
    return torch.nan_to_num(torch.softmax(mean, dim=-1), nan=0.0)


# ----- the score (§3.4) -------------------------------------------------------

def paper_scores(view: SlotView, candidates: torch.Tensor, importance: torch.Tensor,
                 lambda_mix: torch.Tensor) -> torch.Tensor:
    """Eq. 7 over the candidates [R, H, S], from an importance [R, H, S]."""
    lam = lambda_mix.view(-1, 1, 1)
    return lam * importance - (1 - lam) * corrected_redundancy(view.keys, candidates, view.position)
