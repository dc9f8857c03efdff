"""The engine replica: one Serve replica owns one SGLang engine (with the
kvsieve plugin) and runs validated jobs from the ingress on it.

Each replica keeps its Prometheus files in a directory of its own and pushes
its exposition (kvsieve_* and SGLang's sglang:*) to the metrics hub. Scale-down
is graceful: Serve stops routing to the replica, waits for its requests for up
to ray.graceful_shutdown_timeout_s, then calls __del__, which shuts the engine
and its processes down.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import AsyncIterator

logger = logging.getLogger("kvsieve.scale")

#: Seconds between two pushes of this replica's metrics to the hub.
PUSH_INTERVAL_S = 2.0


def _own_metrics_dir(replica: str) -> None:
    """Point prometheus_client (and SGLang's processes, started after this)
    at a directory of this replica's own. The deployment's runtime env sets
    PROMETHEUS_MULTIPROC_DIR to a base directory before the process starts,
    which puts prometheus_client in multiprocess mode; values are created
    under the directory named when they are first used."""
    base = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or "/tmp/kvsieve-prom"
    path = os.path.join(base, f"replica-{replica}-{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path


class EngineReplica:
    def __init__(self, engine_config: dict, hub):
        from ray import serve

        from kvsieve.service.config import EngineConfig

        cfg = EngineConfig.model_validate(engine_config)
        self.replica = serve.get_replica_context().replica_id.unique_id
        _own_metrics_dir(self.replica)

        from kvsieve.service.engine import EngineClient, EngineSettings, prepare_process_environment

        prepare_process_environment(cfg.device, cfg.tp_size)
        if cfg.policy_modules:
            from kvsieve.policies import POLICY_MODULES_ENV, load_policy_modules

            os.environ[POLICY_MODULES_ENV] = ",".join(cfg.policy_modules)
            load_policy_modules()
        self.model_path = resolve_model_path(cfg)
        from kvsieve.service.model_name import export_served_model_name, served_model_name

        # The name the ingress serves, for the scheduler's artifact lookups.
        self.model_name = served_model_name(cfg.served_model_name, cfg.model, self.model_path)
        export_served_model_name(self.model_name)
        # SGLang sets signal handlers while starting; a replica's constructor
        # may not run on the main thread, where only that is allowed. Serve
        # owns this process's signals anyway.
        original = signal.signal
        signal.signal = lambda sig, action: signal.SIG_DFL
        try:
            self.engine = EngineClient(EngineSettings(
                model_path=self.model_path,
                device=cfg.device,
                context_length=cfg.context_length,
                max_total_tokens=cfg.max_total_tokens,
                max_running_requests=cfg.max_running_requests,
                max_queued_requests=cfg.max_queued_requests,
                dtype=cfg.dtype,
                tp_size=cfg.tp_size,
                extra={"chunked_prefill_size": cfg.chunked_prefill_size} if cfg.chunked_prefill_size else {},
            ))
        finally:
            signal.signal = original
        self._child_pids = list(self.engine.child_pids)
        self.hub = hub
        self._stop = threading.Event()
        self._pusher = threading.Thread(target=self._push_metrics, name="kvsieve-metrics-push", daemon=True)
        self._pusher.start()
        logger.warning("engine replica %s up (pid %d, context %d)", self.replica, os.getpid(), self.engine.context_length)

    async def info(self) -> dict:
        return {
            "replica": self.replica,
            "pid": os.getpid(),
            "model_path": self.model_path,
            "model_name": self.model_name,
            "context_length": self.engine.context_length,
            "served_policies": sorted(self.engine.served_policies),
        }

    async def run(self, job) -> AsyncIterator:
        """The job's deltas. A cancelled call (client gone, ingress timeout)
        closes the generator, which aborts the request in the engine."""
        from kvsieve.service.app import observed_deltas

        async for delta in observed_deltas(self.engine, job):
            yield delta

    def check_health(self) -> None:
        """Serve calls this every health_check_period_s; a replica whose
        SGLang processes died is replaced."""
        import psutil

        dead = [pid for pid in self._child_pids if not psutil.pid_exists(pid)
                or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE]
        if dead:
            raise RuntimeError(f"SGLang processes {dead} of replica {self.replica} are gone")

    def _push_metrics(self) -> None:
        from kvsieve.service.metrics import render_metrics

        while not self._stop.wait(PUSH_INTERVAL_S):
            try:
                text, _ = render_metrics()
                self.hub.push.remote(self.replica, text.decode()).result(timeout_s=10)
            except Exception as exc:  # the hub restarting must not stop serving
                logger.warning("metrics push of replica %s failed: %s", self.replica, exc)

    def __del__(self) -> None:
        # Also called when __init__ failed part-way (an engine that did not
        # start): shut down whatever was set up.
        if hasattr(self, "_stop"):
            self._stop.set()
            try:
                self.hub.forget.remote(self.replica)
            except Exception:
                pass
        if hasattr(self, "engine"):
            self.engine.shutdown()
            logger.warning("engine replica %s shut down", self.replica)


def resolve_model_path(cfg) -> str:
    from pathlib import Path

    if cfg.model:
        return str(Path(cfg.model).expanduser().resolve())
    from kvsieve.service.default_model import ensure_default_model

    return str(ensure_default_model())
