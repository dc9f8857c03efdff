"""The ingress: kvsieve's OpenAI API (service/app.py, guards included) in
front of the engine replicas. Requests are validated and tokenized here; the
job runs on a replica chosen by Serve (power of two choices on queue length)
and its deltas stream back through a DeploymentHandle."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import AsyncIterator

from ray import serve

from kvsieve.service.app import OpenAIServer, create_app
from kvsieve.service.errors import APIError

from .replica import _own_metrics_dir

logger = logging.getLogger("kvsieve.scale")


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

    async def deltas(self, job) -> AsyncIterator:
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
        except Exception as exc:
            logger.warning("metrics hub unreachable: %s", exc)
            replicas = {}
        return merge_replica_metrics(local, replicas), CONTENT_TYPE_LATEST


@serve.ingress()
class Ingress:
    async def __init__(self, engine_handle, hub_handle, settings: dict):
        from transformers import AutoTokenizer

        from kvsieve.service.config import Settings
        from kvsieve.service.guards import Guards

        _own_metrics_dir(f"ingress-{serve.get_replica_context().replica_id.unique_id}")
        self.settings = Settings.model_validate(settings)
        # Waits for a first engine replica: Serve queues the call until one is up.
        info = await engine_handle.info.remote()
        model_name = self.settings.engine.served_model_name or _default_name(self.settings, info["model_path"])
        engine = RemoteEngine(
            tokenizer=AutoTokenizer.from_pretrained(info["model_path"]),
            context_length=info["context_length"],
            served_policies=frozenset(info["served_policies"]),
        )
        from kvsieve.service.presets import load_presets

        self.guards = Guards.from_settings(self.settings)
        self.server = RemoteOpenAIServer(engine, model_name, load_presets(self.settings.engine.presets_file),
                                         engine_handle, hub_handle)
        logger.warning("ingress up (pid %d): %s, context %d", os.getpid(), model_name, engine.context_length)

    def __serve_build_asgi_app__(self):
        return create_app(None, self.server.model_name, guards=self.guards, server=self.server)

    def __del__(self):
        self.guards.stop()


def _default_name(settings, model_path: str) -> str:
    if settings.engine.model:
        from pathlib import Path

        return Path(model_path).name
    from kvsieve.service.default_model import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME
