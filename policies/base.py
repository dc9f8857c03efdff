"""What every compression policy is: a name, a parameter model, lifecycle hooks.

One small class per policy (in the spirit of kvpress's presses), one instance
per request. A policy sees only tensors (policies.observations) and returns
decisions: which slots of a layer to evict. It never touches SGLang objects;
radix_ext applies its decisions to the compressed region.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch
from pydantic import BaseModel, ConfigDict

from .observations import LayerObservations, LayerView, Need


class PolicyParams(BaseModel):
    """Base of every policy's parameter model: unknown fields are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Policy:
    """Base class of a compression policy.

    Subclasses set `name`, `Params` (a PolicyParams subclass with defaults and
    bounds), `needs` (the observations their hooks read) and override the
    hooks they use. `compresses` is False only for `full`, which keeps
    SGLang's own KV path untouched.

    Hooks return an eviction mask [H, S] (True: clear that slot) or None. The
    region calls on_decode_step after the step's new token is stored and has
    taken part in attention, so the new token is scored in its own step.
    """

    name: ClassVar[str]
    Params: ClassVar[type[PolicyParams]] = PolicyParams
    compresses: ClassVar[bool] = True
    takes_budget: ClassVar[bool] = True
    needs: ClassVar[Need] = Need.NONE
    #: Whether the hooks update LayerView.score / last_hit (saved back to the
    #: region after each step only then: it is a write per layer per step).
    keeps_slot_state: ClassVar[bool] = False
    description: ClassVar[str] = ""

    def __init__(self, params: Optional[PolicyParams] = None):
        self.params = params if params is not None else self.Params()

    def on_request_begin(self, num_layers: int, num_kv_heads: int) -> None:
        """A request starts; per-request state goes on `self`."""

    def on_prefill_end(
        self, layer: int, view: LayerView, obs: LayerObservations, budget: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """The private prompt of `layer` is stored; may select what to keep."""
        return None

    def on_decode_step(
        self, step: int, layer: int, view: LayerView, obs: LayerObservations, budget: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """One decode step of `layer` is done; `budget` is [H] tokens per head."""
        return None

    def on_tokens(
        self, positions: torch.Tensor, token_ids: torch.Tensor, hidden_states: Optional[torch.Tensor]
    ) -> None:
        """Called once per forward pass, after the last layer, for policies
        that need TOKEN_IDS or HIDDEN_STATES: the private tokens the request
        just processed (a prompt chunk, or the one decode token) with their
        positions [T], ids [T] and, with HIDDEN_STATES, the last layer's
        hidden states after the final norm [T, hidden]. Decisions come in the
        other hooks, from the state a policy keeps here."""

    def on_request_end(self) -> None:
        """The request ended (finished, aborted or failed)."""

    # ----- admission ---------------------------------------------------------
    def max_private_tokens(self, private_prompt: int, max_new_tokens: int, budget: int) -> int:
        """Most private tokens one (layer, kv_head) can hold at once: the
        request's compressed ceiling, which admission reserves in the region.

        The default fits a policy that evicts down to `budget` at prefill end
        and after every decode step: the whole private prompt is held until
        prefill ends, and a decode step stores its token before evicting."""
        return min(private_prompt + max_new_tokens, max(private_prompt, budget + 1))
