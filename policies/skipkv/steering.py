"""SkipKV's adaptive steering (skipkv-slides.txt, "Skip KV Generation"): at
each newline token a steered request's hidden state at one layer is nudged
toward execution, h <- h + α·s, and α grows while the request keeps
re-validating.

- s: the calibrated vector of the layer (policies.skipkv.steering_vectors),
  mean hidden state of execution sentences minus that of the others.
- α = min(alpha + alpha_step · r, alpha_max), r = the request's
  re-validations so far: finished sentences with a cue token (CUE_WORDS),
  plus the open sentence if it has one, plus the sentences skipkv found
  redundant (a later sentence repeats them, cos > tau) at its last read-back.
  SkipKV's public code grows its coefficient by a fixed step per "check"
  sentence with no cap; the cap is ours **(decision)**.

Everything per token runs on the device: the sentence book
(policies.skipkv.book) counts cue sentences as it folds tokens, step_inputs
turns the counts into α per req_pool row (`SteeringTable.alpha`), and the
engine's forward hook on a decoder layer (radix_ext/steering_hooks.py) adds
α·s to the rows whose input token is a newline with one masked add: no
per-row Python and no host sync in the forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from ..observations import to_device

#: Words whose token marks a re-validating sentence **(decision: the reflection
#: and transition cues of SEAL and SkipKV's code, "Wait", "Alternatively",
#: "again", plus verification words)**. A token counts when it is the single
#: token of one of them, lower-case or capitalised, with or without a leading
#: space (" Wait", "wait", " Check", ...); words the tokenizer splits are not
#: counted.
CUE_WORDS = frozenset({"wait", "alternatively", "again", "verify", "check", "recheck", "double", "confirm",
                       "hmm", "re-check", "re-examine", "reconsider"})

DEFAULT_ALPHA = 1.25  # SkipKV's public code: coefficient 1.25 on R1-Distill-Qwen-7B / Llama-8B
DEFAULT_ALPHA_STEP = 0.02  # SkipKV's public code: +0.02 per "check" sentence
DEFAULT_ALPHA_MAX = 2.0  # ours: the public code has no cap


def alpha_schedule(alpha, alpha_step, alpha_max, revalidations):
    """α after `revalidations` re-validations: grows by alpha_step each, capped
    at alpha_max (floats or tensors, elementwise)."""
    if isinstance(revalidations, torch.Tensor):
        grown = alpha + alpha_step * revalidations.to(torch.float32)
        return torch.minimum(grown, alpha_max if isinstance(alpha_max, torch.Tensor) else torch.tensor(
            float(alpha_max), device=grown.device))
    return min(alpha + alpha_step * revalidations, alpha_max)


def token_table(ids: Iterable[int], device, size: Optional[int] = None) -> Optional[torch.Tensor]:
    """[max id + 1] (or [size]) bool on device, True at `ids` (None: no ids)."""
    ids = sorted(int(i) for i in ids)
    if not ids:
        return None
    table = torch.zeros(max(size or 0, ids[-1] + 1), dtype=torch.bool)
    table[ids] = True
    return table.to(device)


def lookup(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table[ids] with ids outside the table (or negative) False."""
    V = table.shape[0]
    return table[ids.clamp(0, V - 1)] & (ids >= 0) & (ids < V)


class SteeringTable:
    """Per req_pool row, on the device: the α of the row's next newline (0:
    not steered), its layer (-1: none), and what the forward did (newline
    tokens steered, largest α applied). One per process, made by the first
    steered request; `vectors` [num_layers, hidden] in the model's dtype."""

    def __init__(self, rows: int, vectors: torch.Tensor, newline: torch.Tensor):
        device = vectors.device
        self.vectors = vectors
        self.newline = newline  # [V] bool
        self.alpha = torch.zeros(rows, dtype=torch.float32, device=device)
        self.layer = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.steered = torch.zeros(rows, dtype=torch.int64, device=device)
        self.peak = torch.zeros(rows, dtype=torch.float32, device=device)
        #: Host: live steered requests per layer (the hooks of other layers return at once).
        self.live: dict[int, int] = {}

    def begin(self, row: int, layer: int, alpha: float) -> None:
        index = to_device([row], torch.int64, self.alpha.device)
        self.alpha.index_fill_(0, index, alpha)  # (index_fill_: a scalar through an index tensor would sync)
        self.layer.index_fill_(0, index, layer)
        self.steered.index_fill_(0, index, 0)
        self.peak.index_fill_(0, index, 0.0)
        self.live[layer] = self.live.get(layer, 0) + 1

    def report(self, row: int) -> dict:
        """What the forward did for the row (one read, as the request ends)."""
        steered, peak = torch.stack([self.steered[row].float(), self.peak[row]]).tolist()
        return {"steered_tokens": int(steered), "alpha_peak": round(peak, 6)}

    def end(self, row: int, layer: int) -> None:
        """Stop steering the row."""
        index = to_device([row], torch.int64, self.alpha.device)
        self.alpha.index_fill_(0, index, 0.0)
        self.layer.index_fill_(0, index, -1)
        self.live[layer] -= 1
        if not self.live[layer]:
            del self.live[layer]

    def set_alpha(self, rows: torch.Tensor, alpha: torch.Tensor) -> None:
        self.alpha[rows] = alpha

    def apply(self, layer: int, hidden: torch.Tensor, input_ids: torch.Tensor,
              pool_rows: torch.Tensor) -> torch.Tensor:
        """A decode forward's hidden states [B, hidden] after decoder layer
        `layer`, one token per row: h + α·s on the rows steered at this layer
        whose input token is a newline; every other row unchanged (exactly)."""
        on = (self.layer[pool_rows] == layer) & lookup(self.newline, input_ids) & (self.alpha[pool_rows] > 0)
        alpha = torch.where(on, self.alpha[pool_rows], torch.zeros_like(self.alpha[pool_rows]))
        self.steered[pool_rows] += on.long()  # rows of a batch are distinct req_pool rows
        self.peak[pool_rows] = torch.maximum(self.peak[pool_rows], alpha)
        steered = hidden + alpha.to(hidden.dtype).unsqueeze(-1) * self.vectors[layer].to(hidden.dtype)
        return torch.where(on.unsqueeze(-1), steered, hidden)


@dataclass(frozen=True)
class EngineSteering:
    """What the engine's hooks tell the policy (radix_ext/steering_hooks.py):
    req_pool rows, the residual stream's width, dtype and device."""

    rows: int
    hidden_size: int
    dtype: torch.dtype
    device: torch.device


#: Set once the engine installed its decoder-layer hooks (None: no steering here).
ENGINE: Optional[EngineSteering] = None
#: The process's table (the scheduler's), made by the skipkv policy when a
#: steered request first arrives; read by the hooks.
TABLE: Optional[SteeringTable] = None
