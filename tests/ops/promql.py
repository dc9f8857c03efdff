"""What the ops files ask Prometheus: the queries of Grafana dashboards (with
their variables filled in), the expressions of rule files, and the metric
names a PromQL expression reads."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

# Values Grafana would put in for the dashboards' variables in the tests'
# Prometheus (scrape every 1 s): $__rate_interval is at least 4 scrapes.
VARIABLES = {
    "$__rate_interval": "10s",
    "$__interval": "1s",
    "$job": "kvsieve",
    "$policy": ".*",
}

_FUNCTIONS_AND_KEYWORDS = {
    "and", "or", "unless", "offset", "bool", "by", "without", "on", "ignoring", "group_left",
    "group_right", "inf", "nan",
}


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref: str
    expr: str

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref}: {self.expr}"


def fill_variables(expr: str) -> str:
    # Longest names first so that $__rate_interval is not read as $__rate...
    for name in sorted(VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, VARIABLES[name])
    assert "$" not in expr, f"unknown dashboard variable in {expr}"
    return expr


def _panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows hold their panels


def dashboard_queries(path: Path) -> list[PanelQuery]:
    dash = json.loads(path.read_text())
    out = []
    for panel in _panels(dash["panels"]):
        for target in panel.get("targets", []):
            out.append(PanelQuery(dash["title"], panel["title"], target["refId"], fill_variables(target["expr"])))
    return out


def dashboard_variable_queries(path: Path) -> list[tuple[str, str, str]]:
    """(variable, metric selector, label) of every label_values(...) variable."""
    dash = json.loads(path.read_text())
    out = []
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
        assert m, f"variable {var['name']}: only label_values(selector, label) is used here, got {query}"
        out.append((var["name"], fill_variables(m.group(1)), m.group(2)))
    return out


def rules(path: Path) -> list[dict]:
    """Every rule of a Prometheus rule file, with its group name."""
    doc = yaml.safe_load(path.read_text())
    return [{**rule, "group": group["name"]} for group in doc["groups"] for rule in group["rules"]]


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (function names, keywords, label
    names, label values and durations are not)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "{}", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "[]", text)  # ranges and subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(\s*\()?", text):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _FUNCTIONS_AND_KEYWORDS:
            continue
        names.add(word)
    return names
