"""deploy/: the compose files parse with docker-compose (no Docker engine is
needed for `config`), the Dockerfiles follow the project's pins, Grafana's
provisioning points at the dashboards."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
from pathlib import Path

import yaml

from ops.paths import DASHBOARDS, DEPLOY, ROOT, tool

DOCKERFILES = {"cpu": DEPLOY / "docker" / "Dockerfile.cpu", "gpu": DEPLOY / "docker" / "Dockerfile.gpu"}


def compose_config(*files: str, env: dict | None = None) -> dict:
    args = [tool("docker-compose")]
    for f in files:
        args += ["-f", str(DEPLOY / f)]
    out = subprocess.run([*args, "config"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def test_compose_parses_with_every_service_and_mounts_that_exist():
    config = compose_config("compose.yaml")
    assert set(config["services"]) == {"kvsieve", "redis", "prometheus", "grafana"}
    kvsieve = config["services"]["kvsieve"]
    assert Path(kvsieve["build"]["context"]) == ROOT
    assert kvsieve["build"]["dockerfile"] == "deploy/docker/Dockerfile.cpu"
    assert kvsieve["environment"]["KVSIEVE_STORE__URL"] == "redis://redis:6379/0"
    assert kvsieve["depends_on"]["redis"]["condition"] == "service_healthy"
    for name, service in config["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
            if source.startswith("/"):
                assert Path(source).exists(), f"{name}: {source}"
    prometheus = config["services"]["prometheus"]
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (target,) = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    host, port = target.split(":")
    assert host in config["services"] and int(port) == 8000
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


def test_compose_gpu_override_asks_for_a_gpu_and_a_model():
    config = compose_config("compose.yaml", "compose.gpu.yaml", env={"KVSIEVE_MODEL_DIR": "/srv/models/qwen3"})
    kvsieve = config["services"]["kvsieve"]
    assert kvsieve["build"]["dockerfile"] == "deploy/docker/Dockerfile.gpu"
    (device,) = kvsieve["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "/srv/models/qwen3:/model:ro" in kvsieve["volumes"]
    assert kvsieve["command"][:2] == ["--model", "/model"]
    # Without a model directory the override refuses to start, naming the variable.
    out = subprocess.run([tool("docker-compose"), "-f", str(DEPLOY / "compose.yaml"), "-f",
                          str(DEPLOY / "compose.gpu.yaml"), "config"], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "KVSIEVE_MODEL_DIR"}, timeout=120)
    assert out.returncode != 0 and "KVSIEVE_MODEL_DIR" in out.stderr


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfiles_pin_what_they_install_and_run_unprivileged():
    for kind, path in DOCKERFILES.items():
        ins = instructions(path)
        (base,) = [a for i, a in ins if i == "FROM"]
        assert re.fullmatch(r"[\w./-]+:[\w.-]+", base) and not base.endswith(":latest"), base
        runs = " ".join(a for i, a in ins if i == "RUN")
        assert '"sglang==0.5.17"' in runs, kind
        for spec in re.findall(r'pip install[^&]*', runs):
            locked = "-c requirements/scale.lock" in spec  # versions from the scale part's lock
            for pkg in re.findall(r'"([A-Za-z][\w.\-\[\]]*)([=<>!~]=?[^"]*)?"', spec):
                assert pkg[1].startswith("==") or locked, f"{kind}: {pkg[0]} is not pinned"
        # What kvsieve imports at run time beyond SGLang (service/config.py, the store, service/scale).
        for runtime in ('"ray[serve]"', "redis", "pydantic-settings"):
            assert runtime in runs, f"{kind}: {runtime} missing"
        scale_lock = (ROOT / "requirements" / "scale.lock").read_text()
        for name in ("ray[serve]==", "redis==", "pydantic-settings=="):
            assert name in scale_lock, name
        assert [a for i, a in ins if i == "USER"] == ["kvsieve"], kind
        assert any(i == "HEALTHCHECK" and "/health" in a for i, a in ins), kind
        assert ("EXPOSE", "8000") in ins
        entry = json.loads(next(a for i, a in ins if i == "ENTRYPOINT"))
        assert entry[:2] == ["kvsieve", "serve"] and "0.0.0.0" in entry
        for i, a in ins:  # every COPY source exists in the build context (the repository root)
            if i == "COPY":
                for src in a.split()[:-1]:
                    assert (ROOT / src).exists(), f"{kind}: COPY {src}"
        assert path.with_name(path.name + ".dockerignore").read_text().count(".venv") == 1


def test_cpu_image_matches_the_setup_pins_and_embeds_the_model():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    runs = " ".join(a for i, a in instructions(DOCKERFILES["cpu"]) if i == "RUN")
    torch = re.search(r'TORCH_VERSION="([\d.]+)"', setup).group(1)
    model = re.search(r'MODEL_PACKAGE="([^"]+)"', setup).group(1)
    assert f'"torch=={torch}"' in runs and f'"{model}"' in runs
    assert "-r requirements/cpu.lock" in runs and "kvsieve prepare-model" in runs
    gpu = " ".join(a for i, a in instructions(DOCKERFILES["gpu"]) if i == "RUN")
    requires = "\n".join(importlib.metadata.requires("sglang"))  # the installed sglang==0.5.17's own pins
    pins = re.findall(r"^(torch==[\d.]+|sglang-kernel==[\d.]+|flashinfer_python\[cu13\]==[\w.]+)$", requires, re.M)
    assert len(pins) == 3, pins
    for pin in pins:
        name, version = pin.split("==")
        assert f'{name.replace("_", "-")}=={version}"' in gpu, f"the GPU image does not pin SGLang's {pin}"


def test_grafana_provisioning_loads_the_dashboards_from_prometheus():
    config = compose_config("compose.yaml")
    grafana = config["services"]["grafana"]
    mounts = dict(reversed(v.split(":")[:2]) for v in grafana["volumes"] if v.startswith("/"))
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/kvsieve.yml").read_text())["providers"][0]
    assert Path(mounts[provider["options"]["path"]]) == DASHBOARDS[0].parent
    (source,) = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(mounts[str(Path(home).parent)], Path(home).name).exists()


def test_dashboards_are_well_formed():
    uids = set()
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        assert dash["uid"] not in uids
        uids.add(dash["uid"])
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids)), path.name
        names = {v["name"] for v in dash["templating"]["list"]}
        assert {"datasource", "job", "policy"} <= names
        cells = set()
        for p in dash["panels"]:
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24, p["title"]
            area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not cells & area, f"{p['title']} overlaps another panel"
            cells |= area
            if p["type"] != "row":
                assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
                assert p.get("description"), p["title"]
                for t in p["targets"]:
                    assert t["expr"].strip() and t["datasource"]["uid"] == "${datasource}"
        titles = " ".join(p["title"] for p in dash["panels"]).lower()
        for topic in ("kv memory by policy", "eviction rate", "eviction events", "tpot", "ttft",
                      "compression ratio", "requests", "replicas", "compressed-region utilisation"):
            assert topic in titles, topic
