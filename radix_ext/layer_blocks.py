"""A policy group's decode pass over a block of layers as one call.

Where the policy groups run after the decoder stack (region_graphs.
RegionGraphs.defer_groups) every layer's observations are there at once,
and a group's pass is the same few dozen small kernels in each of the
model's layers: under traffic the groups of a mixed batch cost ~16 ms of
GPU time a step whatever the rows (docs/gpu-kernels.md, "Where a replayed
traffic step's time goes"), launch-bound. For a policy whose decision of a
(row, layer) reads nothing of the layer but its slots and observations
(Policy.decides_layers_apart), k layers of a group of Rg rows are one
group of k x Rg rows, layer-major: page-table rows, observations, budgets,
parameters and inputs stacked, one call, one write-back. The kernels fall
k-fold; the work is the same.

Memory: a stacked pass holds k times a one-layer pass's tensors. The plan
(memory_plan: pass_scratch) bounds a pass by the region's slots in one
layer, so a block's slots (k x Rg x heads x slots a head) stay within that
bound, and a key reader's block within the rows one decision may gather
keys for (step_meta.decision_rows_limit). A group as large as the plan
allows runs one layer at a time, as before: stacking pays where groups are
small, which is where the kernel count is what costs.

KVSIEVE_GROUP_LAYER_BLOCK caps k (default: every layer; 1: off).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

BLOCK_ENV = "KVSIEVE_GROUP_LAYER_BLOCK"


def max_block(num_layers: int) -> int:
    raw = os.environ.get(BLOCK_ENV)
    if raw is None or raw == "":
        return num_layers
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{BLOCK_ENV}={raw!r}: must be a whole number of layers (1: one layer a pass)") from None
    if value < 1:
        raise ValueError(f"{BLOCK_ENV}={raw}: must be at least 1 (1: one layer a pass)")
    return min(value, num_layers)


def block_size(rows: int, heads: int, slots: int, num_layers: int, planned_slots: Optional[int],
               key_rows: Optional[int]) -> int:
    """Layers per stacked pass of a group of `rows` rows whose heads hold
    `slots` slots each: at most max_block, at most what keeps the block's
    slots within `planned_slots` (None: unplanned, CPU) and its rows within
    `key_rows` (None: the policy reads no keys); at least 1."""
    k = max_block(num_layers)
    if planned_slots is not None:
        k = min(k, planned_slots // max(1, rows * heads * slots))
    if key_rows is not None:
        k = min(k, key_rows // max(1, rows))
    return max(1, k)


def blocks(layers: list, k: int) -> list[list]:
    """Consecutive runs of at most k layers (by layer id), in order; a gap in
    the ids starts a new run, so each block is a slice of the page table."""
    out: list[list] = []
    for layer in layers:
        run = out[-1] if out else None
        if run is not None and len(run) < k and layer.layer_id == run[-1].layer_id + 1:
            run.append(layer)
        else:
            out.append([layer])
    return out


def stack_rows(tensors: list) -> Optional[torch.Tensor]:
    """Per-layer [Rg, ...] tensors as one [k x Rg, ...] (layer-major); None
    when they are None."""
    if tensors[0] is None:
        return None
    return torch.cat(tensors, dim=0)


def repeat_rows(t: torch.Tensor, k: int) -> torch.Tensor:
    """A per-row tensor [Rg, ...] for k layers' rows, layer-major."""
    return t.repeat(k, *([1] * (t.dim() - 1)))


def layer_run(tensors: list) -> Optional[torch.Tensor]:
    """Per-layer tensors of consecutive layers as one [k, ...] view, where
    they are consecutive equal blocks of one buffer (the deferred
    observations: region_graphs.ObservationBuffers with num_layers), else
    None. Host-side pointer checks only."""
    first = tensors[0]
    if first is None or not first.is_contiguous():
        return None
    size = first.numel() * first.element_size()
    base, storage = first.data_ptr(), first.untyped_storage().data_ptr()
    for i, t in enumerate(tensors):
        if (t is None or t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous()
                or t.data_ptr() != base + i * size or t.untyped_storage().data_ptr() != storage):
            return None
    return first.as_strided((len(tensors), *first.shape), (first.numel(), *first.stride()))


def observed_block(policy, obs: list, rows: torch.Tensor, slots: Optional[int]):
    """What backend.observed_rows gives for each layer of `obs`, stacked
    (layer-major, as stack_rows stacks them): one gather of the block where the
    layers' observations are blocks of one buffer, else one a layer and a
    cat (a mixed batch's groups made ~160 such gathers a step)."""
    from kvsieve.policies import Need, Observations

    cut = slice(None) if slots is None else slice(0, slots)
    needs = policy.needs

    def kind(name: str, need, per_slot: bool) -> Optional[torch.Tensor]:
        tensors = [getattr(o, name) for o in obs]
        if tensors[0] is None or not needs & need:
            return None
        run = layer_run(tensors)
        if run is None:  # not blocks of one buffer: a gather a layer
            return stack_rows([t[rows, :, cut] if per_slot else t[rows] for t in tensors])
        picked = run[:, rows, :, cut] if per_slot else run[:, rows]
        return picked.reshape(-1, *picked.shape[2:])

    return Observations(attention=kind("attention", Need.ATTENTION, True),
                        pv_norm=kind("pv_norm", Need.PV_NORM, True),
                        sparsity=kind("sparsity", Need.SPARSITY, False))


def stacked_table(table: torch.Tensor, pool_rows: torch.Tensor, first: int, count: int, width: int) -> torch.Tensor:
    """Page-table rows of `pool_rows` in layers first..first+count-1, as
    [count x Rg, H, width] (layer-major) from the table [rows, L, H, M]."""
    part = table[pool_rows, first:first + count, :, :width]  # [Rg, k, H, width]
    return part.transpose(0, 1).reshape(-1, *part.shape[2:])
