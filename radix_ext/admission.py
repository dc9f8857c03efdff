"""Admit a compressed request by its compressed ceiling.

Token pool: a compressed request's generated tokens live in the compressed
region (decode_slots.py), so in the pool it needs only its private prompt.
SGLang's PrefillAdder reserves `prompt + min(max_new_tokens, clip)` for a new
request and `remaining new tokens x new_token_ratio` for each running one,
and `init_req_max_new_tokens` clips max_new_tokens to the pool size. For
compressed requests these hooks make the reservation `prompt + page` and
bound max_new_tokens by the context length only.

Region: a request is admitted only when its ceiling (the most pages its
policy can hold: private prompt, budget and the page slack) fits next to the
running requests' ceilings; otherwise it waits in SGLang's queue until a
request ends. Compressed requests take region room first come first served;
requests behind them that need no region room (`full`) still pass. One that
could never fit is refused at once (400 naming kv_policy); past SGLang's
--max-queued-requests, new requests get SGLang's 503.
"""

from __future__ import annotations

from contextlib import contextmanager

from sglang.srt.managers.schedule_policy import AddReqResult

from . import lifecycle
from .runtime import RUNTIME

#: SGLang's default when a request names no max_new_tokens.
_UNBOUNDED = 1 << 30


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
        # It reads the radix-matched prefix. A prompt it compresses never
        # enters the tree; one it keeps is inserted like a `full` request's
        # (plugin.keep_chunk_progress), its generated tokens never.
        req.skip_radix_cache_insert = RUNTIME.requests[req.rid].private_prompt_in_region
        return True
    return False


def init_max_new_tokens(original, scheduler, req, *args, **kwargs):
    """AROUND Scheduler.init_req_max_new_tokens: classify, then for compressed
    requests bound max_new_tokens by the context, not the pool size."""
    params = req.sampling_params
    requested, requested_min = params.max_new_tokens, params.min_new_tokens
    try:
        compressed = _admit(req)
    except ValueError as exc:  # KVPolicyError: a bad spec sent straight to the engine
        req.set_finish_with_abort(str(exc))  # "kv_policy.<field>: why"
        return original(scheduler, req, *args, **kwargs)
    result = original(scheduler, req, *args, **kwargs)
    if compressed:
        # SGLang's clip also bounds by the pool size; a compressed request's
        # length is bounded by the context only (req_to_token rows are
        # context-wide, and its generated tokens take no pool slot). Its other
        # bounds stay: SGLANG_MAX_NEW_TOKENS_LIMIT, and min_new_tokens never
        # above max_new_tokens (else EOS stays suppressed to the end).
        wanted = requested if requested is not None else _UNBOUNDED
        limit = scheduler.max_new_tokens_limit
        if limit is not None and limit > 0:
            wanted = min(wanted, limit)
        room = scheduler.model_config.context_len - 1 - len(req.origin_input_ids) - 1
        params.max_new_tokens = max(0, min(wanted, room))
        params.min_new_tokens = min(requested_min, params.max_new_tokens)
        too_big = RUNTIME.exceeds_region(RUNTIME.requests[req.rid], params.max_new_tokens)
        if too_big:
            # It would wait forever; SGLang then ends it after a one-token prefill.
            lifecycle.forget([req.rid])
            req.set_finish_with_abort(too_big)
    lifecycle.publish_live()
    return result


