"""A fault inside one policy's code ends that policy's requests, never the
scheduler.

Policy code runs inside SGLang's scheduler process: at admission
(begin_request), while a step is built (step_inputs, deciding_rows, adaptive
budgets, TBQ formats), inside the forward (the prompt probe, select_prefill,
select_decode, observe_decode) and on the host after it (token observers).
An exception there used to unwind through SGLang's event loop and take every
request of the server with it. Each of those call sites runs under
`guard(stage, policy, requests)`: the exception is logged, the requests of
the failing policy group end with an error (RUNTIME.fail: HTTP 500 naming the
policy, an error event on a stream; their rows get zeros until SGLang ends
them and their pages come back on release), the count goes to
kvsieve_request_errors_total{policy, stage}, and the caller goes on without
that group's result. Every other request of the batch is untouched.

Out of memory in a decision is retried in smaller row chunks first
(backend._group_pass); only a single row that still does not fit fails.
"""

from __future__ import annotations

import logging
import traceback
from contextlib import contextmanager

import torch

from . import head_parallel, metrics

logger = logging.getLogger(__name__)

#: Stages a fault is counted under (the metric's `stage` label).
STAGES = ("admit", "step_inputs", "budgets", "tbq_format", "probe", "prefill", "decide", "observe", "tokens",
          "usage", "logits")

#: Faults isolated so far in this process. The region graphs compare it
#: around a capture: a pass in which a group failed is not kept as a graph
#: (its replay would skip that group's decision for later rows).
count = 0


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def capturing() -> bool:
    """Whether the current CUDA stream is recording a graph: a fault there
    must abort the capture (region_graphs drops it), not be absorbed into it."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def fail_requests(requests, policy_name: str, stage: str, exc: BaseException) -> None:
    """End `requests` (CompressedRequest, host) with an error naming the policy and stage."""
    from .runtime import RUNTIME

    global count
    count += 1
    message = f"kvsieve: policy {policy_name!r} failed in {stage}: {type(exc).__name__}: {exc}"
    logger.error("%s (%d request(s) ended)\n%s", message, len(requests),
                 "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    ended = 0
    for req in requests:
        if req is None or req.overflowed:
            continue
        RUNTIME.fail(req, message)
        ended += 1
    if ended and head_parallel.reports_usage():  # once, not once per TP rank
        metrics.REQUEST_ERRORS.labels(policy_name, stage).inc(ended)


@contextmanager
def guard(stage: str, policy_name: str, requests, passes: tuple = ()):
    """Run policy code; on an exception end `requests` with an error and
    raise PolicyFault, which the caller catches to go on without the result.
    Exceptions of the types in `passes` (at admission: KVPolicyError, the
    client's bad input, answered with a 400 naming the field) propagate as
    they are, and so does anything inside a CUDA graph capture."""
    try:
        yield
    except (PolicyFault, *passes):
        raise
    except Exception as exc:  # noqa: BLE001 - any fault of policy code stays with its requests
        if capturing():
            raise
        fail_requests(requests, policy_name, stage, exc)
        raise PolicyFault(policy_name, stage) from exc


class PolicyFault(Exception):
    """Raised by guard() after the failing group's requests were ended."""

    def __init__(self, policy_name: str, stage: str):
        super().__init__(f"policy {policy_name!r} failed in {stage}")
        self.policy_name = policy_name
        self.stage = stage
