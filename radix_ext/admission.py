"""Integration step 4 (token-pool side): admit a compressed request by what
it really takes from SGLang's token pool.

A compressed request's generated tokens live in the compressed region
(decode_slots.py), so in the pool it needs only its private prompt.
SGLang's PrefillAdder reserves `prompt + min(max_new_tokens, clip)` for a new
request and `remaining new tokens x new_token_ratio` for each running one,
and `init_req_max_new_tokens` clips max_new_tokens to the pool size. For
compressed requests these hooks make the reservation `prompt + page` and
bound max_new_tokens by the context length only. The region side of the
ceiling (budget + slack pages per head) is not reserved yet: a request that
cannot fit in the region ends with a 503 (runtime.overflow).
"""

from __future__ import annotations

from contextlib import contextmanager

from .runtime import RUNTIME


@contextmanager
def _no_new_tokens_reserved(req):
    """Make SGLang's adder see a compressed request as wanting no new pool tokens."""
    saved = req.sampling_params.max_new_tokens
    req.sampling_params.max_new_tokens = len(req.output_ids)
    try:
        yield
    finally:
        req.sampling_params.max_new_tokens = saved


def _admit(req) -> bool:
    """Classify a request on its way in; True if it compresses."""
    if req.rid not in RUNTIME.requests:
        RUNTIME.admit(req.rid, getattr(req.sampling_params, "custom_params", None),
                      len(req.origin_input_ids), sgl_req=req)
    if req.rid in RUNTIME.requests:
        # It reads the radix-matched prefix but never inserts its own tokens.
        req.skip_radix_cache_insert = True
        return True
    return False


def init_max_new_tokens(original, scheduler, req, *args, **kwargs):
    """AROUND Scheduler.init_req_max_new_tokens: classify, then for compressed
    requests bound max_new_tokens by the context only, not the pool size."""
    requested = req.sampling_params.max_new_tokens
    try:
        compressed = _admit(req)
    except ValueError as exc:  # KVPolicyError: a bad spec sent straight to the engine
        req.set_finish_with_abort(f"invalid kv_policy: {exc}")
        return original(scheduler, req, *args, **kwargs)
    result = original(scheduler, req, *args, **kwargs)
    if compressed and requested is not None:
        # SGLang's max_req_len is also capped by the pool size; a compressed
        # request's length is bounded by the context only (req_to_token rows
        # are context-wide, and its generated tokens take no pool slot).
        room = scheduler.model_config.context_len - 1 - len(req.origin_input_ids) - 1
        req.sampling_params.max_new_tokens = max(0, min(requested, room))
    return result


def add_request_to_queue(scheduler, req, *args, **kwargs):
    """BEFORE Scheduler._add_request_to_queue: retracted requests come back
    here without init_req_max_new_tokens; classify them again."""
    try:
        _admit(req)
    except ValueError as exc:
        req.set_finish_with_abort(f"invalid kv_policy: {exc}")


def add_req_reserving_prompt_only(original, adder, req, *args, **kwargs):
    """AROUND PrefillAdder.add_one_req / add_chunked_req."""
    if req.rid in RUNTIME.requests:
        with _no_new_tokens_reserved(req):
            return original(adder, req, *args, **kwargs)
    return original(adder, req, *args, **kwargs)


def running_offset(original, adder, req, *args, **kwargs):
    """AROUND PrefillAdder._get_running_request_total_token_offset."""
    if req.rid in RUNTIME.requests:
        return 0
    return original(adder, req, *args, **kwargs)
