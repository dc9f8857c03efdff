"""The ingress: kvsieve's OpenAI API (service/app.py, guards included) in
front of the engine replicas. Requests are validated and tokenized here; the
job runs on a replica chosen by Serve (power of two choices on queue length)
and its deltas stream back through a DeploymentHandle."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import AsyncIterator

from ray import serve

from kvsieve.service.app import OpenAIServer, create_app
from kvsieve.service.errors import APIError

from .replica import _own_metrics_dir

logger = logging.getLogger("kvsieve.scale")

#: Seconds between two reports of an ingress to the hub (in flight, drain).
DRAIN_REPORT_S = 0.5


@dataclass
class RemoteEngine:
    """What OpenAIServer reads from an engine, for engines on replicas."""

    tokenizer: object
    context_length: int
    served_policies: frozenset


def _replica_failure(exc: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.serve.exceptions import RayServeException

    return isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError, RayServeException))


class RemoteOpenAIServer(OpenAIServer):
    def __init__(self, engine: RemoteEngine, model_name: str, presets, engine_handle, hub_handle):
        super().__init__(engine, model_name, presets)
        self.engine_handle = engine_handle.options(stream=True)
        self.hub_handle = hub_handle
        self.in_flight = 0

    async def deltas(self, job) -> AsyncIterator:
        if self.drain_deadline is not None:
            raise APIError(503, "the server is shutting down; retry on another instance", type_="server_error",
                           code="server_shutting_down")
        self.in_flight += 1
        try:
            async for delta in self._replica_deltas(job):
                yield delta
        finally:
            self.in_flight -= 1

    async def _replica_deltas(self, job) -> AsyncIterator:
        response = self.engine_handle.run.remote(job)
        finished = False
        try:
            async for delta in response:
                finished = delta.finish_reason is not None
                yield delta
        except APIError:
            finished = True
            raise
        except Exception as exc:
            finished = True
            if not _replica_failure(exc):
                raise
            # The replica died under this request (killed, OOM, node lost):
            # a clean error now; Serve routes new requests to the others.
            logger.warning("request %s lost its engine replica: %s", job.rid, type(exc).__name__)
            raise APIError(503, "the engine replica serving this request failed; retry",
                           type_="server_error", code="replica_failed") from None
        finally:
            if not finished:
                response.cancel()  # client gone or timed out: abort on the replica

    async def metrics(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST

        from kvsieve.service.metrics import render_metrics

        from .hub import merge_replica_metrics

        local, _ = render_metrics()
        try:
            replicas = await self.hub_handle.collect.remote()
            states = await self.hub_handle.engine_states.remote()
        except Exception as exc:
            logger.warning("metrics hub unreachable: %s", exc)
            replicas, states = {}, {}
        return merge_replica_metrics(local, replicas, states), CONTENT_TYPE_LATEST


@serve.ingress()
class Ingress:
    async def __init__(self, engine_handle, hub_handle, settings: dict):
        from transformers import AutoTokenizer

        from kvsieve.service.config import Settings
        from kvsieve.service.guards import Guards

        _own_metrics_dir(f"ingress-{serve.get_replica_context().replica_id.unique_id}")
        self.settings = Settings.model_validate(settings)
        _log_to_stderr(self.settings.server.log_level)
        # Waits for a first engine replica: Serve queues the call until one is up.
        info = await engine_handle.info.remote()
        model_name = info["model_name"]
        engine = RemoteEngine(
            tokenizer=AutoTokenizer.from_pretrained(info["model_path"]),
            context_length=info["context_length"],
            served_policies=frozenset(info["served_policies"]),
        )
        from kvsieve.service.presets import load_presets

        self.guards = Guards.from_settings(self.settings)
        self.server = RemoteOpenAIServer(engine, model_name, load_presets(self.settings.engine.presets_file),
                                         engine_handle, hub_handle)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self._reporter = asyncio.get_running_loop().create_task(self._report_to_hub())
        logger.warning("ingress up (pid %d): %s, context %d", os.getpid(), model_name, engine.context_length)

    async def _report_to_hub(self) -> None:
        """Twice a second: this ingress's requests in flight to the hub, and
        the drain deadline back once `kvsieve serve` stops (launch.py)."""
        while True:
            try:
                server = self.server
                left = await self.server.hub_handle.ingress_report.remote(
                    self.replica, server.drain_deadline is not None, server.in_flight)
                if left is not None and server.drain_deadline is None:
                    logger.warning("ingress %s draining: %d requests in flight, %.0f s to finish",
                                   self.replica, server.in_flight, left)
                if left is not None:
                    server.begin_drain(time.monotonic() + left)
            except Exception as exc:  # the hub restarting must not stop serving
                logger.info("drain report of ingress %s failed: %s", self.replica, exc)
            await asyncio.sleep(DRAIN_REPORT_S)

    def __serve_build_asgi_app__(self):
        app = create_app(None, self.server.model_name, guards=self.guards, server=self.server)
        replica = self.replica

        class _NameTheIngress:
            """x-kvsieve-ingress on every response: which ingress replica answered."""

            def __init__(self, inner):
                self.inner = inner

            async def __call__(self, scope, receive, send):
                async def named(message):
                    if message["type"] == "http.response.start":
                        message = {**message, "headers": [*message.get("headers", []),
                                                          (b"x-kvsieve-ingress", replica.encode())]}
                    await send(message)

                await (self.inner(scope, receive, named) if scope["type"] == "http" else
                       self.inner(scope, receive, send))

        app.add_middleware(_NameTheIngress)
        return app

    def __del__(self):
        self._reporter.cancel()
        self.guards.stop()


def _log_to_stderr(level: str) -> None:
    """kvsieve's log lines at the configured level on this worker's stderr
    (Ray's worker log; the driver's when it forwards worker output)."""
    log = logging.getLogger("kvsieve")
    log.setLevel(level.upper())
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False

