"""SGLang plugin entry point (group `sglang.srt.plugins`, name `kvsieve`).

SGLang calls `register()` in every process it starts, the spawned scheduler
included, before the engine runs. Hooks go through SGLang's HookRegistry:
no fork and no patch of SGLang's files.
"""

from __future__ import annotations

import logging

import torch

from . import admission, lifecycle, logit_guard, memory_split, metrics, startup_checks
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
_PROFILE_KV_TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes"
_MAX_REQS_TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.resolve_max_num_reqs"
_DECODE_GRAPH_TARGET = (
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph")
_PREFILL_GRAPH_TARGET = (
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.can_run_graph")
_SCHED = "sglang.srt.managers.scheduler.Scheduler."

#: (target, hook) of every hook registered here, checked at start-up
#: (startup_checks.check_hooks_applied).
REGISTERED: list[tuple[str, object]] = []


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
    middle prefill chunk (chunked=True) and after the last one.

    A compressed prompt (skip_radix_cache_insert): a middle chunk advances
    req.prefix_indices over the request's own slots, as SGLang's ChunkCache
    does, without inserting; the last chunk frees the private prompt's pool
    slots (the region holds what the policy kept) and trims the request's
    region pages to its decode-phase ceiling.

    A prompt the request keeps: SGLang inserts it into the radix tree as for
    any request, so later requests of any policy share it; after the last
    chunk nothing more of the request enters the tree (its generated tokens
    live in the region)."""
    compressed = RUNTIME.requests.get(req.rid)
    if compressed is None:
        return original(req, tree_cache, *args, **kwargs)
    if getattr(req, "skip_radix_cache_insert", False):
        if kwargs.get("chunked"):
            slots = tree_cache.req_to_token_pool.req_to_token[req.req_pool_idx, : req.extend_range.end]
            req.prefix_indices = slots.to(dtype=torch.int64, copy=True)
        else:
            free_private_prompt_slots(req, tree_cache)
            RUNTIME.after_prefill(compressed)
        return None
    result = original(req, tree_cache, *args, **kwargs)
    if not kwargs.get("chunked"):
        req.skip_radix_cache_insert = True
    return result


def retry_prefill_after_freed_slots(scheduler, running_batch=None, last_batch=None, *args, **kwargs):
    """BEFORE hook on Scheduler.get_next_batch_to_run. SGLang stops trying
    new prefills once a request did not fit (batch_is_full) until a running
    request finishes. Two kinds of room come back without that, so the
    waiting queue tries again:

    - pool slots freed at a compressed prefill's end;
    - after any prefill batch: SGLang 0.5.17 declares the batch full one
      request early while a chunked request is in the pass (its request slot
      is counted taken and, in the pass's list, again; sglang#35537,
      sglang#30295), so with max_running_requests requests in flight the last
      one waited for a whole generation to end. One more pass after the
      prefill admits it; a batch really full is found full again (at most one
      extra pass per prefill)."""
    after_prefill = last_batch is not None and last_batch.forward_mode.is_extend()
    if running_batch is not None and (RUNTIME.pool_slots_freed or (
            after_prefill and running_batch.batch_is_full and scheduler.waiting_queue)):
        running_batch.batch_is_full = False
        RUNTIME.pool_slots_freed = False
    lifecycle.publish_live()  # an int compare unless the count changed


def release_region(original, req, tree_cache, *args, **kwargs):
    """AROUND hook on release_kv_cache, the one exit of a request's KV (finish,
    abort, retraction): the region's pages go back with SGLang's, and the
    pool's allocator counters are published (kvsieve_token_pool_tokens)."""
    try:
        return original(req, tree_cache, *args, **kwargs)
    finally:
        RUNTIME.end(req.rid)
        lifecycle.publish_live()
        allocator = tree_cache.token_to_kv_pool_allocator
        metrics.record_token_pool(allocator.available_size(), tree_cache.evictable_size(), allocator.size)


def graphs_skip_compressed_batches(original, runner, forward_batch, *args, **kwargs):
    """AROUND the CUDA-graph runners' can_run_graph: a batch with compressed
    rows runs eagerly (their per-step metadata is not captured yet); batches
    of `full` requests keep SGLang's graphs."""
    rids = getattr(forward_batch, "rids", None)
    if RUNTIME.requests and rids and any(rid in RUNTIME.requests for rid in rids):
        return False
    return original(runner, forward_batch, *args, **kwargs)


def backend_supports_triton(original, backend: str) -> bool:
    """AROUND hook on support_triton: SGLang treats every backend name but
    torch_native as Triton-capable; kvsieve's CPU backend is not."""
    if backend == "kvsieve":
        from sglang.srt.utils.common import is_cpu

        return not is_cpu()
    return original(backend)


def check_at_scheduler_start(result, scheduler, *args, **kwargs):
    """AFTER Scheduler.init_model_config, in the scheduler process, after
    SGLang applied every hook and before the model loads."""
    startup_checks.check_scheduler_start(scheduler, REGISTERED)
    return result


def register() -> None:
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import add_attention_backend_choices

    def create_backend(model_runner):
        # Imported here: the backend module needs SGLang's model layers, which
        # only the scheduler process loads.
        from .backend import KvsieveAttnBackend

        # Again here: this runs even if the init_model_config hook did not apply.
        startup_checks.check_hooks_applied(REGISTERED)
        startup_checks.check_settings(model_runner.server_args, model_runner.model_config)
        startup_checks.check_sliding_window_layers(model_runner.model)
        backend = KvsieveAttnBackend(model_runner)
        from .steering_hooks import install as install_steering

        install_steering(model_runner)  # skipkv's steering: forward hooks on the decoder layers
        return backend

    class HookRegistry(HookRegistry):  # noqa: F811 - records what it registers, for the start-up check
        @classmethod
        def register(cls, target, hook, hook_type):
            REGISTERED.append((target, hook))
            super().register(target, hook, hook_type)

    from kvsieve.policies import load_policy_modules

    load_policy_modules()  # policies of `kvsieve serve --policy-module`, in this process too
    register_attention_backend("kvsieve")(create_backend)
    add_attention_backend_choices(["kvsieve"])
    HookRegistry.register(_COLLECT_TARGET, report_kv_usage, HookType.AFTER)
    HookRegistry.register(_COLLECT_TARGET, logit_guard.end_requests_with_bad_logits, HookType.AFTER)
    HookRegistry.register(_ADMIT_TARGET, admission.add_request_to_queue, HookType.AROUND)
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
    HookRegistry.register(_PROFILE_KV_TARGET, memory_split.carve_region, HookType.AROUND)
    HookRegistry.register(_MAX_REQS_TARGET, memory_split.cap_running_requests, HookType.AROUND)
    HookRegistry.register(_DECODE_GRAPH_TARGET, graphs_skip_compressed_batches, HookType.AROUND)
    HookRegistry.register(_PREFILL_GRAPH_TARGET, graphs_skip_compressed_batches, HookType.AROUND)
    # Requests SGLang drops before they run (lifecycle.py).
    HookRegistry.register(_SCHED + "_set_or_validate_priority", lifecycle.forget_if_priority_refused, HookType.AFTER)
    HookRegistry.register(_SCHED + "_abort_on_queued_limit", lifecycle.forget_if_queue_limit_refused,
                          HookType.AROUND)
    HookRegistry.register(_SCHED + "_abort_on_waiting_timeout", lifecycle.forget_timed_out, HookType.AROUND)
    HookRegistry.register(_SCHED + "init_model_config", check_at_scheduler_start, HookType.AFTER)
    logger.info("kvsieve plugin registered: attention backend 'kvsieve', kv_usage reporting")
