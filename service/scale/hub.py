"""The metrics hub: engine replicas push their Prometheus exposition here
every few seconds; the ingress's /metrics merges them, each sample labelled
with its `replica`. A Serve deployment of one replica, so it works the same
in-process and on a cluster (no node-local files)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

#: A replica that has not pushed for this long is gone (killed, scaled down).
STALE_AFTER_S = 10.0


#: An ingress whose last report is older than this is not known to be
#: drained (a loaded machine can delay a report by seconds)...
INGRESS_STALE_S = 5.0
#: ...and one silent for this long is gone (killed, scaled down).
INGRESS_GONE_S = 30.0

#: Seconds between two reads of Serve's replica states of the engine deployment.
STATES_EVERY_S = 1.0

logger = logging.getLogger("kvsieve.scale")


class MetricsHub:
    """Also the stop's control point: `kvsieve serve` calls begin_drain; every
    ingress replica reports its in-flight requests twice a second and learns
    the drain deadline in the answer (relative seconds: nodes share no clock)."""

    def __init__(self):
        self._texts: dict[str, tuple[float, str]] = {}
        self._drain_at: float | None = None  # time.monotonic() of this process
        self._ingresses: dict[str, tuple[float, bool, int]] = {}  # id -> (stamp, draining, in flight)
        # Serve's view of the engine replicas (STARTING, RUNNING, STOPPING, ...):
        # what the autoscaler decided, before a new replica pushes anything.
        self._engine_states: dict[str, int] = {}
        self._watcher = threading.Thread(target=self._watch_engine_states, name="kvsieve-engine-states",
                                         daemon=True)
        self._watcher.start()

    def _watch_engine_states(self) -> None:
        from ray import serve

        app = serve.get_replica_context().app_name
        failing = False
        while True:
            try:
                deployments = serve.status().applications[app].deployments
                engine = deployments.get("EngineReplica")
                states = engine.replica_states if engine is not None else {}
                self._engine_states = {getattr(state, "value", str(state)): n for state, n in states.items()}
                failing = False
            except Exception as exc:  # the controller restarting must not end the watch
                if not failing:
                    logger.warning("reading Serve's replica states failed: %s", exc)
                failing = True
            time.sleep(STATES_EVERY_S)

    def engine_states(self) -> dict[str, int]:
        return dict(self._engine_states)

    def begin_drain(self, grace_s: float) -> None:
        at = time.monotonic() + max(0.0, grace_s)
        if self._drain_at is None or at < self._drain_at:  # a second signal shortens it
            self._drain_at = at

    def ingress_report(self, ingress: str, draining: bool, in_flight: int) -> float | None:
        """Seconds left to the drain deadline, None while not stopping."""
        self._ingresses[ingress] = (time.monotonic(), draining, in_flight)
        return None if self._drain_at is None else max(0.0, self._drain_at - time.monotonic())

    def drain_status(self) -> dict:
        """Ingresses known, those known to be draining, their requests in
        flight. A late report counts as not draining: an ingress whose
        reports were delayed (it held the only long streams, say) used to
        drop out of the count, and the stop deleted the app under it."""
        now = time.monotonic()
        known = [v for v in self._ingresses.values() if now - v[0] <= INGRESS_GONE_S]
        return {"ingresses": len(known),
                "draining": sum(d and now - stamp <= INGRESS_STALE_S for stamp, d, _ in known),
                "in_flight": sum(n for _, _, n in known)}

    def push(self, replica: str, text: str) -> None:
        self._texts[replica] = (time.monotonic(), text)

    def forget(self, replica: str) -> None:
        self._texts.pop(replica, None)

    def collect(self) -> dict[str, str]:
        now = time.monotonic()
        for replica, (stamp, _) in list(self._texts.items()):
            if now - stamp > STALE_AFTER_S:
                del self._texts[replica]
        return {replica: text for replica, (_, text) in self._texts.items()}


class _Families:
    def __init__(self, families: Iterable[Metric]):
        self._families = list(families)

    def collect(self):
        return self._families


def merge_replica_metrics(local_text: bytes, replica_texts: dict[str, str],
                          engine_states: dict[str, int] | None = None) -> bytes:
    """The ingress's own metrics plus every replica's, with a `replica` label,
    kvsieve_engine_replicas (replicas that pushed recently) and
    kvsieve_serve_engine_replicas{state} (Serve's count by replica state)."""
    merged: dict[str, Metric] = {}

    def add(text: str, replica: str | None) -> None:
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labels = dict(sample.labels)
                if replica is not None:
                    labels["replica"] = replica
                target.samples.append(sample._replace(labels=labels))

    add(local_text.decode(), None)
    for replica, text in sorted(replica_texts.items()):
        add(text, replica)
    count = GaugeMetricFamily("kvsieve_engine_replicas", "Engine replicas that reported metrics in the last 10 s.")
    count.add_metric([], len(replica_texts))
    states = GaugeMetricFamily("kvsieve_serve_engine_replicas",
                               "Engine replicas by Serve's replica state (STARTING, RUNNING, STOPPING, ...).",
                               labels=["state"])
    for state in sorted(set(engine_states or {}) | {"STARTING", "RUNNING", "STOPPING"}):
        states.add_metric([state], (engine_states or {}).get(state, 0))
    registry = CollectorRegistry()
    registry.register(_Families([*merged.values(), count, states]))
    return generate_latest(registry)