def add_request_to_queue(original, scheduler, req, *args, **kwargs):
    """AROUND Scheduler._add_request_to_queue: retracted requests come back
    here without init_req_max_new_tokens; classify them again.

    A retracted compressed request re-prefills its prompt plus everything it
    generated, and its generated tokens were bounded by the context, not by
    the pool or the region. When that re-prefill can never fit (more tokens
    than the whole pool holds, or a ceiling above the whole region) it would
    wait forever, so it ends here with a 503 naming the reason. Keeping its
    region pages across retraction would avoid this but needs the page
    manager (issue 7 item 1); until then, bounded and explicit beats stuck.
    One that fits eventually waits without blocking others (add_one_req_by_ceiling)."""
    try:
        compressed = _admit(req)
    except ValueError as exc:
        req.set_finish_with_abort(str(exc))  # "kv_policy.<field>: why"
        compressed = False
    if compressed and req.output_ids:
        why = _never_refits(scheduler, req)
        if why:
            lifecycle.forget([req.rid])
            RUNTIME.pop_usage(req.rid)  # its usage record of the retraction; nothing will report it
            lifecycle.send_abort(scheduler, req, why)
            return None
    lifecycle.publish_live()
    return original(scheduler, req, *args, **kwargs)


def _never_refits(scheduler, req):
    """Why a retracted compressed request can never be prefilled again, or None."""
    tokens = len(req.origin_input_ids) + len(req.output_ids)
    # The bound SGLang's own max_new_tokens clip keeps for any request.
    pool = scheduler.max_total_num_tokens - scheduler.page_size - 1
    if tokens > pool:
        return (f"kv_policy: request retracted after {len(req.output_ids)} tokens cannot resume: its prompt "
                f"and output ({tokens} tokens) exceed the token pool ({pool} tokens) it must be "
                "prefilled into again; retry with a lower max_tokens")
    remaining = max(0, req.sampling_params.max_new_tokens - len(req.output_ids))
    too_big = RUNTIME.exceeds_region(RUNTIME.requests[req.rid], remaining)
    if too_big:
        return f"request retracted after {len(req.output_ids)} tokens cannot resume: {too_big}"
    return None


def _private_prompt_and_new_tokens(req) -> tuple[int, int]:
    """Tokens the request will store privately at prefill (a retracted
    request re-prefills its outputs too) and the tokens it may still generate."""
    private = len(req.origin_input_ids) + len(req.output_ids) - len(req.prefix_indices)
    return private, max(0, req.sampling_params.max_new_tokens - len(req.output_ids))


def add_one_req_by_ceiling(original, adder, req, *args, **kwargs):
    """AROUND PrefillAdder.add_one_req: a compressed request waits until its
    region ceiling fits, and reserves only its private prompt in the pool.

    Waiting returns CONTINUE without adding it: SGLang's loop in
    get_new_batch_prefill stops at any other result (and NO_TOKEN also marks
    the batch full), which would hold back `full` requests behind it that fit
    the pool. Compressed requests behind it wait too in this pass, so region
    room goes first come first served and a large ceiling is not starved."""
    compressed = RUNTIME.requests.get(req.rid)
    if compressed is None:
        return original(adder, req, *args, **kwargs)
    if req.to_finish is not None:
        # Refused after classification (e.g. prompt too long): it runs one
        # plain token and ends, like any refused request.
        lifecycle.forget([req.rid])
        return original(adder, req, *args, **kwargs)
    if getattr(adder, _REGION_WAIT, False):
        return AddReqResult.CONTINUE
    private, new_tokens = _private_prompt_and_new_tokens(req)
    if not RUNTIME.fits(compressed, private, new_tokens):
        setattr(adder, _REGION_WAIT, True)
        return AddReqResult.CONTINUE
    with _no_new_tokens_reserved(req):
        result = original(adder, req, *args, **kwargs)
    if adder.can_run_list and adder.can_run_list[-1] is req:
        RUNTIME.reserve(compressed, private, new_tokens)
    return result


#: Set on a PrefillAdder (one per scheduling pass) once a compressed request
#: waits for region room; later compressed requests of the pass wait behind it.
_REGION_WAIT = "_kvsieve_region_wait"


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
    lifecycle.publish_live()
    return result


def running_offset(original, adder, req, *args, **kwargs):
    """AROUND PrefillAdder._get_running_request_total_token_offset."""
    if req.rid in RUNTIME.requests:
        return 0
    return original(adder, req, *args, **kwargs)
