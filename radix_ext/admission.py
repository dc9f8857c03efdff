"""Integration step 4: admit a compressed request by its compressed ceiling.

Token pool: a compressed request's generated tokens live in the compressed
region (decode_slots.py), so in the pool it needs only its private prompt.
SGLang's PrefillAdder reserves `prompt + min(max_new_tokens, clip)` for a new
request and `remaining new tokens x new_token_ratio` for each running one,
and `init_req_max_new_tokens` clips max_new_tokens to the pool size. For
compressed requests these hooks make the reservation `prompt + page` and
bound max_new_tokens by the context length only.

Region: a request is admitted only when its ceiling (the most pages its
policy can hold: private prompt, budget and the page slack) fits next to the
running requests' ceilings; otherwise it waits in SGLang's queue, first come
first served, until a request ends. One that could never fit is refused at
once (400 naming kv_policy); past SGLang's --max-queued-requests, new
requests get SGLang's 503.
"""

from __future__ import annotations

from contextlib import contextmanager

from sglang.srt.managers.schedule_policy import AddReqResult

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
    if req.to_finish is not None:  # already refused (set_finish_with_abort): it runs one token, plainly
        return False
    if req.rid not in RUNTIME.requests:
        # A retracted request comes back with its outputs to prefill again.
        RUNTIME.admit(req.rid, getattr(req.sampling_params, "custom_params", None),
                      len(req.origin_input_ids) + len(req.output_ids), sgl_req=req)
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
        req.set_finish_with_abort(str(exc))  # "kv_policy.<field>: why"
        return original(scheduler, req, *args, **kwargs)
    result = original(scheduler, req, *args, **kwargs)
    if compressed and requested is not None:
        # SGLang's max_req_len is also capped by the pool size; a compressed
        # request's length is bounded by the context only (req_to_token rows
        # are context-wide, and its generated tokens take no pool slot).
        room = scheduler.model_config.context_len - 1 - len(req.origin_input_ids) - 1
        req.sampling_params.max_new_tokens = max(0, min(requested, room))
    if compressed:
        too_big = RUNTIME.exceeds_region(RUNTIME.requests[req.rid], req.sampling_params.max_new_tokens)
        if too_big:
            # It would wait forever; SGLang then ends it after a one-token prefill.
            del RUNTIME.requests[req.rid]
            req.set_finish_with_abort(too_big)
    return result


def add_request_to_queue(scheduler, req, *args, **kwargs):
    """BEFORE Scheduler._add_request_to_queue: retracted requests come back
    here without init_req_max_new_tokens; classify them again."""
    try:
        _admit(req)
    except ValueError as exc:
        req.set_finish_with_abort(str(exc))  # "kv_policy.<field>: why"


def _private_prompt_and_new_tokens(req) -> tuple[int, int]:
    """Tokens the request will store privately at prefill (a retracted
    request re-prefills its outputs too) and the tokens it may still generate."""
    private = len(req.origin_input_ids) + len(req.output_ids) - len(req.prefix_indices)
    return private, max(0, req.sampling_params.max_new_tokens - len(req.output_ids))


def add_one_req_by_ceiling(original, adder, req, *args, **kwargs):
    """AROUND PrefillAdder.add_one_req: a compressed request waits (NO_TOKEN,
    as SGLang does when the pool is short) until its region ceiling fits,
    and reserves only its private prompt in the pool."""
    compressed = RUNTIME.requests.get(req.rid)
    if compressed is None:
        return original(adder, req, *args, **kwargs)
    private, new_tokens = _private_prompt_and_new_tokens(req)
    if not RUNTIME.fits(compressed, private, new_tokens):
        return AddReqResult.NO_TOKEN
    with _no_new_tokens_reserved(req):
        result = original(adder, req, *args, **kwargs)
    if adder.can_run_list and adder.can_run_list[-1] is req:
        RUNTIME.reserve(compressed, private, new_tokens)
    return result


def add_chunked_req_reserving_prompt_only(original, adder, req, *args, **kwargs):
    """AROUND PrefillAdder.add_chunked_req: the next chunk of a request
    admitted earlier (its region ceiling is already reserved)."""
    if req.rid in RUNTIME.requests:
        with _no_new_tokens_reserved(req):
            return original(adder, req, *args, **kwargs)
    return original(adder, req, *args, **kwargs)


def forget_aborted_in_queue(result, scheduler, recv_req, *args, **kwargs):
    """AFTER Scheduler.abort_request: requests aborted while waiting never
    reach release_kv_cache; drop their (page-less) runtime entries."""
    waiting = {req.rid for req in scheduler.waiting_queue}
    RUNTIME.forget_unadmitted([
        rid for rid in list(RUNTIME.requests)
        if rid not in waiting and (recv_req.abort_all or rid.startswith(recv_req.rid))
    ])
    return result


def running_offset(original, adder, req, *args, **kwargs):
    """AROUND PrefillAdder._get_running_request_total_token_offset."""
    if req.rid in RUNTIME.requests:
        return 0
    return original(adder, req, *args, **kwargs)
