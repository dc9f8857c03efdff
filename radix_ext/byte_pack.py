"""Many small tensors of mixed dtypes as one buffer of bytes.

A decode step's metadata is dozens of tiny tensors (each policy group's
rows, budgets, steps, parameters): made one at a time on the device, each
is a host-to-device copy or a kernel launch of a few microseconds, and at
~50 rows a step spent 4-7 ms of host time there (issue #29). Packed, the
step's host-built tensors go in one transfer (`to_device`), and a captured
segment's static inputs are refilled by one copy (`refill`).

Tensors are laid out widest element first, so each starts at an offset
its dtype divides (8-byte elements, then 4, 2 and 1) with no padding.
"""

from __future__ import annotations

import torch


#: dtypes of a list -> its runs (_runs): a step's groups repeat a few layouts.
_LAYOUTS: dict = {}


def _runs(tensors) -> list[list[int]]:
    """The layout: indices of `tensors` in runs of one dtype, widest
    elements first (each run then starts at an offset its dtype divides)."""
    key = tuple(t.dtype for t in tensors)
    runs = _LAYOUTS.get(key)
    if runs is None:
        order = sorted(range(len(key)), key=lambda i: (-tensors[i].element_size(), str(key[i])))
        runs = []
        for i in order:
            if runs and key[runs[-1][0]] == key[i]:
                runs[-1].append(i)
            else:
                runs.append([i])
        if len(_LAYOUTS) > 256:
            _LAYOUTS.clear()
        _LAYOUTS[key] = runs
    return runs


def _flat(t: torch.Tensor) -> torch.Tensor:
    # Most of a step's tensors are one value per row: already flat, and a
    # reshape would be one more dispatched op each (hundreds a step).
    return t if t.dim() == 1 else t.reshape(-1)


def _bytes(tensors, runs) -> list[torch.Tensor]:
    """The bytes of each run (one flat cat per dtype, viewed as uint8)."""
    return [torch.cat([_flat(tensors[i]) for i in run]).view(torch.uint8) for run in runs]


def _views(flat: torch.Tensor, like, runs) -> list[torch.Tensor]:
    """Views of `flat` (uint8, laid out by `runs`) shaped and typed as `like`."""
    out = [None] * len(like)
    at = 0
    for run in runs:
        dtype = like[run[0]].dtype
        sizes = [like[i].numel() for i in run]
        n = sum(sizes) * like[run[0]].element_size()
        for i, piece in zip(run, flat[at:at + n].view(dtype).split(sizes)):
            out[i] = piece if like[i].dim() == 1 else piece.view(like[i].shape)
        at += n
    return out


def pack(tensors) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A new buffer holding `tensors`, and views of it in their shapes and
    dtypes (in the order given)."""
    runs = _runs(tensors)
    flat = torch.cat(_bytes(tensors, runs)) if tensors else torch.zeros(0, dtype=torch.uint8)
    return flat, _views(flat, tensors, runs)


def refill(flat: torch.Tensor, tensors) -> None:
    """Copy `tensors` (the shapes and dtypes `flat` was packed from, same
    order) into `flat` with one copy."""
    if tensors:
        torch.cat(_bytes(tensors, _runs(tensors)), out=flat)


#: Each list's bytes start at a multiple of this in a shipped buffer.
ALIGN = 16


def to_device(lists, device) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """Lists of host tensors on `device` through one transfer (on CUDA from
    pinned memory, an asynchronous copy ordered on the current stream: no
    host sync). Per list: its tensors as views of the device buffer, and
    the list's bytes there, laid out as `pack` lays them out (a buffer
    packed from tensors of these shapes refills with one `copy_` from them)."""
    parts, spans, at = [], [], 0
    for tensors in lists:
        runs = _runs(tensors)
        chunk = _bytes(tensors, runs)
        n = sum(c.numel() for c in chunk)
        parts += chunk
        if -n % ALIGN:
            parts.append(torch.zeros(-n % ALIGN, dtype=torch.uint8))
        spans.append((at, n, runs))
        at += n + (-n % ALIGN)
    if not parts:
        return [([], torch.zeros(0, dtype=torch.uint8)) for _ in lists]
    host = torch.cat(parts)
    if torch.device(device).type == "cuda":
        shipped = host.pin_memory().to(device, non_blocking=True)
    else:
        shipped = host.to(device)
    out = []
    for tensors, (start, n, runs) in zip(lists, spans):
        flat = shipped[start:start + n]
        out.append((_views(flat, tensors, runs), flat))
    return out
