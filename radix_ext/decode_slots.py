"""Compressed requests hold no token-pool slot of their own once their
prefill ends. Their private KV lives only in the compressed region; in the
pool they keep reading the radix-shared prefix.

Private prompt: SGLang allocates pool slots for every prefilled token; the
backend writes them there and into the region, but reads only the region.
After the last prefill chunk `free_private_prompt_slots` returns those
slots to the allocator and sets kv_allocated_len back to the shared prefix,
as SGLang's own streaming sessions do when they drop a tail.

SGLang's `alloc_for_decode` gives every running request one pool slot per
step and `prepare_for_decode` advances `kv_committed_len`. For compressed rows
we hand out slot 0 (SGLang's dummy slot, never allocated to anyone, which
absorbs padded writes) and keep `kv_committed_len == kv.kv_allocated_len`,
so `release_kv_cache` frees exactly the slots the request really owns
(none once its prefill ended) and SGLang's leak checks hold unchanged.
Only non-paged pools (page_size 1, SGLang's default) are handled; other
configurations keep SGLang's allocation.
"""

from __future__ import annotations

import logging

import torch

from kvsieve.policies.observations import to_device

from .runtime import RUNTIME

logger = logging.getLogger(__name__)


def _compressed_rows(batch) -> list[int]:
    return [i for i, req in enumerate(batch.reqs) if req.rid in RUNTIME.requests]


def free_private_prompt_slots(req, tree_cache) -> None:
    """Return a compressed request's private prompt slots to the pool once
    its prefill is done. release_kv_cache then frees nothing more of its own
    (committed = allocated = shared prefix) and only unlocks the prefix."""
    compressed = RUNTIME.requests.get(req.rid)
    allocator = tree_cache.token_to_kv_pool_allocator
    if compressed is None or req.kv is None or allocator.page_size != 1:
        return
    shared = compressed.prefix_len
    if shared < 0 or shared != req.cache_protected_len:
        # The backend and SGLang disagree on the shared prefix: leave SGLang's
        # accounting alone; the slots are freed when the request ends.
        logger.warning("kvsieve: request %s keeps its prompt slots (prefix %d, protected %d)",
                       req.rid, shared, req.cache_protected_len)
        return
    end = req.kv.kv_allocated_len
    if end > shared:
        row = tree_cache.req_to_token_pool.req_to_token[req.req_pool_idx]
        allocator.free(row[shared:end].to(torch.int64))
        row[shared:end] = 0  # SGLang's dummy slot; nothing reads these entries
        req.kv.kv_allocated_len = shared
        RUNTIME.pool_slots_freed = True
    req.kv_committed_len = shared
    req.prefix_indices = req.prefix_indices[:shared]


def alloc_for_decode_skipping_compressed(original, batch, token_per_req: int):
    """AROUND hook on sglang.srt.mem_cache.allocation.alloc_for_decode."""
    from sglang.srt.mem_cache.allocation import _alloc_page_size, alloc_token_slots

    compressed = _compressed_rows(batch)
    if not compressed or token_per_req != 1 or _alloc_page_size(batch) != 1 \
            or batch.model_config.is_encoder_decoder:
        return original(batch, token_per_req)
    skipped = set(compressed)
    full = [i for i in range(len(batch.reqs)) if i not in skipped]
    out_cache_loc = torch.zeros(len(batch.reqs), dtype=torch.int64, device=batch.seq_lens.device)
    if full:
        # Through pinned memory, without a host sync: SGLang's overlap
        # scheduler runs this while the previous forward is on the GPU, and a
        # plain copy waited for it (a batch mixing `full` with compressed rows
        # spent ~40% of its host time here, bench/results/logs/h200-2026-11-29d/).
        rows = to_device(full, torch.int64, batch.seq_lens.device)
        slots = alloc_token_slots(batch.tree_cache, len(full))
        out_cache_loc[rows] = slots.to(torch.int64)
        batch.req_to_token_pool.write(
            (batch.req_pool_indices[rows], batch.seq_lens[rows]), slots.to(torch.int32))
        for i in full:
            batch.reqs[i].kv.kv_allocated_len += 1
    return out_cache_loc


def keep_committed_len_at_owned_slots(result, batch, *args, **kwargs):
    """AFTER hook on ScheduleBatch.prepare_for_decode: undo the +1 of
    kv_committed_len for compressed rows, which got no slot."""
    if batch.spec_algorithm.is_none():
        for req in batch.reqs:
            if req.rid in RUNTIME.requests and req.kv is not None:
                req.kv_committed_len = req.kv.kv_allocated_len
    return result


def decode_growth_without_compressed(original, batch, selected_indices=None):
    """AROUND hook on ScheduleBatch.new_tokens_required_next_decode: a
    compressed row takes no pool slot next step, so it never counts toward
    the check that triggers retraction."""
    if not RUNTIME.requests or not batch.spec_algorithm.is_none():
        return original(batch, selected_indices)
    from sglang.srt.mem_cache.allocation import _alloc_page_size

    if _alloc_page_size(batch) != 1 or batch.model_config.is_encoder_decoder:
        return original(batch, selected_indices)
    rows = range(len(batch.reqs)) if selected_indices is None else selected_indices
    return sum(1 for i in rows if batch.reqs[i].rid not in RUNTIME.requests)


def retract_uncompressed_first(original, reqs, server_args):
    """AROUND hook on ScheduleBatch._get_decode_retraction_order (most
    preferred to keep first; SGLang retracts from the end). Retracting a
    compressed request frees no pool slot, since it holds none past the
    shared prefix, and would throw its region away; so uncompressed requests,
    in SGLang's order, go first. Region shortage never calls for retraction:
    admission reserved every running request's ceiling."""
    order = original(reqs, server_args)
    if not RUNTIME.requests:
        return order
    compressed = [i for i in order if reqs[i].rid in RUNTIME.requests]
    return compressed + [i for i in order if reqs[i].rid not in RUNTIME.requests]
