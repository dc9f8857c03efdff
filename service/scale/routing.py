"""Prefix-aware routing of engine jobs (settings `ray.routing: prefix`).

Requests whose prompts start with the same tokens (a shared system prompt)
should reach the replica whose radix cache already holds them. The ingress's
handle routes each job by the first `prefix_tokens` prompt tokens with
rendezvous (highest-random-weight) hashing over the running replicas: every
prefix has one preferred replica, the same in every ingress, and when a
replica comes or goes only the prefixes it owned move. Load balancing: when
the preferred replica holds `imbalance` more requests than the least loaded
one (Serve's cached queue lengths), or refuses (max_ongoing_requests), the
others are tried, least loaded first (Serve probes them).

Rendezvous hashing rather than a prefix tree: the ingress replicas share
nothing, and a hash gives them the same answer without a shared state; the
cost is that two prompts sharing fewer than `prefix_tokens` leading tokens
may land on different replicas.
"""

from __future__ import annotations

import hashlib
from typing import List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

#: Leading prompt tokens that name a prefix (a system prompt is usually longer).
PREFIX_TOKENS = 32
#: Requests more on the preferred replica than on the least loaded one before
#: the others are preferred.
IMBALANCE = 4


def prefix_key(input_ids: list[int], prefix_tokens: int) -> bytes:
    head = input_ids[:prefix_tokens]
    return hashlib.blake2b(b",".join(str(t).encode() for t in head), digest_size=16).digest()


def rendezvous_order(key: bytes, replica_ids: list[str]) -> list[str]:
    """Replica ids, the prefix's preferred one first (highest weight)."""
    def weight(rid: str) -> bytes:
        return hashlib.blake2b(key + rid.encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, prefix_tokens: int = PREFIX_TOKENS, imbalance: int = IMBALANCE, **kwargs):
        self.prefix_tokens = prefix_tokens
        self.imbalance = imbalance

    def _queue_len(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        job = pending_request.args[0] if pending_request is not None and pending_request.args else None
        input_ids = getattr(job, "input_ids", None)
        by_load = sorted(candidate_replicas, key=self._queue_len)
        if not input_ids or len(candidate_replicas) == 1:
            return [by_load]  # no prompt (info(), health): least loaded
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        order = rendezvous_order(prefix_key(input_ids, self.prefix_tokens), list(by_id))
        preferred = by_id[order[0]]
        others = [r for r in by_load if r is not preferred]
        if self._queue_len(preferred) >= self._queue_len(others[0]) + self.imbalance:
            return [others, [preferred]]  # saturated: spill to the least loaded
        return [[preferred], others]
