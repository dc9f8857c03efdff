"""Runtime entries of requests SGLang drops before they run.

A compressed request gets its runtime entry (RUNTIME.requests[rid], holding
SGLang's Req) when the scheduler classifies it (admission.py). Requests that
run end in release_kv_cache, which ends the entry; these hooks cover the
scheduler's other exits, where a request leaves without ever running:

- priority validation (`_set_or_validate_priority` returns False),
- the queue limit (`_abort_on_queued_limit`: the incoming request, or with
  priority scheduling a waiting one it displaces),
- the waiting timeout (`_abort_on_waiting_timeout`, SGLANG_REQ_WAITING_TIMEOUT),
- an explicit abort of a queued request (admission.forget_aborted_in_queue),
- a retracted request that can never be prefilled again (admission.py).

`kvsieve_compressed_requests_live` publishes len(RUNTIME.requests): after
load it returns to 0, or an exit path is missing.
"""

from __future__ import annotations

from http import HTTPStatus

from . import metrics
from .runtime import RUNTIME

_published = -1  # last value written to the gauge (writes go to a shared mmap)


def publish_live() -> None:
    """Write the live-entry gauge if it changed; cheap enough for every step."""
    global _published
    live = len(RUNTIME.requests)
    if live != _published:
        metrics.record_compressed_requests_live(live)
        _published = live


def forget(rids) -> None:
    """End the entries of requests that left before admission (no pages, no
    forward yet), through RUNTIME.end so the policy's end_request runs too."""
    dropped = False
    for rid in rids:
        entry = RUNTIME.requests.get(rid)
        if entry is not None and not entry.reserved_pages and entry.prefix_len < 0:
            RUNTIME.end(rid)
            dropped = True
    if dropped:
        publish_live()


def send_abort(scheduler, req, message: str, status: HTTPStatus = HTTPStatus.SERVICE_UNAVAILABLE) -> None:
    """End a request that is in no queue, as SGLang's queue limit does: the
    tokenizer side finishes its stream with this error."""
    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    reason = FINISH_ABORT(message, status, "ServiceUnavailable" if status == 503 else "BadRequestError")
    scheduler.ipc_channels.send_to_tokenizer.send_output(AbortReq(finished_reason=reason.to_json(), rid=req.rid), req)


# ----- hooks on SGLang's Scheduler (registered in plugin.py) -----------------

def forget_if_priority_refused(result, scheduler, req, *args, **kwargs):
    """AFTER Scheduler._set_or_validate_priority: False means SGLang answered
    the request with an abort and never queues it."""
    if result is False:
        forget([req.rid])
    return result


def forget_if_queue_limit_refused(original, scheduler, req, *args, **kwargs):
    """AROUND Scheduler._abort_on_queued_limit: True means the incoming
    request was refused; with priority scheduling a waiting request may be
    popped from the queue instead (the queue is copied only at the limit)."""
    limit = scheduler.max_queued_requests
    displaces = scheduler.enable_priority_scheduling and limit is not None \
        and len(scheduler.waiting_queue) + 1 > limit
    queue = list(scheduler.waiting_queue) if displaces else None
    refused = original(scheduler, req, *args, **kwargs)
    if refused:
        forget([req.rid])
    elif queue is not None:
        _forget_left_queue(scheduler, queue)
    return refused


def forget_timed_out(original, scheduler, *args, **kwargs):
    """AROUND Scheduler._abort_on_waiting_timeout, which rebuilds the
    waiting queue without the requests it timed out."""
    queue = scheduler.waiting_queue
    before = len(queue)
    result = original(scheduler, *args, **kwargs)
    if len(scheduler.waiting_queue) < before:
        _forget_left_queue(scheduler, queue)
    return result


def _forget_left_queue(scheduler, old_queue) -> None:
    """Forget compressed requests of `old_queue` that are no longer waiting.
    Only on the rare path where a drop happened: O(queue)."""
    still = {id(req) for req in scheduler.waiting_queue}
    forget([req.rid for req in old_queue if id(req) not in still])
