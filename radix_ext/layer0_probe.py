"""Need.LAYER0_ATTENTION: the first layer's attention over a request's
private prompt, summarized chunk by chunk for the policy (CrystalCache S1).

The backend calls `observe` in the first layer of every extend of such a
request, after the chunk's K/V are in the region: the prompt's queries are
probed in blocks of CrystalCache chunks (`CHUNK` = 1024 queries), one query
head at a time, so a block holds [C, n] probabilities of one head, never
[H, n, n]. Probabilities are the private columns of the joint softmax over
the shared prefix and the private prompt (what the model computes; the
prefix's share is dropped), causal by position.

What one chunk of queries leaves, on the device (per request, `ProbeState`):
  * saliency of each key of the chunk: the attention it receives from the
    chunk's queries, summed per head, then over the TOP_HEADS largest heads;
  * intra edges: for each query of the chunk, the K_INTRA other queries of
    the chunk whose head-mean attention rows (over the chunk's keys) are the
    most cosine-similar (rows of a chunk split across two extends wait in a
    [C, C] buffer until the chunk is whole);
  * cross edges: for each query, the K_CROSS keys before its chunk with the
    largest head-mean probability.
`collect`, at the prompt's end, hands every ending request's summary to the
policy on the device (observations.PromptAttention): O(n) numbers per
request, for the policy to threshold and build its graph from, with no
read-back inside the forward.

Cost: per extend and probed request, a loop over query heads and over
chunks (both bounded on the host), in the first layer only.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvsieve.policies.observations import PromptAttention

CHUNK = 1024
TOP_HEADS = 3
K_INTRA = 8
K_CROSS = 4
EPS = 1e-8
ATTRIBUTE = "layer0_probe"  # where a request's ProbeState lives on its RequestState


class ProbeState:
    """One request's probe across the extends of its private prompt."""

    def __init__(self, n: int, device, chunk: int = CHUNK):
        self.n, self.chunk, self.device = n, chunk, device
        self.done = 0  # private prompt queries probed so far
        f32, i64 = torch.float32, torch.int64
        self.saliency = torch.zeros(n, dtype=f32, device=device)
        self.intra_index = torch.full((n, K_INTRA), -1, dtype=i64, device=device)
        self.intra_weight = torch.zeros((n, K_INTRA), dtype=f32, device=device)
        self.cross_index = torch.full((n, K_CROSS), -1, dtype=i64, device=device)
        self.cross_weight = torch.zeros((n, K_CROSS), dtype=f32, device=device)
        self.col_sums: Optional[torch.Tensor] = None  # [Hq, L] of the chunk in progress
        self.rows: Optional[torch.Tensor] = None  # [L, L] its head-mean attention rows


