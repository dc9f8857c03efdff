"""A policy that evicts nothing and writes what on_tokens receives to a JSON
lines file: loaded into a server with --policy-module, it lets a test check
the token ids and last-layer hidden states the engine hands to policies."""

from __future__ import annotations

import json

from kvsieve.policies import Need, Policy, PolicyParams, register_policy


class RecordingParams(PolicyParams):
    out: str  # file to append one line per token to


@register_policy
class RecordingPolicy(Policy):
    name = "test_recording"
    Params = RecordingParams
    needs = Need.TOKEN_IDS | Need.HIDDEN_STATES
    description = "Test policy: records token ids and hidden states; evicts nothing."

    def on_tokens(self, state, positions, token_ids, hidden_states):
        with open(state.params.out, "a") as f:
            for pos, tok, hidden in zip(positions.tolist(), token_ids.tolist(), hidden_states.float().tolist()):
                f.write(json.dumps({"position": pos, "token": tok, "hidden": hidden}) + "\n")
