"""The observability stack against a running kvsieve: a real Prometheus
(deploy/prometheus/prometheus.yml, kvsieve's rules) scrapes a real kvsieve
server (tiny Llama on CPU) while the CI smoke load runs (loadtest/run.py:
20 users, 60 s, every scenario and policy). Then every Grafana panel query,
dashboard variable and rule is evaluated through Prometheus' HTTP API."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import free_port
from ops.paths import DASHBOARDS, LOADTEST, ROOT, RULES
from ops.prometheus import Prometheus, has_values, scrape_config_for
from ops.promql import dashboard_queries, dashboard_variable_queries, metric_names, rules

USERS, RUN_TIME = 20, "60s"
POLICIES = ("full", "streaming", "h2o", "snapkv", "longflow")


@pytest.fixture(scope="module")
def stack(llama_server, tmp_path_factory):
    """Server (the session's tiny Llama: the counters and gauges read here are
    rates over this run, label sets, or idle values), Prometheus and one smoke
    run; yields what the tests look at."""
    work = tmp_path_factory.mktemp("ops-live")
    server = llama_server
    prom = Prometheus(work, scrape_config_for(server.url.removeprefix("http://")), free_port())
    try:
        out = work / "smoke"
        start = time.time()
        run = subprocess.run(
            [sys.executable, str(LOADTEST / "run.py"), "--host", server.url, "--users", str(USERS),
             "--spawn-rate", "10", "--run-time", RUN_TIME, "--out", str(out), "--short-tokens", "8",
             "--long-tokens", "32", "--burst-size", "4", "--plot", str(out / "plot.png")],
            capture_output=True, text=True, timeout=300,
        )
        time.sleep(3)  # a few more scrapes and rule evaluations after the run
        yield {"server": server, "prom": prom, "run": run, "out": out, "start": start, "end": time.time()}
    finally:
        prom.stop()


def exported_names(server) -> set[str]:
    """Metric family names (and their _bucket/_sum/_count/_total samples) on /metrics."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(sample.name for sample in family.samples)
    return names


def test_smoke_load_has_no_server_errors_and_frees_every_kv_page(stack):
    run, out = stack["run"], stack["out"]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    total = summary["total"]
    assert total["5xx"] == 0 and total["transport_errors"] == 0 and total["unexpected_4xx"] == 0, summary
    assert total["broken_responses"] == 0, summary
    for policy in POLICIES:
        assert summary["policies"][policy]["ok"] > 0, f"no completed {policy} request: {summary}"
    bad = summary["policies"]["bad requests"]
    assert bad["requests"] >= 8 and bad["expected_4xx"] == bad["requests"], bad
    scenarios = {json.loads(line)["scenario"] for line in (out / "requests.jsonl").read_text().splitlines()}
    assert scenarios == {"chat", "stream", "reasoning", "burst", "bad"}

    # Every KV page is free again, read here from the server itself (after the
    # runner's 1-token request: the token pool's counters are published at
    # each KV release and lag after cut-off requests, see loadtest/run.py).
    text = httpx.get(f"{stack['server'].url}/metrics", timeout=10).text
    values = {(s.name, s.labels.get("state")): s.value
              for family in text_string_to_metric_families(text) for s in family.samples}
    assert values[("kvsieve_region_pages", "used")] == 0
    assert values[("kvsieve_region_pages", "free")] > 0
    assert values[("kvsieve_region_reserved_pages", None)] == 0
    assert values[("kvsieve_token_pool_tokens", "in_use")] == 0
    assert summary["kv_idle"] and summary["kv_after_run"]["region_pages_used"] == 0


def test_runner_writes_csv_html_summary_and_plot(stack):
    out = stack["out"]
    for name in ("locust_stats.csv", "locust_stats_history.csv", "report.html", "summary.md", "run.json", "plot.png"):
        assert (out / name).stat().st_size > 0, name
    stats = (out / "locust_stats.csv").read_text()
    names = {line.split(",")[1] for line in stats.splitlines()[1:]}
    for policy in POLICIES:
        assert any(name.endswith(f" {policy}") for name in names), (policy, names)
    run = json.loads((out / "run.json").read_text())
    assert run["machine"]["cores"] and run["date"] and "loadtest/run.py" in run["command"]
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def ray_only_metrics() -> set[str]:
    """Metrics only the Ray Serve ingress exports (service/scale/hub.py), which
    a single-process server cannot show; their panels fall back to `up`."""
    source = (ROOT / "service" / "scale" / "hub.py").read_text()
    return set(re.findall(r'MetricFamily\(\s*"(kvsieve_\w+)"', source))


def test_dashboards_and_rules_name_only_exported_metrics(stack):
    ray_only = ray_only_metrics()
    assert ray_only == {"kvsieve_engine_replicas", "kvsieve_serve_engine_replicas"}
    exported = exported_names(stack["server"]) | {"up", "scrape_duration_seconds"} | ray_only
    recorded = {r["record"] for r in rules(RULES) if "record" in r}
    missing = []
    for path in DASHBOARDS:
        for q in dashboard_queries(path):
            missing += [f"{q}: {name}" for name in metric_names(q.expr) - exported]
    for rule in rules(RULES):
        missing += [f"{rule.get('alert') or rule['record']}: {name}"
                    for name in metric_names(rule["expr"]) - exported - recorded]
    assert not missing, "not exported by kvsieve:\n" + "\n".join(missing)


def test_every_dashboard_panel_query_returns_data(stack):
    prom, start, end = stack["prom"], stack["start"], stack["end"]
    queries = [q for path in DASHBOARDS for q in dashboard_queries(path)]
    assert len(queries) >= 20
    failures = []
    for q in queries:
        answer = prom.query_range(q.expr, start, end, step=1)
        if answer["status"] != "success":
            failures.append(f"{q}\n  does not evaluate: {answer.get('error')}")
        elif not has_values(answer):
            failures.append(f"{q}\n  returned no data")
    assert not failures, "\n".join(failures)


def test_dashboard_variables_find_values(stack):
    prom = stack["prom"]
    for path in DASHBOARDS:
        for name, selector, label in dashboard_variable_queries(path):
            answer = prom.api(f"label/{label}/values", **{"match[]": selector}).json()
            assert answer["status"] == "success" and answer["data"], (path.name, name, answer)
            if name == "policy":
                assert set(POLICIES) <= set(answer["data"])


def test_rules_load_and_evaluate_cleanly_in_prometheus(stack):
    answer = stack["prom"].api("rules").json()
    loaded = {r["name"]: r for g in answer["data"]["groups"] for r in g["rules"]}
    expected = {r.get("alert") or r["record"] for r in rules(RULES)}
    assert set(loaded) == expected
    unhealthy = {name: r.get("lastError") for name, r in loaded.items() if r["health"] != "ok"}
    assert not unhealthy, unhealthy


def test_every_recording_rule_and_alert_signal_returns_data(stack):
    prom, start, end = stack["prom"], stack["start"], stack["end"]
    failures = []
    for rule in rules(RULES):
        name = rule.get("alert") or rule["record"]
        # The expression itself parses and evaluates (an alert's may be empty: nothing fires).
        answer = prom.query_range(rule["expr"], start, end, step=1)
        if answer["status"] != "success":
            failures.append(f"{name}: {answer.get('error')}")
            continue
        # What it reads has data: a recording rule's own series, an alert's inputs.
        series = [rule["record"]] if "record" in rule else sorted(metric_names(rule["expr"]))
        for s in series:
            if not has_values(prom.query_range(s, start, end, step=1)):
                failures.append(f"{name}: {s} has no data")
    assert not failures, "\n".join(failures)
