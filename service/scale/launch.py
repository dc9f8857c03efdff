"""`kvsieve serve --replicas N` (or settings.ray): start Ray in-process, or
join the cluster at settings.ray.address, run the Serve application, and
take it down on SIGINT/SIGTERM.

Stop, every step bounded (a stop must end on a loaded machine too):
1. drain: the ingresses refuse new requests and let running ones finish
   for ray.graceful_shutdown_timeout_s; the rest end with a
   `server_shutting_down` error event (then [DONE]) and are aborted in their
   engines (KV pages back). A second signal ends the drain at once.
2. the app is deleted (nothing is in flight any more, so replicas stop at
   once and shut their SGLang engines down);
3. Serve and Ray are shut down when this process started them;
4. whatever process of this one's tree is still alive is killed;
5. the process exits 0, without waiting for threads a library left behind.
A step that overruns its budget is logged with every thread's stack and the
stop goes on; a watchdog ends the process (exit 1) if the whole stop does not
end within its total budget.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Callable, Optional

from kvsieve.service.config import Settings

logger = logging.getLogger("kvsieve")

#: Past the drain: seconds for the last error events to flush and the
#: ingresses to report nothing in flight.
DRAIN_SETTLE_S = 10.0
#: Budgets of the steps after the drain.
DELETE_S, SERVE_SHUTDOWN_S, RAY_SHUTDOWN_S, REAP_S = 45.0, 30.0, 30.0, 10.0


def _node_ip(settings: Settings) -> Optional[str]:
    """This process's node address: loopback for Ray started here or a
    cluster reached on loopback (service/scale/loopback.py); else Ray's
    own choice."""
    from .loopback import is_loopback

    if settings.ray.node_ip_address:
        return settings.ray.node_ip_address
    address = settings.ray.address
    if not address:
        return "127.0.0.1"
    if address.startswith("ray://"):
        return None  # Ray Client: no node of its own
    if address == "auto":
        from ray._private.services import get_ray_address_from_environment

        address = get_ray_address_from_environment("auto", None) or ""
    host = address.rsplit(":", 1)[0]
    return "127.0.0.1" if host and is_loopback(host) else None


def _start_ray(settings: Settings) -> bool:
    """True when this process started Ray (and so shuts it down)."""
    from .loopback import is_loopback, keep_loopback

    node_ip = _node_ip(settings)
    if node_ip is not None and is_loopback(node_ip):
        keep_loopback()
    import ray

    quiet = {"log_to_driver": settings.server.log_level in ("debug", "info"), "logging_level": logging.WARNING}
    if node_ip is not None:
        quiet["_node_ip_address"] = node_ip
    if settings.ray.address:
        ray.init(address=settings.ray.address, **quiet)
        return False
    ray_cfg = settings.ray
    most = ray_cfg.autoscaling.max_replicas if ray_cfg.autoscaling else (ray_cfg.replicas or 1)
    # Logical CPUs for the replicas' reservations; the ingress and hub take none.
    num_cpus = max(int(most * ray_cfg.num_cpus_per_replica + 0.999), 1)
    resources = {name: most * amount for name, amount in ray_cfg.engine_resources.items()}
    # A cluster of its own: without address="local" ray.init joins any Ray
    # instance it finds running on this machine (or at $RAY_ADDRESS).
    if os.environ.pop("RAY_ADDRESS", None):
        logger.warning("ray.address is not set: Ray starts in-process; $RAY_ADDRESS is ignored")
    ray.init(address="local", num_cpus=num_cpus, num_gpus=int(most * ray_cfg.num_gpus_per_replica + 0.999),
             resources=resources or None, include_dashboard=False, **quiet)
    return True


def _bounded(what: str, fn: Callable[[], object], budget_s: float) -> bool:
    """fn() in a thread of its own, waited for at most budget_s: True when
    it ended in time without an error. An overrun is logged with every
    thread's stack (the one stuck included) and the stop goes on."""
    done = threading.Event()
    errors: list[BaseException] = []

    def run():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported, the stop goes on
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name=f"kvsieve-stop-{what}", daemon=True).start()
    if not done.wait(budget_s):
        logger.warning("stop: %s did not end within %.0f s; going on. Threads:", what, budget_s)
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
        return False
    if errors:
        logger.warning("stop: %s failed: %s: %s", what, type(errors[0]).__name__, errors[0])
    return not errors


class _Stop:
    """SIGINT/SIGTERM: the first starts the stop, a second ends the drain now.
    Plain flags, polled: a handler takes no lock the interrupted main thread
    may hold, and the main thread never blocks without a timeout (it would
    not run the handler of a signal the kernel handed to another thread)."""

    def __init__(self):
        self.requested = False
        self.hurry = False

    def __call__(self, signum, frame) -> None:
        if self.requested:
            self.hurry = True
        self.requested = True

    def wait(self) -> None:
        while not self.requested:
            time.sleep(0.5)


def _drain(settings: Settings, stop: _Stop) -> None:
    from ray import serve

    grace = settings.ray.graceful_shutdown_timeout_s
    hub = serve.get_deployment_handle("MetricsHub", settings.ray.app_name)
    hub.begin_drain.remote(grace).result(timeout_s=10)
    started = time.monotonic()
    hurried = False
    status: dict = {}
    while time.monotonic() - started < grace + DRAIN_SETTLE_S:
        if stop.hurry and not hurried:
            hurried = True
            logger.warning("stop: second signal, ending the requests in flight now")
            hub.begin_drain.remote(0).result(timeout_s=10)
        status = hub.drain_status.remote().result(timeout_s=10)
        if status["ingresses"] and status["draining"] == status["ingresses"] and status["in_flight"] == 0:
            logger.warning("stop: drained in %.1f s", time.monotonic() - started)
            return
        time.sleep(0.5)
    logger.warning("stop: %s request(s) still in flight %.0f s after the drain began", status.get("in_flight"),
                   time.monotonic() - started)


def _delete_app(name: str, timeout_s: float) -> None:
    from ray import serve

    serve.delete(name, _blocking=False)
    deadline = time.monotonic() + timeout_s
    while name in serve.status().applications:
        if time.monotonic() > deadline:
            raise TimeoutError(f"app {name!r} still deleting after {timeout_s:.0f} s")
        time.sleep(0.5)


def _reap_descendants(budget_s: float) -> None:
    """Kill what is left of this process's tree (Ray's processes, SGLang's)."""
    import psutil

    left = psutil.Process().children(recursive=True)
    if not left:
        return
    names = []
    for proc in left:
        try:
            names.append(f"{proc.pid} {proc.name()}")
            proc.terminate()
        except psutil.Error:
            pass
    logger.warning("stop: %d process(es) outlived the shutdown, ending them: %s", len(left), ", ".join(names))
    _, alive = psutil.wait_procs(left, timeout=budget_s / 2)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=budget_s / 2)


def _watchdog(budget_s: float) -> None:
    def fire():
        logger.error("stop: still not done after %.0f s; threads follow, then exit 1", budget_s)
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
        _reap_descendants(REAP_S)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(budget_s, fire)
    timer.daemon = True
    timer.start()


def serve_ray(settings: Settings) -> None:
    from ray import serve

    from .application import build_app

    started = time.monotonic()
    stop = _Stop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    own_ray = _start_ray(settings)
    metrics_dir = tempfile.mkdtemp(prefix="kvsieve-prom-ray-")
    # Ray may have put its own handlers in place while starting.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    try:
        serve.start(proxy_location=settings.ray.proxy_location,
                    http_options={"host": settings.server.host, "port": settings.server.port})
        serve.run(build_app(settings, metrics_dir), name=settings.ray.app_name, route_prefix="/",
                  blocking=False)
        logger.warning("Ray Serve app %r up in %.1f s on http://%s:%d", settings.ray.app_name,
                       time.monotonic() - started, settings.server.host, settings.server.port)
        stop.wait()
        failed = None
    except Exception as exc:  # start-up failed: the same teardown, then exit non-zero
        logger.exception("Ray Serve app failed; stopping")
        failed = exc
    grace = 0.0 if failed else settings.ray.graceful_shutdown_timeout_s
    _watchdog(grace + DRAIN_SETTLE_S + DELETE_S + SERVE_SHUTDOWN_S + RAY_SHUTDOWN_S + 2 * REAP_S + 15)
    logger.warning("stopping: requests in flight may finish for up to %.0f s", grace)
    stopping = time.monotonic()
    if not failed:
        _bounded("drain", lambda: _drain(settings, stop), grace + DRAIN_SETTLE_S + 15)
    _bounded("app delete", lambda: _delete_app(settings.ray.app_name, DELETE_S), DELETE_S + 5)
    if own_ray:
        _bounded("serve shutdown", serve.shutdown, SERVE_SHUTDOWN_S)
    import ray

    _bounded("ray shutdown", ray.shutdown, RAY_SHUTDOWN_S)
    _reap_descendants(REAP_S)
    logger.warning("Ray Serve app stopped in %.1f s (pid %d)", time.monotonic() - stopping, os.getpid())
    # Threads a library left running (a pool blocked on a Ray call that
    # now never returns) would hold the interpreter's exit forever.
    if failed:
        raise SystemExit(1)
    stuck = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
             and t.is_alive()]
    if stuck:
        logger.warning("stop: not waiting for threads %s", ", ".join(stuck))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
