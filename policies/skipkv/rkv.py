"""`rkv` (R-KV, the baseline of ThinKV, SkipKV and LongFlow): decode-time
eviction per (layer, kv_head) by lambda_mix * importance - (1 - lambda_mix) *
redundancy (policies.skipkv.rkv_scores), keeping the newest `window` tokens.

Trigger (decision, exposed as `buffer`): a request decides every `buffer`
decode steps (steps buffer-1, 2*buffer-1, ...), and then each head over its
budget evicts down to it; in between the heads grow by up to `buffer`
tokens, the slack its admission ceiling reserves. R-KV's code compresses
every 128 generated tokens (buffer 128). Default 16: the decision (key
redundancy, position pooling, top-k) costs the same whatever it evicts, so
deciding once per 16 steps makes it 16x cheaper per step for 16 slots of
slack per head (1.6% at budget 1024); buffer 1 decides every step. Between
decisions a row only folds the step's attention into its running mean
(observe_decode), and the engine runs the decision for the due rows only
(deciding_rows).

Scoring (`scoring`, per request): "fast" (default) scores importance by each
slot's running mean of attention and redundancy by the mean cosine to the
head's keys in O(S x D) (policies.skipkv.rkv_scores). "paper" scores as
R-KV's paper (policies.skipkv.rkv_paper): importance recomputed at each
decision from the attention of the row's last `window` (at most
QUERY_WINDOW = 8) queries of the layer, redundancy from the S x S cosine
matrix with the paper's newest-duplicate correction.

Where the queries are kept: the engine keeps each req_pool row's last 8
decode queries per layer and query head (Need.QUERIES, a ring written by
the attention pass: radix_ext/query_ring.py) and hands a deciding group its
rows' rings as SlotView.queries. The ring is rows x layers x 8 x q_heads x
head_dim elements of the model's dtype: 1.5 MiB per req_pool row for
R1-Distill-Qwen-7B in bf16 (about 3% of that row's KV at budget 1024), made
at the first step with a "paper" row. A policy asks for Need.QUERIES only
in steps where one of its rows scores as the paper (deciding_rows), so
"fast" traffic keeps no queries. Both scorings are tensor functions with
host-known shapes (graph_safe holds for both).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, field_validator

from ..base import Policy, PolicyParams
from ..cadence import ceiling_with_buffer, decides_at, due_heads
from ..observations import QUERY_WINDOW, Need, to_device
from ..registry import register_policy
from ..snapkv import odd_kernel, pool_by_position
from .rkv_paper import paper_scores, window_importance
from .rkv_scores import keep_recent_and_top, observe_attention, protected_recent, rkv_scores, start_window_mean


class RKVParams(PolicyParams):
    window: int = Field(default=8, ge=1, le=4096, description="recent tokens always kept; queries averaged")
    kernel: int = Field(default=7, ge=1, le=63, description="max-pooling width of the importance, by position")
    lambda_mix: float = Field(default=0.07, ge=0.0, le=1.0, description="weight of importance against redundancy")
    buffer: int = Field(default=16, ge=1, le=4096,
                        description="decode steps between decisions: a head evicts down to its budget every "
                                    "`buffer` steps, holding up to budget + buffer tokens")
    scoring: Literal["fast", "paper"] = Field(
        default="fast", description="fast: running-mean importance and O(S*D) key redundancy; paper: R-KV's "
                                    "paper (attention of the last `window` queries, S x S redundancy)")

    _odd_kernel = field_validator("kernel")(odd_kernel)

    @field_validator("scoring")
    @classmethod
    def _paper_window_fits_the_ring(cls, value, info):
        window = info.data.get("window")
        if value == "paper" and window is not None and window > QUERY_WINDOW:
            raise ValueError(f"'paper' scores with the last {QUERY_WINDOW} queries the engine keeps: "
                             f"window must be at most {QUERY_WINDOW}")
        return value


class RKVBase(Policy):
    """R-KV scoring shared with skipkv: the running window of attention in
    SlotView.score / last_hit, keys for the redundancy."""

    Params = RKVParams
    needs = Need.ATTENTION | Need.KEYS
    keeps_slot_state = True
    pads_decisions = True  # select_decode = observe_decode + an eviction masked by due_heads
    decides_layers_apart = True  # the query ring is read per layer by the engine; the rest is per row

    def _group_size(self) -> int:
        """Query heads per kv head: attention arrives summed over the group;
        R-KV averages it, which keeps it on the redundancy's scale."""
        if self.model is None or not self.model.num_kv_heads:
            return 1
        return max(1, self.model.num_q_heads // self.model.num_kv_heads)

    @classmethod
    def batch_params(cls, rows, device="cpu"):
        # `paper` [R] (1: the row scores as the paper) and its host maximum,
        # so that a group with no such row never computes the paper's scores.
        params, maxima = super().batch_params(rows, device)
        paper = [int(row.scoring == "paper") for row in rows]
        params["paper"] = to_device(paper, torch.int64, device)
        maxima["paper"] = max(paper)
        return params, maxima

    def _scores(self, batch, view) -> torch.Tensor:
        fast = rkv_scores(view, view.score, batch.param("lambda_mix"), batch.param("kernel"),
                          batch.max_param("kernel"))
        if not batch.maxima.get("paper"):
            return fast
        paper = batch.param("paper").bool().view(-1, 1, 1)
        return torch.where(paper, self._paper_scores(batch, view), fast)

    def _paper_scores(self, batch, view) -> torch.Tensor:
        """R-KV's paper scores (rkv_paper.py). Without the rows' queries (a
        prefill cut, or an engine that kept none) the importance is the
        running mean's, pooled as in "fast"; the redundancy is the paper's."""
        candidates = view.valid & ~protected_recent(view, batch.budget, batch.param("window"))[0]
        kernel, max_kernel = batch.param("kernel"), batch.max_param("kernel")
        if view.queries is None:
            importance = pool_by_position(view.score, view, kernel, max_kernel)
        else:
            importance = window_importance(view, candidates, batch.step, batch.param("window"), kernel, max_kernel)
        return paper_scores(view, candidates, importance, batch.param("lambda_mix"))

    def observe_decode(self, batch, view, obs) -> None:
        observe_attention(view, obs.attention / self._group_size(), batch.param("window"))

    def deciding_rows(self, rows):
        self._ask_for_queries(rows)
        return [decides_at(row.step, row.state.params.buffer) for row in rows]

    def _ask_for_queries(self, rows) -> None:
        """Need.QUERIES in a decode step where one of the rows scores as the
        paper: the engine then keeps the step's queries (radix_ext/
        query_ring.py); in other steps nothing is kept. Here, not in
        begin_request: this is the host hook every RKVBase policy runs each
        decode step before the engine reads `needs` (skipkv has its own
        begin_request and step_inputs)."""
        paper = any(row.state.params.scoring == "paper" for row in rows)
        self.needs = type(self).needs | Need.QUERIES if paper else type(self).needs

    def _start_prefill(self, batch, view, obs) -> None:
        # The prompt's last min(window, prompt length) queries were observed.
        newest = torch.where(view.valid, view.position, torch.full_like(view.position, -1)).amax(dim=(1, 2))
        queries = torch.minimum(batch.param("window"), newest + 1)
        start_window_mean(view, obs.attention / self._group_size(), queries)

    def max_private_tokens(self, params, private_prompt, max_new_tokens, budget):
        return ceiling_with_buffer(private_prompt, max_new_tokens, budget, params.buffer)


@register_policy
class RKVPolicy(RKVBase):
    name = "rkv"
    graph_safe = True  # tests_gpu/test_region_pass_cuda.py: replay equals the eager pass, no host sync
    description = "R-KV: attention of the recent queries minus key redundancy; keeps the recent window."

    def select_prefill(self, batch, view, obs):
        self._start_prefill(batch, view, obs)
        keep = keep_recent_and_top(view, self._scores(batch, view), batch.budget, batch.param("window"))
        return view.valid & ~keep

    def select_decode(self, batch, view, obs):
        self.observe_decode(batch, view, obs)
        keep = keep_recent_and_top(view, self._scores(batch, view), batch.budget, batch.param("window"))
        due = due_heads(view, batch.budget, batch.step, batch.param("buffer"))
        return view.valid & ~keep & due.unsqueeze(-1)
