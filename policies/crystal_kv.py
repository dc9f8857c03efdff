"""`crystal_kv` (Crystal-KV, crystal-kv.txt §5, Algorithm 1): attention-based
LRFU per (layer, kv head) during the think stage.

Each step, the slots whose attention probabilities (summed over the kv
head's query group, normalized over the head's private slots: our decision,
the prefix in the radix cache is never evicted) reach `top_p` when taken in
descending order are hits: CRF <- decay^(t - tau) * CRF + 1 and tau <- t.
Misses keep their stored CRF; their decayed value is used for ranking only
(lazy decay). When a head holds more than its budget, it keeps the top
`budget` slots by decayed CRF and never evicts the newest token. A new
token enters with CRF 0 and tau = its step and takes part in its own step's
hit test. Once the model writes the end-of-think marker (`think_end`),
eviction stops: the answer attends to what was retained (a head may then
grow by `answer_tokens`, the room admission reserves for it, before the LRFU
evicts again).

Not served yet: the adaptive layer/head budgets of Algorithm 2 (moving
pages between heads); `adaptive: true` is refused with a 400 naming the
field, so every request runs Crystal-KV Lite.
"""

from __future__ import annotations

import torch
from pydantic import Field, field_validator

from .base import Policy, PolicyParams, RequestState
from .observations import Need, keep_top_k, rank_by_position, to_device
from .registry import register_policy


class CrystalKVParams(PolicyParams):
    decay: float = Field(default=0.6, gt=0.0, lt=1.0, description="lambda of the LRFU (0: LRU, 1: LFU)")
    top_p: float = Field(default=0.9, gt=0.0, le=1.0, description="probability mass of a step's hits")
    evict_interval: int = Field(default=1, ge=1, le=1024, description="evict down to the budget every N steps")
    think_end: str = Field(default="</think>", max_length=64,
                           description="end-of-think marker: eviction stops after it ('' = never stops)")
    answer_tokens: int = Field(default=512, ge=0, le=1 << 20,
                               description="tokens a head may add after the marker before eviction resumes")
    adaptive: bool = Field(default=False, description="adaptive layer/head budgets (Algorithm 2); not served yet")

    @field_validator("adaptive")
    @classmethod
    def _lite_only(cls, adaptive: bool) -> bool:
        if adaptive:
            raise ValueError("adaptive layer/head budgets are not served yet; use false (Crystal-KV Lite)")
        return adaptive


class CrystalKVState(RequestState):
    def __init__(self, params, num_layers, num_kv_heads, marker: tuple):
        super().__init__(params, num_layers, num_kv_heads)
        self.marker = marker  # token ids of think_end
        self.recent: list[int] = []  # the last len(marker) generated ids
        self.thinking = True


def hits_of(attention: torch.Tensor, valid: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per (row, head), the smallest set of valid slots whose normalized
    attention, taken in descending order, sums to at least top_p ([R])."""
    mass = torch.where(valid, attention, torch.zeros((), dtype=attention.dtype, device=attention.device))
    share = mass / mass.sum(dim=-1, keepdim=True).clamp(min=1e-30)
    ordered, order = share.sort(dim=-1, descending=True, stable=True)
    before = ordered.cumsum(dim=-1) - ordered  # mass of the slots ranked above
    chosen = (before < top_p.view(-1, 1, 1)) & (ordered > 0)
    hits = torch.zeros_like(valid)
    hits.scatter_(-1, order, chosen)
    return hits & valid


@register_policy
class CrystalKVPolicy(Policy):
    name = "crystal_kv"
    Params = CrystalKVParams
    needs = Need.ATTENTION | Need.TOKEN_IDS
    keeps_slot_state = True
    graph_safe = False  # not yet checked on a GPU (bench/graph_probe.py)
    description = "Attention-based LRFU per (layer, kv head) during thinking; stops at the end-of-think marker."

    def begin_request(self, params, num_layers, num_kv_heads):
        encode = self.model.encode if self.model is not None else None
        marker = tuple(encode(params.think_end)) if (params.think_end and encode is not None) else ()
        return CrystalKVState(params, num_layers, num_kv_heads, marker)

    def on_tokens(self, state, positions, token_ids, hidden_states):
        if not state.marker or not state.thinking:
            return
        state.recent = (state.recent + token_ids.tolist())[-len(state.marker):]
        if tuple(state.recent) == state.marker:
            state.thinking = False

    def step_inputs(self, rows, device):
        return {"thinking": to_device([row.state.thinking for row in rows], torch.bool, device)}

    def max_private_tokens(self, params, private_prompt, max_new_tokens, budget):
        # A head may overflow by evict_interval - 1 tokens before evicting,
        # stores each step's token before the decision, and after the
        # end-of-think marker grows by up to answer_tokens.
        answer = params.answer_tokens if params.think_end else 0
        return min(private_prompt + max_new_tokens, max(private_prompt, budget + params.evict_interval + answer))

    def select_prefill(self, batch, view, obs):
        # A kept prompt starts with CRF 0; a prompt longer than the budget is
        # cut to the slots its last queries attended most (newest kept).
        view.score.zero_()
        view.last_hit.zero_()
        newest = view.valid & (rank_by_position(view, newest_first=True) < 1)
        keep = newest | keep_top_k(obs.attention, view.valid & ~newest, batch.budget - 1)
        return view.valid & ~keep

    def select_decode(self, batch, view, obs):
        t = batch.step.view(-1, 1, 1).to(torch.int32)
        newest = view.valid & (rank_by_position(view, newest_first=True) < 1)
        # The new token enters with CRF 0 and tau = t.
        view.score.masked_fill_(newest, 0.0)
        view.last_hit.copy_(torch.where(newest, t, view.last_hit))
        decay = batch.param("decay").view(-1, 1, 1)
        decayed = view.score * decay.pow((t - view.last_hit).clamp(min=0).float())
        hits = hits_of(obs.attention, view.valid, batch.param("top_p"))
        view.score.copy_(torch.where(hits, decayed + 1.0, view.score))
        view.last_hit.copy_(torch.where(hits, t, view.last_hit))
        ranking = torch.where(hits, decayed + 1.0, decayed)
        held = view.valid.sum(dim=-1)  # [R, H]
        interval = batch.param("evict_interval").view(-1, 1)
        due = (batch.step.view(-1, 1) % interval == 0) | (held > batch.budget + interval - 1)
        thinking = batch.inputs["thinking"].view(-1, 1) if "thinking" in batch.inputs else True
        # After the marker the head keeps what it has, up to answer_tokens more (the admission ceiling).
        answer_full = held > batch.budget + batch.param("answer_tokens").view(-1, 1)
        evicting = (held > batch.budget) & due & (thinking | answer_full)  # [R, H]
        keep = newest | keep_top_k(ranking, view.valid & ~newest, batch.budget - 1)
        return view.valid & ~keep & evicting.unsqueeze(-1)
