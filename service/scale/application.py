"""The Serve application built from settings: Ingress -> EngineReplica (and
the metrics hub), with replica count or autoscaling from settings.ray."""

from __future__ import annotations

from ray import serve

from kvsieve.service.config import Settings

from .hub import MetricsHub
from .ingress import Ingress
from .replica import EngineReplica


def runtime_env(settings: Settings, metrics_dir: str) -> dict:
    env = {
        # Multiprocess mode from the first import on (each process then moves
        # to a directory of its own, see replica._own_metrics_dir).
        "PROMETHEUS_MULTIPROC_DIR": metrics_dir,
        "PYTHONUNBUFFERED": "1",
    }
    if settings.engine.device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    # The kvsieve settings travel as the deployments' arguments; the engine's
    # own environment knobs (KVSIEVE_REGION_*, ...) travel as they are.
    for name, value in __import__("os").environ.items():
        if name.startswith("KVSIEVE_") and name != "KVSIEVE_CONFIG":
            env[name] = value
    return {"env_vars": env}


def engine_deployment_options(settings: Settings, metrics_dir: str) -> dict:
    ray_cfg = settings.ray
    options: dict = {
        "name": "EngineReplica",
        "max_ongoing_requests": ray_cfg.max_ongoing_requests,
        "graceful_shutdown_timeout_s": ray_cfg.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": 1.0,
        "health_check_period_s": ray_cfg.health_check_period_s,
        "health_check_timeout_s": 30.0,
        "ray_actor_options": {
            "num_cpus": ray_cfg.num_cpus_per_replica,
            "num_gpus": ray_cfg.num_gpus_per_replica,
            "runtime_env": runtime_env(settings, metrics_dir),
        },
    }
    if ray_cfg.engine_resources:
        options["ray_actor_options"]["resources"] = dict(ray_cfg.engine_resources)
    if ray_cfg.routing == "prefix":
        options["request_router_config"] = {
            "request_router_class": "kvsieve.service.scale.routing:PrefixAffinityRouter",
            "request_router_kwargs": {"prefix_tokens": ray_cfg.prefix_tokens},
        }
    if ray_cfg.autoscaling is not None:
        a = ray_cfg.autoscaling
        options["autoscaling_config"] = {
            "min_replicas": a.min_replicas,
            "max_replicas": a.max_replicas,
            "initial_replicas": max(a.min_replicas, 1),
            "target_ongoing_requests": a.target_ongoing_requests,
            "upscale_delay_s": a.upscale_delay_s,
            "downscale_delay_s": a.downscale_delay_s,
            "look_back_period_s": a.look_back_period_s,
            # At least two reports of the ongoing requests within the window.
            "metrics_interval_s": min(10.0, a.look_back_period_s / 2),
        }
    else:
        options["num_replicas"] = ray_cfg.replicas or 1
    return options


#: Seconds the ingress outlives the drain on stop: it ends the last streams
#: itself (server_shutting_down, then [DONE]) before Serve would kill it.
INGRESS_STOP_MARGIN_S = 15.0


def build_app(settings: Settings, metrics_dir: str):
    light = {"num_cpus": 0, "runtime_env": runtime_env(settings, metrics_dir)}
    if settings.ray.ingress_resources:
        light["resources"] = dict(settings.ray.ingress_resources)
    hub = serve.deployment(MetricsHub, name="MetricsHub", num_replicas=1, ray_actor_options=light).bind()
    engine = serve.deployment(EngineReplica, **engine_deployment_options(settings, metrics_dir)).bind(
        settings.engine.model_dump(), hub)
    ingress = serve.deployment(
        Ingress, name="Ingress", num_replicas=settings.ray.ingress_replicas,
        # The ingress only tokenizes and relays: Serve's default cap of 5
        # concurrent requests per replica would throttle the whole service.
        max_ongoing_requests=max(64, 4 * settings.ray.max_ongoing_requests),
        graceful_shutdown_timeout_s=settings.ray.graceful_shutdown_timeout_s + INGRESS_STOP_MARGIN_S,
        graceful_shutdown_wait_loop_s=1.0,
        ray_actor_options=light,
    )
    return ingress.bind(engine, hub, settings.model_dump())


def app_builder(args: dict):
    """Application builder for `serve run` and KubeRay's RayService
    (import_path `kvsieve.service.scale.application:app_builder`): settings
    from the environment and $KVSIEVE_CONFIG, with the application's `args`
    ({section: {field: value}}) on top. Each replica keeps its metrics in a
    directory of its own under /tmp/kvsieve-prom on its node."""
    from kvsieve.service.config import load_settings

    return build_app(load_settings(**(args or {})), "/tmp/kvsieve-prom")
