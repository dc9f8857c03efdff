"""A policy that fails on request: H2O's algorithm, plus parameters that
make its code raise at a chosen stage, so a test can check that a fault in
one policy's code ends that policy's requests and nothing else
(radix_ext/faults.py). Loaded with `kvsieve serve --policy-module
faulty_policy`."""

from __future__ import annotations

from typing import Literal

import torch

from kvsieve.policies import Need, PolicyParams, register_policy
from kvsieve.policies.h2o import H2OPolicy


class FaultyParams(PolicyParams):
    #: Where its code raises: at admission, while the step is built, in the
    #: prompt selection, in a decode decision, or when handed token ids.
    fail_in: Literal["none", "admit", "step_inputs", "prefill", "decide", "tokens"] = "none"
    #: The decode step from which `step_inputs` and `decide` raise.
    fail_after: int = 0
    #: Decisions over more rows than this raise torch.OutOfMemoryError (0: never).
    oom_above: int = 0
    #: From this decode token on (-1: never), the request's last-layer hidden
    #: states are overwritten with NaN, so its logits are NaN: what a
    #: corrupted region gives (radix_ext/logit_guard.py).
    poison_at: int = -1


@register_policy
class FaultyPolicy(H2OPolicy):
    name = "test_faulty"
    Params = FaultyParams
    needs = Need.ATTENTION | Need.TOKEN_IDS | Need.HIDDEN_STATES
    graph_safe = False
    description = "Test policy: H2O that raises where its parameters say."

    def __init__(self):
        super().__init__()
        self.armed: set = set()  # stages whose code raises in this step
        self.oom_above = 0

    def begin_request(self, params, num_layers, num_kv_heads):
        if params.fail_in == "admit":
            raise RuntimeError("test_faulty raised in begin_request")
        return super().begin_request(params, num_layers, num_kv_heads)

    def step_inputs(self, rows, device):
        self.armed, self.oom_above = set(), 0
        for row in rows:
            p = row.state.params
            self.oom_above = max(self.oom_above, p.oom_above)
            if p.fail_in != "none" and (row.prefill or row.step >= p.fail_after):
                self.armed.add(p.fail_in)
        if "step_inputs" in self.armed:
            raise RuntimeError("test_faulty raised in step_inputs")
        return {}

    def _check(self, batch, stage):
        if stage in self.armed:
            raise RuntimeError(f"test_faulty raised in {stage}")
        rows = batch.step.shape[0]
        if self.oom_above and rows > self.oom_above:
            raise torch.OutOfMemoryError(f"test_faulty: {rows} rows do not fit (at most {self.oom_above})")

    def select_prefill(self, batch, view, obs):
        self._check(batch, "prefill")
        return super().select_prefill(batch, view, obs)

    def select_decode(self, batch, view, obs):
        self._check(batch, "decide")
        return super().select_decode(batch, view, obs)

    def on_tokens(self, state, positions, token_ids, hidden_states):
        if state.params.fail_in == "tokens":
            raise RuntimeError("test_faulty raised in on_tokens")
        if state.params.poison_at >= 0 and positions.numel() == 1:  # a decode token
            state.decode_tokens = getattr(state, "decode_tokens", 0) + 1
            if state.decode_tokens > state.params.poison_at:
                hidden_states.fill_(float("nan"))  # a view of the forward's own hidden states