def observe(state: ProbeState, q: torch.Tensor, region_k: torch.Tensor, prefix_k: torch.Tensor,
            scale: float) -> None:
    """Probe the next T queries of the private prompt (local positions
    state.done .. state.done + T - 1). q [T, Hq, D]; region_k [Hkv, S, D]
    holds local position j at slot j for j < state.done + T (prefill slots
    are sequential); prefix_k [P, Hkv, D] (P may be 0)."""
    T = q.shape[0]
    first, end = state.done, state.done + T
    keys = region_k[:, :end].float()
    pk = prefix_k.float()
    a = first
    while a < end:  # CrystalCache chunks this extend touches
        cs = (a // state.chunk) * state.chunk
        ce = min(cs + state.chunk, state.n)
        b = min(end, ce)
        _probe_block(state, q[a - first:b - first].float(), a, cs, ce, keys, pk, scale)
        if b == ce:
            _finish_chunk(state, cs, ce)
        a = b
    state.done = end


def _probe_block(state, qb, a, cs, ce, keys, pk, scale) -> None:
    Q, Hq, _ = qb.shape
    Hkv = keys.shape[0]
    G = Hq // Hkv
    b = a + Q
    if state.col_sums is None:  # a new chunk
        state.col_sums = torch.zeros((Hq, ce - cs), dtype=torch.float32, device=qb.device)
        state.rows = torch.zeros((ce - cs, ce - cs), dtype=torch.float32, device=qb.device)
    causal = torch.arange(b, device=qb.device).unsqueeze(0) <= torch.arange(a, b, device=qb.device).unsqueeze(1)
    cross = torch.zeros((Q, cs), dtype=torch.float32, device=qb.device) if cs else None
    for h in range(Hq):  # one head at a time: [Q, b] probabilities
        qh = qb[:, h]
        logits = (qh @ keys[h // G, :b].T) * scale
        logits = logits.masked_fill(~causal, float("-inf"))
        lse = torch.logsumexp(logits, dim=-1)
        if pk.shape[0]:
            lse = torch.logaddexp(lse, torch.logsumexp((qh @ pk[:, h // G].T) * scale, dim=-1))
        p = torch.exp(logits - lse.unsqueeze(-1))  # masked keys: exp(-inf) = 0
        block = p[:, cs:b]
        state.col_sums[h, :b - cs] += block.sum(dim=0)
        state.rows[a - cs:b - cs, :b - cs] += block / Hq
        if cross is not None:
            cross += p[:, :cs] / Hq
    if cross is not None:
        k = min(K_CROSS, cs)
        weight, index = cross.topk(k, dim=1)
        state.cross_weight[a:b, :k] = weight
        state.cross_index[a:b, :k] = index


def _finish_chunk(state, cs, ce) -> None:
    heads = state.col_sums.shape[0]
    state.saliency[cs:ce] = state.col_sums.topk(min(TOP_HEADS, heads), dim=0).values.sum(dim=0)
    rows = state.rows / (state.rows.norm(dim=1, keepdim=True) + EPS)
    cos = rows @ rows.T
    cos.fill_diagonal_(float("-inf"))
    k = min(K_INTRA, ce - cs - 1)
    if k > 0:
        weight, index = cos.topk(k, dim=1)
        state.intra_weight[cs:ce, :k] = weight
        state.intra_index[cs:ce, :k] = index + cs
    state.col_sums = state.rows = None


def state_of(request_state, private: int, first: int, device) -> ProbeState:
    """The request's ProbeState, new at its prompt's first extend."""
    state = getattr(request_state, ATTRIBUTE, None)
    if state is None or state.done != first or state.n != private:
        state = ProbeState(private, device)
        setattr(request_state, ATTRIBUTE, state)
    return state


def collect(finished: list[tuple[object, list, int, int]]) -> list[PromptAttention]:
    """(request state, private token ids, base position, budget) of requests
    whose whole private prompt was probed: their summaries, on the device
    (nothing is read back: the policy's selection runs there too); the
    probe state is dropped."""
    probes = [getattr(s, ATTRIBUTE) for s, _, _, _ in finished]
    parts = [t.double().flatten() for p in probes
             for t in (p.saliency, p.intra_index, p.intra_weight, p.cross_index, p.cross_weight)]
    flat = torch.cat(parts)
    out, at = [], 0
    for (request_state, ids, base, budget), p in zip(finished, probes):
        n = p.n
        parts = []
        for size in (n, n * K_INTRA, n * K_INTRA, n * K_CROSS, n * K_CROSS):
            parts.append(flat[at:at + size])
            at += size
        saliency, ii, iw, ci, cw = parts
        out.append(PromptAttention(
            state=request_state, token_ids=list(ids), base=base, budget=budget, chunk=p.chunk, saliency=saliency,
            intra_index=ii.long().view(n, K_INTRA), intra_weight=iw.view(n, K_INTRA),
            cross_index=ci.long().view(n, K_CROSS), cross_weight=cw.view(n, K_CROSS)))
        setattr(request_state, ATTRIBUTE, None)
    return out
