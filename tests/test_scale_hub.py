"""The stop's drain bookkeeping of the metrics hub (service/scale/hub.py):
when is every ingress known to be drained. The Ray Serve path around it
runs in tests/test_scale_ray.py; the hub is made here without its Serve
watcher thread, the one part this test is not about."""

from types import SimpleNamespace

from kvsieve.service.scale import hub as hub_module
from kvsieve.service.scale.hub import INGRESS_GONE_S, MetricsHub


def test_a_late_ingress_report_keeps_the_drain_waiting(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(hub_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))  # the hub's clock only
    hub = MetricsHub.__new__(MetricsHub)
    hub._ingresses, hub._drain_at = {}, None
    hub.begin_drain(6)
    assert hub.ingress_report("a", True, 0) == 6.0
    hub.ingress_report("b", True, 6)  # b holds the long streams
    assert hub.drain_status() == {"ingresses": 2, "draining": 2, "in_flight": 6}
    clock[0] += 8  # b's reports are late (a loaded machine); a keeps reporting
    hub.ingress_report("a", True, 0)
    assert hub.drain_status() == {"ingresses": 2, "draining": 1, "in_flight": 6}  # not drained
    clock[0] = 100 + INGRESS_GONE_S + 1  # b is gone
    hub.ingress_report("a", True, 0)
    assert hub.drain_status() == {"ingresses": 1, "draining": 1, "in_flight": 0}
