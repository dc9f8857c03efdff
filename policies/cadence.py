"""When a request with a decision cadence (`buffer`) evicts: rkv, skipkv
and streaming decide every `buffer` decode steps and then cut each head over
its budget back to it; in between a head grows by up to `buffer` tokens,
the slack its admission ceiling reserves (as R-KV's code lets its cache grow
by a buffer of tokens between compressions). The host names the rows due in
a step (`decides_at`, Policy.deciding_rows), so the engine gathers slots and
decides for those rows only; a padded row (Policy.pads_decisions) checks the
same on the device (`due_heads`) and evicts nothing."""

from __future__ import annotations

import torch

from .observations import SlotView


def decides_at(step: int, buffer: int) -> bool:
    """Host: whether a request decides at decode step `step` (0-based): every
    `buffer` steps, the first at step buffer - 1 (buffer 1: every step)."""
    return (step + 1) % buffer == 0


def due_heads(view: SlotView, budget: torch.Tensor, step: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """[R, H] heads that evict in this decode step: over their budget in a
    step where their row decides (decides_at, on the device)."""
    decides = (step + 1) % buffer == 0  # [R]
    return (view.held > budget) & decides.view(-1, 1)


def ceiling_with_buffer(private_prompt: int, max_new_tokens: int, budget: int, buffer: int) -> int:
    """Most private tokens one (layer, kv head) of such a request holds: a
    decode step stores its token before evicting, and a head decides every
    `buffer` steps, so it reaches budget + buffer before it cuts back."""
    return min(private_prompt + max_new_tokens, max(private_prompt, budget + buffer))
