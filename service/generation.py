"""One API request's run through the engine: policy, prompt checks, sampling
parameters, streaming deltas, abort on disconnect, usage and metrics."""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from kvsieve.policies import KVPolicySpec
from kvsieve.radix_ext.usage import full_kv_usage, last_kv_usage

from .errors import APIError, bad_request
from .metrics import RequestMetrics


@dataclass
class Job:
    """A validated request, ready for the engine."""

    kind: str  # "chat" or "completion"
    input_ids: list[int]
    sampling_params: dict[str, Any]
    policy: KVPolicySpec
    stream: bool
    return_token_ids: bool
    model: str
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    #: kv_policy "auto": how the policy was chosen (reported as kv_usage.auto).
    auto: Optional[dict] = None


@dataclass
class Delta:
    """New output since the previous Delta of the same job."""

    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    usage: Optional[dict] = None
    kv_usage: Optional[dict] = None


def build_sampling_params(req, max_new_tokens: int, policy: KVPolicySpec) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "ignore_eos": req.ignore_eos,
        # The policy always travels to the scheduler, `full` included, so the
        # engine reports usage for every request.
        "custom_params": {"kv_policy": policy.to_custom_params()},
    }
    if req.stop_list():
        params["stop"] = req.stop_list()
    if req.seed is not None:
        params["sampling_seed"] = req.seed
    return params


def resolve_max_tokens(requested: Optional[int], prompt_len: int, context_len: int, prompt_param: str) -> int:
    if prompt_len >= context_len:
        raise bad_request(
            f"{prompt_param}: the prompt is {prompt_len} tokens, the model's context is {context_len}",
            param=prompt_param,
            code="context_length_exceeded",
        )
    room = context_len - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise bad_request(
            f"max_tokens: {requested} new tokens do not fit: the prompt is {prompt_len} tokens "
            f"and the context {context_len} (at most {room})",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


#: Engine-side kv_policy errors (radix_ext) start with the field they concern.
_ENGINE_FIELD_ERROR = re.compile(r"^(kv_policy[\w.\[\]]*): ")


def _finish_reason(meta_info: dict) -> Optional[str]:
    reason = meta_info.get("finish_reason")
    if not reason:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    if kind == "abort":
        # SGLang aborts with a status code for bad input it detects itself.
        details = reason if isinstance(reason, dict) else {}
        status = int(details.get("status_code") or 500)
        message = details.get("message") or "unknown reason"
        field = _ENGINE_FIELD_ERROR.match(message)
        raise APIError(
            status,
            f"request aborted by the engine: {message}",
            param=field.group(1) if field else None,
            type_="invalid_request_error" if status < 500 else "server_error",
        )
    return "length" if kind == "length" else "stop"


def _usage(job: Job, meta_info: dict) -> tuple[dict, dict]:
    prompt_tokens = int(meta_info.get("prompt_tokens", len(job.input_ids)))
    completion_tokens = int(meta_info.get("completion_tokens", 0))
    cached = int(meta_info.get("cached_tokens", 0))
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    kv_usage = last_kv_usage(meta_info)
    if kv_usage is None:
        # The engine's plugin reports once per token; a request that ended
        # before its first token has no record yet.
        kv_usage = full_kv_usage(job.policy.name, prompt_tokens, cached, completion_tokens)
    kv_usage = dict(kv_usage)
    if job.policy.preset:
        kv_usage["preset"] = job.policy.preset
    if job.auto is not None:
        kv_usage["auto"] = job.auto
    return usage, kv_usage


async def run_job(engine, job: Job) -> AsyncIterator[Delta]:
    """Yield the job's output as deltas; the engine request is aborted if the
    consumer stops early (client gone, error), and metrics are recorded."""
    metrics = RequestMetrics(job.policy.name, time.monotonic())
    status = "error"
    sent_text = ""
    sent_ids = 0
    try:
        async for chunk in engine.generate(job.input_ids, job.sampling_params, job.rid):
            meta = chunk["meta_info"]
            ids = list(chunk.get("output_ids") or [])
            text = chunk.get("text") or ""
            finish = _finish_reason(meta)
            prompt_tokens = int(meta.get("prompt_tokens", len(job.input_ids)))
            metrics.on_progress(time.monotonic(), prompt_tokens + len(ids), len(ids))
            delta = Delta(
                text=text[len(sent_text) :] if text.startswith(sent_text) else text,
                token_ids=ids[sent_ids:],
            )
            sent_text, sent_ids = text, len(ids)
            if finish is not None:
                delta.finish_reason = finish
                delta.usage, delta.kv_usage = _usage(job, meta)
                status = "ok"
                yield delta
                return
            if delta.text or delta.token_ids:
                yield delta
        raise APIError(500, "the engine ended the request without a finish reason", type_="server_error")
    except BaseException as exc:
        # GeneratorExit / CancelledError: the consumer (client) went away.
        status = "error" if isinstance(exc, Exception) else "aborted"
        raise
    finally:
        if status != "ok":
            engine.abort(job.rid)
        metrics.on_end(time.monotonic(), status, len(job.input_ids))
