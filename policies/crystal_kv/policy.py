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
eviction stops (a step later than a blocking read would see it: the ids
reach the host without making it wait for the GPU, policies/host_reads.py):
the answer attends to what was retained (a head may then grow by
`answer_tokens`, the room admission reserves for it, before the LRFU
evicts again).

Cadence (decision, `evict_interval`, default 16): the LRFU bookkeeping
(hits, CRF, tau) runs every step for every row (observe_decode); the
eviction (rank by decayed CRF, keep the top `budget`) every 16 steps while
thinking, so a head holds up to budget + 15 tokens between. The engine
runs the eviction for the rows due only (deciding_rows): rows on their
cadence step, every row past the end-of-think marker, and adaptive rows
(their budgets may change in any step). evict_interval 1 evicts every step
as Algorithm 1 does.

Adaptive budgets (Algorithm 2, `adaptive: true`; false = Crystal-KV Lite):
select_decode writes each head's sum of decayed CRF over its kept slots to
a device buffer (per req_pool row, layer, head); every `realloc_interval`
decode steps while thinking, the engine (radix_ext/head_pages.py) asks
`realloc_head_budgets`, which reads that row back (the only sync, between
steps) and runs budgets.reallocate_budgets; the engine caps the
new budgets to the pages each head can be given, this step's decision
evicts down to them, and the pages move between heads at the next step.
With a budget_ratio the total of each reallocation is the ratio's budget at
that step (the heads keep their budgets until the next one); with
`answer_tokens: null` every head's pages hold its whole generation, so the
budgets change without moving pages.

Endpoints of `decay` (lambda, [0, 1], §5.2): 1 is LFU (1^(t - tau) = 1: the
CRF counts hits); 0 is LRU, where every slot not hit in this step has CRF 0,
so the ranking is the step of the last hit (tau) instead, slots never hit
last (as the CRF ranks them for any lambda).
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch
from pydantic import Field

from ..base import Policy, PolicyParams, RequestState
from ..host_reads import HostCopy
from .budgets import reallocate_budgets
from ..observations import Need, keep_top_k, newest_mask, rank_by_position, to_device
from ..registry import register_policy


#: answer_tokens None: a head never evicts after the end-of-think marker
#: (the decisions see this room, far above any head's tokens).
NEVER_AFTER_MARKER = 1 << 40


class CrystalKVParams(PolicyParams):
    decay: float = Field(default=0.6, ge=0.0, le=1.0,
                         description="lambda of the LRFU: 0 is LRU (ranks by last hit), 1 is LFU (counts hits); "
                                     "the paper recommends 0.5-0.7 (§6.4)")
    top_p: float = Field(default=0.9, gt=0.0, le=1.0, description="probability mass of a step's hits")
    evict_interval: int = Field(default=16, ge=1, le=1024,
                                description="evict down to the budget every N steps (a head holds up to "
                                            "budget + N - 1 between)")
    think_end: str = Field(default="</think>", max_length=64,
                           description="end-of-think marker: eviction stops after it ('' = never stops)")
    answer_tokens: Optional[int] = Field(default=512, ge=0, le=1 << 20,
                                         description="tokens a head may add after the marker before eviction "
                                                     "resumes; null: never evicts after the marker (admission "
                                                     "then reserves the whole generation)")
    adaptive: bool = Field(default=False, description="adaptive layer/head budgets (Algorithm 2); false = Lite. "
                                                      "With budget_ratio each reallocation shares the ratio's "
                                                      "budget at that step")
    realloc_interval: int = Field(default=128, ge=1, le=1 << 20, description="decode steps between reallocations")
    min_head_budget: int = Field(default=16, ge=1, le=1 << 20, description="floor of a head's adaptive budget")


