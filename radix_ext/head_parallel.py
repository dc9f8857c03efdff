"""Tensor parallelism for the compressed region: each rank's region holds the
kv heads SGLang gave that rank (pages per (layer, local kv head)), and
policies see those heads only. What a decision combines across heads goes
through `PolicyBatch.heads` (policies/observations.py HeadShards), whose
collectives this module takes from SGLang's attention-TP group, so every
rank decides the same thing:

* per-head policies (streaming, h2o, snapkv, rkv, skipkv's token scores)
  need nothing: a head's decision reads only that head;
* LongFlow sums its slot score over all heads of the layer, ThinKV averages
  sparsity over all query heads, Crystal-KV's adaptive budgets move pages
  between all heads: they reduce or gather through `heads`.

A request's kv_usage sums its counts over every rank's heads (one small
all-reduce when it ends); the live metrics count tokens on attention-TP rank
0 only and bytes on each rank for its own heads.
"""

from __future__ import annotations

import logging

import torch

from kvsieve.policies.observations import LOCAL_HEADS, HeadShards

logger = logging.getLogger(__name__)

#: This process's shards; set once by the backend when the model runner exists.
SHARDS: HeadShards = LOCAL_HEADS


def init_from_sglang() -> HeadShards:
    """Read the attention-TP group of this scheduler process (after SGLang
    initialized its distributed state)."""
    global SHARDS
    try:
        from sglang.srt.distributed.parallel_state import get_attn_tp_group
        group = get_attn_tp_group()
    except (ImportError, AssertionError):  # no distributed state: a single process
        SHARDS = LOCAL_HEADS
        return SHARDS
    if group.world_size == 1:
        SHARDS = LOCAL_HEADS
    else:
        SHARDS = HeadShards(size=group.world_size, rank=group.rank_in_group,
                            all_reduce=group.all_reduce,
                            all_gather=lambda x, dim: group.all_gather(x, dim=dim))
        logger.info("kvsieve: compressed region on attention-TP rank %d of %d", SHARDS.rank, SHARDS.size)
    return SHARDS


def reports_usage() -> bool:
    """Whether this rank reports kv_usage and metrics (rank 0 only: counted once)."""
    return SHARDS.rank == 0


def sum_over_ranks(counts: list[int], device) -> list[int]:
    """Counts summed over every rank's heads (a collective: every rank calls
    it at the same point); the counts themselves with one rank."""
    if SHARDS.size == 1:
        return counts
    return SHARDS.sum(torch.tensor(counts, dtype=torch.int64, device=device)).tolist()
