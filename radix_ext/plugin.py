"""SGLang plugin entry point (group `sglang.srt.plugins`, name `kvsieve`).

SGLang calls `register()` in every process it starts, the spawned scheduler
included, before the engine runs. Hooks go through SGLang's HookRegistry:
no fork and no patch of SGLang's files.
"""

from __future__ import annotations

import logging

import torch

from . import admission, metrics
from .decode_slots import (
    alloc_for_decode_skipping_compressed,
    decode_growth_without_compressed,
    free_private_prompt_slots,
    keep_committed_len_at_owned_slots,
    retract_uncompressed_first,
)
from .runtime import RUNTIME
from .usage import KV_USAGE_KEY, full_kv_usage, policy_name_of

logger = logging.getLogger(__name__)

# Called by SGLang once per generated token of every request, in the scheduler.
_COLLECT_TARGET = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor._maybe_collect_customized_info"
)

_ADMIT_TARGET = "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue"
_ABORT_TARGET = "sglang.srt.managers.scheduler.Scheduler.abort_request"
_INIT_MAX_NEW_TARGET = "sglang.srt.managers.scheduler.Scheduler.init_req_max_new_tokens"
_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder."
_RELEASE_TARGET = "sglang.srt.mem_cache.common.release_kv_cache"
_UNFINISHED_TARGET = "sglang.srt.mem_cache.common.maybe_cache_unfinished_req"
_NEXT_BATCH_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run"
_ALLOC_DECODE_TARGET = "sglang.srt.mem_cache.allocation.alloc_for_decode"
_PREPARE_DECODE_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode"
_DECODE_GROWTH_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.new_tokens_required_next_decode"
_RETRACTION_ORDER_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch._get_decode_retraction_order"
_SUPPORT_TRITON_TARGET = "sglang.srt.utils.common.support_triton"


def report_kv_usage(result, processor, i, req, logits_output):
    """AFTER hook: one entry per output token for kv_policy requests; the usage
    record itself only with the last token (None before), which keeps the
    per-token cost to a list append."""
    policy = policy_name_of(getattr(req.sampling_params, "custom_params", None))
    if policy is None:
        return result
    record = None
    if req.finished():
        record = full_kv_usage(
            policy=policy,
            prompt_tokens=len(req.origin_input_ids),
            cached_tokens=req.cached_tokens,
            output_tokens=len(req.output_ids),
        )
        compressed = RUNTIME.pop_usage(req.rid)
        if compressed is not None:
            record.update(compressed)
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info.setdefault(KV_USAGE_KEY, []).append(record)
    return result


def keep_chunk_progress(original, req, tree_cache, *args, **kwargs):
    """AROUND hook on maybe_cache_unfinished_req, which SGLang calls after a
    middle prefill chunk (chunked=True) and after the last one. With
    skip_radix_cache_insert SGLang skips it entirely; for compressed requests
    a middle chunk advances req.prefix_indices over the request's own slots,
    as SGLang's ChunkCache does, without inserting, and the last chunk frees
    the private prompt's pool slots (the region holds those tokens)."""
    if getattr(req, "skip_radix_cache_insert", False) and req.rid in RUNTIME.requests:
        if kwargs.get("chunked"):
            slots = tree_cache.req_to_token_pool.req_to_token[req.req_pool_idx, : req.extend_range.end]
            req.prefix_indices = slots.to(dtype=torch.int64, copy=True)
        else:
            free_private_prompt_slots(req, tree_cache)
        return None
    return original(req, tree_cache, *args, **kwargs)


def retry_prefill_after_freed_slots(scheduler, running_batch=None, *args, **kwargs):
    """BEFORE hook on Scheduler.get_next_batch_to_run. SGLang stops trying
    new prefills once a request did not fit (batch_is_full) until a running
    request finishes; pool slots freed at a compressed prefill's end are room
    too, so let the waiting queue try again."""
    if RUNTIME.pool_slots_freed and running_batch is not None:
        running_batch.batch_is_full = False
        RUNTIME.pool_slots_freed = False


def release_region(original, req, tree_cache, *args, **kwargs):
    """AROUND hook on release_kv_cache, the one exit of a request's KV (finish,
    abort, retraction): the region's pages go back with SGLang's, and the
    pool's allocator counters are published (kvsieve_token_pool_tokens)."""
    try:
        return original(req, tree_cache, *args, **kwargs)
    finally:
        RUNTIME.end(req.rid)
        allocator = tree_cache.token_to_kv_pool_allocator
        metrics.record_token_pool(allocator.available_size(), tree_cache.evictable_size(), allocator.size)


def backend_supports_triton(original, backend: str) -> bool:
    """AROUND hook on support_triton: SGLang treats every backend name but
    torch_native as Triton-capable; kvsieve's CPU backend is not."""
    if backend == "kvsieve":
        from sglang.srt.utils.common import is_cpu

        return not is_cpu()
    return original(backend)


def register() -> None:
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import add_attention_backend_choices

    def create_backend(model_runner):
        # Imported here: the backend module needs SGLang's model layers, which
        # only the scheduler process loads.
        from .backend import KvsieveAttnBackend

        return KvsieveAttnBackend(model_runner)

    from kvsieve.policies import load_policy_modules

    load_policy_modules()  # policies of `kvsieve serve --policy-module`, in this process too
    register_attention_backend("kvsieve")(create_backend)
    add_attention_backend_choices(["kvsieve"])
    HookRegistry.register(_COLLECT_TARGET, report_kv_usage, HookType.AFTER)
    HookRegistry.register(_ADMIT_TARGET, admission.add_request_to_queue, HookType.BEFORE)
    HookRegistry.register(_INIT_MAX_NEW_TARGET, admission.init_max_new_tokens, HookType.AROUND)
    HookRegistry.register(_ADDER + "add_one_req", admission.add_one_req_by_ceiling, HookType.AROUND)
    HookRegistry.register(_ADDER + "add_chunked_req", admission.add_chunked_req_reserving_prompt_only,
                          HookType.AROUND)
    HookRegistry.register(_ABORT_TARGET, admission.forget_aborted_in_queue, HookType.AFTER)
    HookRegistry.register(_ADDER + "_get_running_request_total_token_offset", admission.running_offset,
                          HookType.AROUND)
    HookRegistry.register(_RELEASE_TARGET, release_region, HookType.AROUND)
    HookRegistry.register(_UNFINISHED_TARGET, keep_chunk_progress, HookType.AROUND)
    HookRegistry.register(_NEXT_BATCH_TARGET, retry_prefill_after_freed_slots, HookType.BEFORE)
    HookRegistry.register(_ALLOC_DECODE_TARGET, alloc_for_decode_skipping_compressed, HookType.AROUND)
    HookRegistry.register(_PREPARE_DECODE_TARGET, keep_committed_len_at_owned_slots, HookType.AFTER)
    HookRegistry.register(_DECODE_GROWTH_TARGET, decode_growth_without_compressed, HookType.AROUND)
    HookRegistry.register(_RETRACTION_ORDER_TARGET, retract_uncompressed_first, HookType.AROUND)
    HookRegistry.register(_SUPPORT_TRITON_TARGET, backend_supports_triton, HookType.AROUND)
    logger.info("kvsieve plugin registered: attention backend 'kvsieve', kv_usage reporting")
