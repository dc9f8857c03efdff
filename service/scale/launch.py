"""`kvsieve serve --replicas N` (or settings.ray): start Ray in-process, or
join the cluster at settings.ray.address, run the Serve application, and
take it down on SIGINT/SIGTERM (replicas drain their requests first)."""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
import time

from kvsieve.service.config import Settings

logger = logging.getLogger("kvsieve")


def _start_ray(settings: Settings) -> bool:
    """True when this process started Ray (and so shuts it down)."""
    import ray

    quiet = {"log_to_driver": settings.server.log_level in ("debug", "info"), "logging_level": logging.WARNING}
    if settings.ray.address:
        ray.init(address=settings.ray.address, **quiet)
        return False
    ray_cfg = settings.ray
    most = ray_cfg.autoscaling.max_replicas if ray_cfg.autoscaling else (ray_cfg.replicas or 1)
    # Logical CPUs for the replicas' reservations; the ingress and hub take none.
    num_cpus = max(int(most * ray_cfg.num_cpus_per_replica + 0.999), 1)
    ray.init(num_cpus=num_cpus, num_gpus=int(most * ray_cfg.num_gpus_per_replica + 0.999),
             include_dashboard=False, **quiet)
    return True


def _delete_app(name: str, timeout_s: float) -> None:
    """serve.delete, waiting as long as the drain may take (serve.delete's
    own wait ends after 60 s; a replica still starting its engine cannot
    stop before it is up)."""
    from ray import serve

    serve.delete(name, _blocking=False)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if name not in serve.status().applications:
            return
        time.sleep(1)
    logger.warning("app %r still deleting after %.0f s; stopping anyway", name, timeout_s)


def serve_ray(settings: Settings) -> None:
    from ray import serve

    from .application import build_app

    started = time.monotonic()
    own_ray = _start_ray(settings)
    metrics_dir = tempfile.mkdtemp(prefix="kvsieve-prom-ray-")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": settings.server.host, "port": settings.server.port})
        serve.run(build_app(settings, metrics_dir), name=settings.ray.app_name, route_prefix="/",
                  blocking=False)
        logger.warning("Ray Serve app %r up in %.1f s on http://%s:%d", settings.ray.app_name,
                       time.monotonic() - started, settings.server.host, settings.server.port)
        stop.wait()
        logger.warning("stopping: replicas finish their requests (up to %.0f s)",
                       settings.ray.graceful_shutdown_timeout_s)
        _delete_app(settings.ray.app_name, settings.ray.graceful_shutdown_timeout_s + 120)
    finally:
        if own_ray:
            serve.shutdown()
            import ray

            ray.shutdown()
        logger.warning("Ray Serve app stopped (pid %d)", os.getpid())
