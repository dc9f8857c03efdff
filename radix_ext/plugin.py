"""SGLang plugin entry point (group `sglang.srt.plugins`, name `kvsieve`).

SGLang calls `register()` in every process it starts, the spawned scheduler
included, before the engine runs. Hooks go through SGLang's HookRegistry:
no fork and no patch of SGLang's files.
"""

from __future__ import annotations

import logging

from .usage import KV_USAGE_KEY, full_kv_usage, policy_name_of

logger = logging.getLogger(__name__)

# Called by SGLang once per generated token of every request, in the scheduler.
_COLLECT_TARGET = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor._maybe_collect_customized_info"
)


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
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info.setdefault(KV_USAGE_KEY, []).append(record)
    return result


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_COLLECT_TARGET, report_kv_usage, HookType.AFTER)
    logger.info("kvsieve plugin registered (kv_usage reporting)")
