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
        serve.delete(settings.ray.app_name)
    finally:
        if own_ray:
            serve.shutdown()
            import ray

            ray.shutdown()
        logger.warning("Ray Serve app stopped (pid %d)", os.getpid())
