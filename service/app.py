"""The OpenAI-compatible HTTP API (FastAPI).

Routes: POST /v1/chat/completions, POST /v1/completions (stream or not),
GET /v1/models, /health, /metrics. Every bad input is a 400 in OpenAI's
error shape naming the field; nothing a client sends takes the server down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable, Mapping, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from kvsieve.policies import KVPolicyError, parse_kv_policy, policy_names
from kvsieve.policies.catalog import catalog

from .auto_policy import AutoPolicy, is_auto
from .auto_policy import catalog_entry as auto_catalog_entry
from .errors import APIError, bad_request, from_validation_error
from .generation import Job, build_sampling_params, resolve_max_tokens, run_job
from .metrics import GUARD_REJECTIONS, count_rejected, observe_kv_usage, render_metrics
from .presets import BUILTIN_PRESETS, builtin_listing
from .protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)


async def read_json_object(request: Request) -> dict:
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request(f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    return data


def _sse(payload: Any) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


class OpenAIServer:
    """Holds what the routes share: engine, tokenizer, model name, presets."""

    def __init__(self, engine, model_name: str, presets: Optional[Mapping[str, Mapping]] = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.context_length = engine.context_length
        self.model_name = model_name
        self.file_presets = dict(presets or {})
        self.guards = None  # service.guards.Guards: live store presets, caps, timeout
        self.drain_deadline: Optional[float] = None  # see begin_drain
        self._waiting: set = set()  # timeout scopes of requests waiting for their next delta
        # kv_policy "auto" (service/auto_policy.py): points of the calibration
        # artifact this engine cannot run are left out.
        self.auto = AutoPolicy(model_name, usable=self._servable)

    def _servable(self, kv_policy: dict) -> bool:
        try:
            parse_kv_policy(kv_policy, served=self.engine.served_policies)
            return True
        except KVPolicyError:
            return False

    @property
    def presets(self) -> dict:
        # The store's presets (live, service/store_cache.py) win over the file's.
        live = self.guards.presets if self.guards is not None else {}
        return {**self.file_presets, **live} if live else self.file_presets

    async def metrics(self) -> tuple[bytes, str]:
        """/metrics; the Ray Serve ingress adds every engine replica's."""
        return render_metrics()

    def deltas(self, job: Job) -> AsyncIterator:
        """The job's output; the Ray Serve ingress (service/scale) runs it on an engine replica."""
        return observed_deltas(self.engine, job)

    async def _timed(self, job: Job, deltas: AsyncIterator) -> AsyncIterator:
        """`deltas`, ending in a 504 past settings.limits.request_timeout_s (the
        cancelled generator aborts the request in the engine)."""
        timeout = self.guards.settings.limits.request_timeout_s if self.guards is not None else None
        deadline = None if timeout is None else job_started(job) + timeout
        async with aclosing(deltas):  # closing this closes (and aborts) the job at once
            while True:
                # The deadline is a timeout scope in this task, not wait_for:
                # wait_for runs anext in a task of its own, and a client
                # disconnect (Starlette cancels this task, again and again
                # until it ends) could leave that task running while aclosing
                # closes the generator ("aclose(): asynchronous generator is
                # already running"), and the engine request unaborted.
                ends = min((d for d in (deadline, self.drain_deadline) if d is not None), default=None)
                try:
                    async with asyncio.timeout_at(None if ends is None else _loop_time(ends)) as scope:
                        self._waiting.add(scope)  # begin_drain moves it forward
                        try:
                            delta = await anext(deltas)
                        finally:
                            self._waiting.discard(scope)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    # Which deadline ended it is read from the deadlines, not the
                    # clock: the loop fires a timer up to its clock resolution
                    # early, and _loop_time's two clock reads move it earlier
                    # still, so at the drain's own timer monotonic() may not
                    # have reached drain_deadline yet.
                    if self.drain_deadline is not None and (deadline is None or self.drain_deadline <= deadline):
                        raise APIError(503, "the server is shutting down; the request was aborted after the "
                                       "drain period", type_="server_error", code="server_shutting_down") from None
                    GUARD_REJECTIONS.labels("timeout").inc()
                    raise APIError(504, f"the request took longer than {timeout:g} s and was aborted",
                                   type_="timeout", code="request_timeout") from None
                yield delta

    def begin_drain(self, deadline: float) -> None:
        """Stop: requests still running at `deadline` (time.monotonic()) end
        with a `server_shutting_down` error (the Ray Serve ingress's drain)."""
        if self.drain_deadline is not None and self.drain_deadline <= deadline:
            return
        self.drain_deadline = deadline
        for scope in list(self._waiting):
            when = scope.when()
            if when is None or when > _loop_time(deadline):
                scope.reschedule(_loop_time(deadline))

    def policy_label(self, body: dict) -> str:
        """Metrics label of a rejected request: a known policy name, else "invalid"
        (never a client-chosen string: label values must stay a small set)."""
        value = body.get("kv_policy")
        if value is None and isinstance(body.get("extra_body"), dict):
            value = body["extra_body"].get("kv_policy")
        if value is None:
            return "full"
        if isinstance(value, str) and value in self.presets:
            value = self.presets[value].get("name")
        preset = value.get("preset") if isinstance(value, dict) and "name" not in value else None
        if isinstance(preset, str) and preset in self.presets:  # a fuzzed list here raised TypeError: a 500
            value = self.presets[preset]  # {"preset": NAME, ...overrides}
        if isinstance(value, dict):
            value = value.get("name")
        return value if isinstance(value, str) and value in policy_names() else "invalid"

    # ----- request -> Job -------------------------------------------------
    def _check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model", code="model_not_found",
            )

    def _policy(self, req) -> tuple:
        """(the KVPolicySpec to run, the auto report or None)."""
        value, auto = req.kv_policy, None
        try:
            if is_auto(value):
                mirror = self.guards.mirror if self.guards is not None else None
                store, version = (mirror.store, mirror.version) if mirror is not None else (None, None)
                value, auto = self.auto.resolve(value, store, version)
            return parse_kv_policy(value, self.presets, served=self.engine.served_policies), auto
        except KVPolicyError as exc:
            raise bad_request(str(exc), param=exc.field) from None

    def _job(self, kind: str, req, input_ids: list[int], prompt_param: str) -> Job:
        self._check_model(req.model)
        policy, auto = self._policy(req)
        vocab = len(self.tokenizer)
        if not input_ids:  # an empty string tokenizes to nothing; the engine would fail on it
            raise bad_request(f"{prompt_param}: the prompt is empty", param=prompt_param)
        if any(not 0 <= t < vocab for t in input_ids):
            raise bad_request(f"{prompt_param}: token ids must be in [0, {vocab})", param=prompt_param)
        max_new = resolve_max_tokens(req.requested_max_tokens(), len(input_ids), self.context_length, prompt_param)
        if self.guards is not None:
            caps = self.guards.caps
            caps.check_prompt(len(input_ids), prompt_param)
            caps.check_policy(policy)
            param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
            max_new = caps.max_new_tokens(req.requested_max_tokens(), max_new, param)
        return Job(
            kind=kind,
            input_ids=input_ids,
            sampling_params=build_sampling_params(req, max_new, policy),
            policy=policy,
            stream=req.stream,
            return_token_ids=req.return_token_ids,
            model=self.model_name,
            auto=auto,
        )

    def chat_job(self, body: dict) -> Job:
        req = ChatCompletionRequest.model_validate(body)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template may reject a role order, say
            raise bad_request(f"messages: the chat template rejected them: {exc}", param="messages") from None
        input_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return self._job("chat", req, input_ids, "messages")

    def completion_job(self, body: dict) -> Job:
        req = CompletionRequest.model_validate(body)
        input_ids = req.prompt if isinstance(req.prompt, list) else self.tokenizer.encode(req.prompt)
        return self._job("completion", req, list(input_ids), "prompt")

    # ----- Job -> response ------------------------------------------------
    def _envelope(self, job: Job, chunk: bool) -> dict:
        if job.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": f"{'chatcmpl' if job.kind == 'chat' else 'cmpl'}-{job.rid}", "object": obj,
                "created": job.created, "model": job.model}

    async def complete(self, job: Job, request: Request) -> JSONResponse:
        text, token_ids, last = [], [], None
        # aclosing: leaving early (client gone, error) closes run_job at once,
        # which aborts the request in the engine.
        try:
            async with aclosing(self._timed(job, self.deltas(job))) as deltas:
                async for delta in deltas:
                    text.append(delta.text)
                    token_ids.extend(delta.token_ids)
                    last = delta
                    if await request.is_disconnected():
                        _log_disconnect(job, len(token_ids))
                        raise APIError(499, "client disconnected")
        except asyncio.CancelledError:
            _log_disconnect(job, len(token_ids))
            raise
        content = "".join(text)
        if job.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": last.finish_reason}
        else:
            choice = {"index": 0, "text": content, "finish_reason": last.finish_reason, "logprobs": None}
        if job.return_token_ids:
            choice["token_ids"] = token_ids
        body = {**self._envelope(job, chunk=False), "choices": [choice], "usage": last.usage, "kv_usage": last.kv_usage}
        if job.return_token_ids:
            body["prompt_token_ids"] = job.input_ids
        return JSONResponse(body)

    @staticmethod
    def _stream_chunk(envelope: dict, job: Job, delta) -> dict:
        if job.kind == "chat":
            choice = {"index": 0, "delta": {"content": delta.text}, "finish_reason": delta.finish_reason}
        else:
            choice = {"index": 0, "text": delta.text, "finish_reason": delta.finish_reason, "logprobs": None}
        if job.return_token_ids:
            choice["token_ids"] = delta.token_ids
        chunk = {**envelope, "choices": [choice]}
        if delta.finish_reason is not None:  # the last chunk carries the usage
            chunk["usage"] = delta.usage
            chunk["kv_usage"] = delta.kv_usage
        return chunk

    async def stream(self, job: Job) -> AsyncIterator[bytes]:
        envelope = self._envelope(job, chunk=True)
        if job.kind == "chat":
            yield _sse({**envelope, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        tokens = 0
        try:
            async with aclosing(self._timed(job, self.deltas(job))) as deltas:
                async for delta in deltas:
                    tokens += len(delta.token_ids)
                    yield _sse(self._stream_chunk(envelope, job, delta))
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away: Starlette cancels this task (waiting for a
            # delta) or closes this generator (parked at a yield). Either way
            # the job is closed above, which aborts it in the engine; nothing
            # failed, so one line at info, no traceback.
            _log_disconnect(job, tokens)
            raise
        except APIError as exc:
            yield _sse(exc.body())
        except Exception:
            logger.exception("stream %s failed", job.rid)
            yield _sse(APIError(500, "internal error while generating", type_="server_error").body())
        yield b"data: [DONE]\n\n"


def job_started(job: Job) -> float:
    return getattr(job, "started_at", None) or time.monotonic()


def _loop_time(monotonic_deadline: float) -> float:
    """A time.monotonic() deadline on the running loop's clock (asyncio.timeout_at's)."""
    return asyncio.get_running_loop().time() + (monotonic_deadline - time.monotonic())


def _log_disconnect(job: Job, tokens: int) -> None:
    logger.info("client disconnected: request %s aborted after %d tokens", job.rid, tokens)


async def observed_deltas(engine, job: Job) -> AsyncIterator:
    """run_job's deltas, recording the finished request's compression ratio."""
    async with aclosing(run_job(engine, job)) as deltas:
        async for delta in deltas:
            if delta.kv_usage is not None:
                observe_kv_usage(delta.kv_usage)
            yield delta


def create_app(engine, model_name: str, presets: Optional[Mapping[str, Mapping]] = None, *,
               guards=None, server: Optional[OpenAIServer] = None) -> FastAPI:
    """`guards`: service.guards.Guards (default: from the settings, see
    service/config.py); `server`: an OpenAIServer built by the caller (the Ray
    Serve ingress passes its own)."""
    from .guards import GuardMiddleware, Guards
    from .openapi_schema import document_request_bodies

    server = server or OpenAIServer(engine, model_name, presets)
    server.guards = guards if guards is not None else Guards.from_settings()
    app = FastAPI(title="kvsieve")
    app.state.server = server
    app.add_middleware(GuardMiddleware, guards=server.guards)
    document_request_bodies(app, auth=server.guards.settings.auth.enabled)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        logger.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}", type_="server_error").response()

    async def handle(request: Request, make_job: Callable[[dict], Job]) -> Response:
        started = time.monotonic()
        body = await read_json_object(request)
        try:
            job = make_job(body)
        except ValidationError as exc:
            count_rejected(server.policy_label(body))
            raise from_validation_error(exc) from None
        except APIError:
            count_rejected(server.policy_label(body))
            raise
        job.started_at = started  # the request timeout counts from arrival
        if job.stream:
            return StreamingResponse(server.stream(job), media_type="text/event-stream")
        return await server.complete(job, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, server.chat_job)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, server.completion_job)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "kvsieve", "max_model_len": server.context_length,
        }]}

    @app.get("/v1/kv_policies")
    async def kv_policies():
        # `presets`: the user's (file and store); `builtin_presets`: the
        # papers' configurations served here, each setting with its source.
        served, presets = server.engine.served_policies, server.presets
        builtins = {name: entry for name, entry in builtin_listing(served).items() if name in presets}
        users = {name: value for name, value in presets.items() if name not in BUILTIN_PRESETS}
        return {**catalog(served, users), "builtin_presets": builtins, "auto": auto_catalog_entry()}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        data, content_type = await server.metrics()
        return Response(data, media_type=content_type)

    return app
