"""Where the ops files and tools are."""

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "rules" / "kvsieve.rules.yml"
RULES_TEST = DEPLOY / "prometheus" / "rules" / "kvsieve.rules.test.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
CHART = ROOT / "helm" / "kvsieve"
LOADTEST = ROOT / "loadtest"


def tool(name: str) -> str:
    """A tool scripts/setup.d/30-ops.sh installs: beside the venv's python, else on PATH."""
    beside = Path(sys.executable).with_name(name)
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    assert found, f"{name} is missing: scripts/setup.d/30-ops.sh installs it"
    return found
