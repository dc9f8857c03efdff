"""Prometheus configuration and alert rules checked by promtool (Debian's
prometheus package): syntax, and the unit tests beside the rules."""

from __future__ import annotations

import shutil
import subprocess

import yaml

from ops.paths import PROMETHEUS_CONFIG, RULES, RULES_TEST, tool
from ops.promql import rules

ALERTS = {"KvsieveTokenPoolNearlyFull", "KvsieveRegionNearlyFull", "KvsieveEvictionStorm",
          "KvsieveTPOTObjectiveBreached", "KvsieveHighErrorRate", "KvsievePolicyFault", "KvsieveReplicaDown",
          "KvsieveAbsent"}


def promtool(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_rules_pass_promtool_check():
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 14 rules found" in out.stdout


def test_compose_prometheus_config_passes_promtool_check():
    out = promtool("check", "config", str(PROMETHEUS_CONFIG))
    assert out.returncode == 0, out.stdout + out.stderr
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert [job["job_name"] for job in config["scrape_configs"]] == ["kvsieve"]


def test_rule_unit_tests_pass():
    out = promtool("test", "rules", RULES_TEST.name, cwd=RULES_TEST.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_alert_has_a_unit_test_that_fires_it_and_one_that_does_not():
    assert {r["alert"] for r in rules(RULES) if "alert" in r} == ALERTS
    cases = yaml.safe_load(RULES_TEST.read_text())["tests"]
    fired, quiet = set(), set()
    for case in cases:
        for check in case.get("alert_rule_test", []):
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    assert fired == ALERTS, ALERTS - fired
    assert quiet == ALERTS, ALERTS - quiet


def test_unit_tests_catch_a_changed_threshold(tmp_path):
    """The unit tests are tight: moving one threshold makes them fail."""
    for name in (RULES.name, RULES_TEST.name):
        shutil.copy(RULES.parent / name, tmp_path / name)
    text = (tmp_path / RULES.name).read_text()
    assert "kvsieve:token_pool_in_use:ratio > 0.9" in text
    (tmp_path / RULES.name).write_text(text.replace("kvsieve:token_pool_in_use:ratio > 0.9",
                                                    "kvsieve:token_pool_in_use:ratio > 0.96"))
    out = promtool("test", "rules", RULES_TEST.name, cwd=tmp_path)
    assert out.returncode != 0 and "KvsieveTokenPoolNearlyFull" in out.stdout + out.stderr
