"""A policy group's segment recorded on a step of 192 rows and replayed on
one of 208 (region_graphs.observation_shape): shared by
tests/test_region_graphs.py (rerun graphs, CPU) and
tests_gpu/test_group_rows_cuda.py (CUDA graphs)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvsieve.policies import Observations, get_policy
from kvsieve.radix_ext import byte_pack
from kvsieve.radix_ext.region_graphs import ALL_LAYERS, _GroupEntry, group_signature, group_tensors
from kvsieve.radix_ext.step_meta import PolicyGroup

HEADS, SLOTS = 2, 32


class _Backend:
    """What a group's pass reads of the observations: its rows of each
    layer's views (backend.observed_rows' gather), into one static tensor
    (written by an eager run and by a replay alike)."""

    def __init__(self, device):
        self.pages = SimpleNamespace(table=torch.zeros(1, device=device))
        self.out = torch.zeros((2, 16, HEADS, SLOTS), device=device)

    def decode_group_layers(self, group, layers, obs):
        self.out.copy_(torch.stack([o.attention[group.rows] for o in obs]))


def replay_past_recorded_rows(graphs, device) -> tuple[list, list]:
    """Run a group over 2 layers on a 192-row step (recorded), then on a
    208-row step whose observation buffers did not regrow, with its rows at
    192-207. Returns what the pass read in each step and what it should
    have read."""
    backend, layers = _Backend(device), [SimpleNamespace(layer_id=0), SimpleNamespace(layer_id=1)]

    def step_obs(rows):
        values = torch.arange(rows * HEADS * SLOTS, dtype=torch.float32, device=device).view(rows, HEADS, SLOTS)
        return [graphs.observations.store(Observations(attention=values + 1000 * rows + layer), layer)
                for layer in (0, 1)]

    def group_on(first):
        n = 16
        return PolicyGroup(policy=get_policy("h2o"), rows=torch.arange(first, first + n, device=device),
                           budget=torch.full((n,), 8, device=device), step=torch.zeros(n, dtype=torch.int64,
                                                                                        device=device),
                           params={}, maxima={}, pool_rows=torch.arange(n, device=device), members=list(range(n)),
                           requests=[None] * n, width=2)

    def read(group, obs):
        """The group's pass over both layers (eager and recorded, or
        replayed); what it read in this step."""
        graphs._group_segment(backend, group, gentry, ALL_LAYERS, list(zip(layers, obs)))
        return backend.out.clone()

    for rows in (64, 128):
        step_obs(rows)  # the buffers grow to their size for 192 rows and beyond
    first = group_on(160)
    static, arena = graphs._static_group(first)
    gentry = _GroupEntry(group=static, arena=arena)
    seen, expected = [], []
    obs = step_obs(192)
    seen.append(read(first, obs))
    expected.append(torch.stack([o.attention[160:176] for o in obs]))
    generation = graphs.observations.generation

    later = group_on(192)  # the same group shapes, its rows now past the 192 recorded
    assert group_signature(later) == group_signature(first)
    obs = step_obs(208)
    assert graphs.observations.generation == generation  # no regrowth: nothing else recaptures
    byte_pack.refill(gentry.arena, group_tensors(later))  # what begin_step does for a known group
    seen.append(read(later, obs))
    expected.append(torch.stack([o.attention[192:208] for o in obs]))
    return seen, expected
