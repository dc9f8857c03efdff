"""Rows whose logits are not finite end their request, not the server.

A NaN or an infinity in one row's logits (a corrupted KV region, a bad
decision of a policy, an overflow in a kernel) reaches SGLang's sampler,
whose multinomial fails: on a GPU a device-side assert, after which CUDA's
context is lost and the scheduler with every request of the server (an H200
under traffic, docs/gpu-kernels.md); on CPU an exception out of the
scheduler's loop.

So after the model's logits processor, in every forward it runs eagerly:
* rows whose maximum logit is not finite (NaN propagates through the
  maximum; rows of +inf or all -inf too) are set to zero, which the sampler
  draws from without failing;
* their flags are copied to the host without a wait, on the forward's
  stream, so they are there by the time SGLang reads the step's sampled
  tokens;
* the result processor's per-request hook (`end_requests_with_bad_logits`)
  ends those requests with an error: compressed ones through
  faults.fail_requests (HTTP 500 naming the policy, stage "logits"), others
  with SGLang's abort. The token drawn from the zeroed row is the last one
  the request gets.

SGLang's own decode graphs are recorded without the check: they never hold
a compressed row (plugin.graphs_skip_compressed_batches), and a replay runs
no Python to read flags with.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

import torch

from . import faults, head_parallel, metrics
from .runtime import RUNTIME
from .usage import policy_name_of

logger = logging.getLogger(__name__)

#: Attributes set on the step's LogitsProcessorOutput: the host flags, and
#: (on first read) the set of bad row indices.
_FLAGS = "kvsieve_nonfinite_rows"
_BAD = "kvsieve_nonfinite_set"


class NonFiniteLogits(RuntimeError):
    """What a request whose logits were NaN or infinite ends with."""


def install(logits_processor: torch.nn.Module) -> None:
    logits_processor.register_forward_hook(zero_nonfinite_rows)


def zero_nonfinite_rows(module, args, output):
    """Forward hook of the logits processor: zero the rows whose logits are
    not finite and leave their flags, bound for the host, on the output."""
    logits = getattr(output, "next_token_logits", None)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] == 0 or faults.capturing():
        return None
    bad = ~torch.isfinite(logits.amax(dim=-1))
    logits.masked_fill_(bad.unsqueeze(1), 0.0)
    flags = torch.empty(bad.shape, dtype=torch.bool, device="cpu", pin_memory=logits.is_cuda)
    flags.copy_(bad, non_blocking=True)
    setattr(output, _FLAGS, flags)
    return None


def _bad_rows(logits_output) -> frozenset:
    """The step's flagged rows, read once per step on the host, in the
    result processor, outside the forward: `flags` is a host tensor whose
    copy is done (SGLang has waited for the sampled tokens, queued after
    it), so reading it waits for nothing on the GPU."""
    bad = getattr(logits_output, _BAD, None)
    if bad is None:
        flags = getattr(logits_output, _FLAGS, None)
        bad = frozenset(flags.nonzero().flatten().tolist()) if flags is not None and bool(flags.any()) else frozenset()
        setattr(logits_output, _BAD, bad)
    return bad


def end_requests_with_bad_logits(result, processor, i, req, logits_output):
    """AFTER hook of the result processor's per-request step
    (_maybe_collect_customized_info): end request `i` of the batch if its
    logits were not finite."""
    if logits_output is None or i not in _bad_rows(logits_output):
        return result
    message = "the model's logits for this request were not finite (NaN or inf)"
    compressed = RUNTIME.requests.get(req.rid)
    if compressed is not None:
        if not compressed.overflowed:  # not ended already (a fault, or flagged in an earlier step)
            faults.fail_requests([compressed], compressed.spec.name, "logits", NonFiniteLogits(message))
        return result
    abort = _finish_abort()
    if isinstance(req.to_finish, abort) or isinstance(req.finished_reason, abort):
        return result  # flagged in an earlier step, or aborted anyway
    logger.error("kvsieve: request %s: %s; it ends with an error", req.rid, message)
    reason = abort(f"kvsieve: {message}", HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")
    if req.finished():
        req.finished_reason = reason  # it finished with this token, drawn from the zeroed row
    else:
        req.to_finish = reason
    if head_parallel.reports_usage():
        policy = policy_name_of(getattr(req.sampling_params, "custom_params", None)) or "full"
        metrics.REQUEST_ERRORS.labels(policy, "logits").inc()
    return result


def _finish_abort():
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return FINISH_ABORT