class CrystalKVState(RequestState):
    def __init__(self, params, num_layers, num_kv_heads, marker: tuple):
        super().__init__(params, num_layers, num_kv_heads)
        self.marker = marker  # token ids of think_end
        self.recent: list[int] = []  # the last len(marker) ids seen (host)
        self.forwards = 0  # forwards that handed this request's tokens over (on_forward_tokens)
        #: (forward, HostCopy, offset, count): ids on their way to the host, oldest first
        self.watch: deque = deque()
        self.thinking = True
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.head_budgets = None  # [L, H] int64 once adaptive budgets were set
        self.pending_head_pages = None  # page targets the engine applies at the next step
        self.realloc_now = False  # this step's decision must evict down to new budgets


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
    graph_safe = True  # tests_gpu/test_region_pass_cuda.py: replay equals the eager pass, no host sync
    decides_layers_apart = True  # its per-(row, layer) CRF sums are written at batch.row_layers()
    # select_decode = the LRFU step of observe_decode + an eviction masked by
    # the cadence (the overflow guard cannot fire between two cadence steps).
    pads_decisions = True
    description = ("Attention-based LRFU per (layer, kv head) during thinking; stops at the end-of-think marker; "
                   "adaptive: per-head budgets from the heads' CRF (Algorithm 2), pages moved between heads.")

    def begin_request(self, params, num_layers, num_kv_heads):
        encode = self.model.encode if self.model is not None else None
        marker = tuple(encode(params.think_end)) if (params.think_end and encode is not None) else ()
        return CrystalKVState(params, num_layers, num_kv_heads, marker)

    def observes_tokens(self, state):
        # Only to watch for the end-of-think marker: a request without one
        # (think_end "", or no tokenizer) costs no per-request call per forward.
        return bool(state.marker)

    def on_tokens(self, state, positions, token_ids, hidden_states):
        self.on_forward_tokens([(state, 0, token_ids.shape[0])], positions, token_ids, hidden_states)

    def on_forward_tokens(self, requests, positions, token_ids, hidden_states):
        # Inside the forward (the logits hook), for every watching request at
        # once: their last len(marker) ids of this forward gathered in one
        # index and copied to the host without waiting (host_reads.py). A
        # clone and a .tolist() per request and step were a GPU wait per row.
        index, watched = [], []
        for state, start, n in requests:
            if state.marker and state.thinking:
                m = min(n, len(state.marker))
                index.extend(range(start + n - m, start + n))
                watched.append((state, m))
        if watched:
            copy = HostCopy(token_ids[to_device(index, torch.int64, token_ids.device)])
            at = 0
            for state, m in watched:
                state.watch.append((state.forwards, copy, at, m))
                at += m
        for state, _, _ in requests:
            state.forwards += 1

    @staticmethod
    def _watch_marker(state) -> None:
        """Match the ids of every forward of the request but its newest (on
        a GPU that one may still run: SGLang's overlap scheduler launches a
        step before the last one ends) against the end-of-think marker. So
        eviction stops one step after the marker, on every device."""
        while state.watch and state.watch[0][0] < state.forwards - 1:
            _, copy, at, m = state.watch.popleft()
            state.recent = (state.recent + copy.values()[at:at + m])[-len(state.marker):]
            if tuple(state.recent) == state.marker:
                state.thinking = False
                state.watch.clear()

    def step_inputs(self, rows, device):
        for row in rows:
            if row.state.watch:
                self._watch_marker(row.state)
        inputs = {"thinking": to_device([row.state.thinking for row in rows], torch.bool, device)}
        if any(row.state.head_budgets is not None for row in rows):
            L, H = rows[0].state.num_layers, rows[0].state.num_kv_heads
            budgets = torch.stack([row.state.head_budgets if row.state.head_budgets is not None
                                   else torch.full((L, H), row.budget, dtype=torch.int64) for row in rows])
            inputs["budget"] = to_device(budgets, torch.int64, device)
            inputs["realloc"] = to_device([row.state.realloc_now for row in rows], torch.bool, device)
            for row in rows:
                row.state.realloc_now = False
        return inputs

    @classmethod
    def batch_params(cls, rows, device="cpu"):
        # answer_tokens may be None (never evict after the marker): the
        # decisions read it as a room no head reaches.
        params, maxima = super().batch_params(rows, device)
        room = [NEVER_AFTER_MARKER if row.answer_tokens is None else row.answer_tokens for row in rows]
        params["answer_tokens"] = to_device(room, torch.int64, device)
        maxima["answer_tokens"] = max(room)
        return params, maxima

    # ----- adaptive budgets (called by radix_ext/head_pages.py between steps) ----
    def realloc_head_budgets(self, state, step, pool_row, budget):
        """New [L, H] budgets every realloc_interval decode steps while
        thinking, or None. The total is `budget` per head: fixed, or with
        a budget_ratio the ratio's budget at this step (the heads then keep
        those budgets until the next reallocation)."""
        p = state.params
        if not p.adaptive or not state.thinking or step <= 0 or step % p.realloc_interval:
            return None
        sums = getattr(self, "_crf_sums", None)
        if sums is None:
            return None
        crf = sums[pool_row].cpu()  # the one read-back, between steps
        current = state.head_budgets
        if current is None:
            current = torch.full((state.num_layers, state.num_kv_heads), budget, dtype=torch.int64)
        wanted = reallocate_budgets(crf, current, p.min_head_budget, total=budget * current.numel())
        if p.think_end and p.answer_tokens is None:
            # Never evicting after the marker, every head's pages already
            # hold its whole generation (max_private_tokens): any budget
            # fits without moving pages, and moving them could leave a
            # head short once the answer grows it.
            self.accept_head_budgets(state, wanted)
            return None
        return wanted

    def head_room(self, params):
        """Slots a head holds past its budget (the admission ceiling's room)."""
        answer = params.answer_tokens if params.think_end and params.answer_tokens is not None else 0
        return params.evict_interval + answer

    def accept_head_budgets(self, state, budgets):
        state.head_budgets = budgets
        state.realloc_now = True

    def max_private_tokens(self, params, private_prompt, max_new_tokens, budget):
        # A head may overflow by evict_interval - 1 tokens before evicting,
        # stores each step's token before the decision, and after the
        # end-of-think marker grows by up to answer_tokens (all of the
        # generation when it never evicts after the marker).
        answer = 0
        if params.think_end:
            answer = max_new_tokens if params.answer_tokens is None else params.answer_tokens
        return min(private_prompt + max_new_tokens, max(private_prompt, budget + params.evict_interval + answer))

    def select_prefill(self, batch, view, obs):
        # A kept prompt starts with CRF 0; a prompt longer than the budget is
        # cut to the slots its last queries attended most (newest kept).
        view.score.zero_()
        view.last_hit.zero_()
        newest = view.valid & (rank_by_position(view, newest_first=True) < 1)
        keep = newest | keep_top_k(obs.attention, view.valid & ~newest, batch.budget - 1)
        return view.valid & ~keep

    def deciding_rows(self, rows):
        # A superset of the rows select_decode may evict in: on their cadence
        # step, past the marker (the answer's room is checked every step),
        # and adaptive rows (a reallocation may cut a head in any step).
        return [row.step % row.state.params.evict_interval == 0 or not row.state.thinking
                or row.state.params.adaptive for row in rows]

    def _lrfu_step(self, batch, view, obs):
        """Algorithm 1's bookkeeping of one step: the new token enters with
        CRF 0 and tau = t; the step's hits take CRF <- decayed CRF + 1 and
        tau <- t. Returns the newest slots, every slot's decayed CRF at t
        and the eviction's ranking: the decayed CRF, except with decay 0
        (LRU), where every slot not hit now has CRF 0: there the ranking is
        the step of the last hit (tau), a slot never hit ranking below all
        (its CRF is 0 whatever lambda), which is where the ranking tends as
        lambda -> 0 while the last hits differ. Decay 1 (LFU) needs no
        special case: 1^(t - tau) is 1, the CRF counts hits."""
        t = batch.step.view(-1, 1, 1).to(torch.int32)
        newest = newest_mask(view.valid, view.position, torch.ones_like(batch.step).view(-1, 1), 1)
        view.score.masked_fill_(newest, 0.0)
        view.last_hit.copy_(torch.where(newest, t, view.last_hit))
        decay = batch.param("decay").view(-1, 1, 1)
        decayed = view.score * decay.pow((t - view.last_hit).clamp(min=0).float())
        hits = hits_of(obs.attention, view.valid, batch.param("top_p"))
        view.score.copy_(torch.where(hits, decayed + 1.0, view.score))
        view.last_hit.copy_(torch.where(hits, t, view.last_hit))
        crf = torch.where(hits, decayed + 1.0, decayed)
        # A stored CRF is >= 1 once hit (lazy decay), 0 for a slot never hit.
        last_hit = torch.where(view.score > 0, view.last_hit.float(), torch.full_like(crf, -1.0))
        ranking = torch.where(decay == 0, last_hit, crf)
        return newest, crf, ranking

    def observe_decode(self, batch, view, obs):
        self._lrfu_step(batch, view, obs)

    def select_decode(self, batch, view, obs):
        newest, crf, ranking = self._lrfu_step(batch, view, obs)
        held = view.valid.sum(dim=-1)  # [R, H]
        interval = batch.param("evict_interval").view(-1, 1)
        due = (batch.step.view(-1, 1) % interval == 0) | (held > batch.budget + interval - 1)
        if "realloc" in batch.inputs:  # new budgets: evict down to them before the pages move
            due = due | batch.inputs["realloc"].view(-1, 1)
        thinking = batch.inputs["thinking"].view(-1, 1) if "thinking" in batch.inputs else True
        # After the marker the head keeps what it has, up to answer_tokens more (the admission ceiling).
        answer_full = held > batch.budget + batch.param("answer_tokens").view(-1, 1)
        evicting = (held > batch.budget) & due & (thinking | answer_full)  # [R, H]
        keep = newest | keep_top_k(ranking, view.valid & ~newest, batch.budget - 1)
        evict = view.valid & ~keep & evicting.unsqueeze(-1)
        self._record_crf_sums(batch, view.valid.shape[1],
                              torch.where(view.valid & ~evict, crf, torch.zeros_like(crf)).sum(dim=-1))
        return evict

    def _record_crf_sums(self, batch, heads, sums):
        """Each head's decayed CRF over its kept slots, per req_pool row and
        layer: what Algorithm 2 reads back (no sync: an indexed write)."""
        if batch.pool_rows is None or self.model is None:
            return
        buffer = getattr(self, "_crf_sums", None)
        if buffer is None or buffer.shape[0] < batch.max_rows or buffer.device != sums.device:
            buffer = self._crf_sums = torch.zeros(max(batch.max_rows, 1), self.model.num_layers, heads,
                                                  dtype=torch.float32, device=sums.device)
        buffer[batch.pool_rows, batch.row_layers()] = sums.float()
