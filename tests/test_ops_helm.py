"""helm/kvsieve with a real helm binary: lint (values.schema.json included)
and template, then checks on the rendered objects."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from ops.paths import CHART, DASHBOARDS, RULES, tool


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=120)


def render(*sets: str, release: str = "prod") -> list[dict]:
    """`helm template` with --set for each of `sets` (--set-json for "json:key=value")."""
    args = ["template", release, str(CHART), "--namespace", "llm"]
    for s in sets:
        args += ["--set-json", s[5:]] if s.startswith("json:") else ["--set", s]
    out = helm(*args)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def one(docs: list[dict], kind: str, name_part: str = "") -> dict:
    found = [d for d in docs if d["kind"] == kind and name_part in d["metadata"]["name"]]
    assert len(found) == 1, f"{kind} {name_part!r}: {[d['metadata']['name'] for d in found]}"
    return found[0]


def containers(rayservice: dict) -> tuple[dict, dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    (group,) = cluster["workerGroupSpecs"]
    return head, group["template"]["spec"]["containers"][0]


def serve_app(rayservice: dict) -> dict:
    (app,) = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    return app


def test_helm_is_the_pinned_real_binary():
    out = helm("version", "--template", "{{.Version}}")
    assert out.returncode == 0 and out.stdout.strip() == "v4.1.4", out


def test_lint_passes_strict_with_defaults_and_overrides():
    for extra in ([], ["--set", "serve.replicas=2", "--set", "redis.enabled=false",
                       "--set", "redis.externalUrl=redis://cache:6379/1", "--set", "auth.enabled=true",
                       "--set", "auth.keys={team-a}", "--set", "model.pvc.claimName=models"]):
        out = helm("lint", "--strict", str(CHART), *extra)
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("bad, complaint", [
    ("ray.workers.gpusPerWorker=abc", "gpusPerWorker"),
    ("serve.replicas=0", "replicas"),
    ("service.port=70000", "port"),
    ("serve.importPath=not-an-import-path", "importPath"),
    ("redis.externalUrl=http://cache", "externalUrl"),
    ("engine.maxTotalTokenz=5", "maxTotalTokenz"),
])
def test_values_schema_rejects_bad_values(bad, complaint):
    out = helm("lint", "--strict", str(CHART), "--set", bad)
    assert out.returncode != 0 and complaint in out.stdout + out.stderr, out.stdout + out.stderr


def test_default_render_has_every_part():
    docs = render()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["RayService", "Service", "Service", "ServiceMonitor", "PrometheusRule", "ConfigMap",
                            "Secret", "Deployment", "PersistentVolumeClaim"]), kinds
    assert all(d["metadata"]["labels"]["app.kubernetes.io/instance"] == "prod" for d in docs)


def test_gpu_requests_are_on_workers_only():
    head, worker = containers(one(render("ray.workers.gpusPerWorker=2"), "RayService"))
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert worker["resources"]["requests"]["cpu"] == "8"  # the rest of the requests is kept
    assert "nvidia.com/gpu" not in json.dumps(head["resources"])
    cluster = one(render(), "RayService")["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    assert cluster["workerGroupSpecs"][0]["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"


def _ray_source() -> str:
    import ray

    root = Path(ray.__file__).parent
    return "\n".join(p.read_text(errors="ignore") for sub in ("dashboard", "serve", "_private")
                     for p in (root / sub).rglob("*.py"))


def test_probes_hit_real_endpoints():
    """kvsieve's /health is checked live in test_ops_live; the Ray endpoints and
    ports here are looked up in the Ray package the project pins."""
    docs = render()
    head, worker = containers(one(render(), "RayService"))
    serve_port = {p["name"]: p["containerPort"] for p in head["ports"]}["serve"]
    assert head["readinessProbe"]["httpGet"] == {"path": "/health", "port": serve_port}
    app_source = (CHART.parents[1] / "service" / "app.py").read_text()
    assert '@app.get("/health")' in app_source

    from ray._private import ray_constants

    source = _ray_source()
    probes = {
        "head liveness": (head["livenessProbe"]["httpGet"], 8265),  # Ray's dashboard port
        "worker readiness": (worker["readinessProbe"]["httpGet"], serve_port),  # the node's Serve proxy
        "worker liveness": (worker["livenessProbe"]["httpGet"], ray_constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT),
    }
    for name, (probe, port) in probes.items():
        assert probe["port"] == port, name
        assert f'"{probe["path"]}"' in source, f"{name}: {probe['path']} is no route of Ray {ray_constants.__name__}"
    # The Service reaches the head's Serve proxy by port name, and selects the head pod.
    service = next(d for d in docs if d["kind"] == "Service" and "redis" not in d["metadata"]["name"])
    assert service["spec"]["ports"][0]["targetPort"] == "serve"
    head_labels = one(docs, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= head_labels.items()


def test_values_flow_into_the_serve_application():
    docs = render("image.repository=registry.example/kvsieve-gpu", "image.tag=1.2.3", "engine.maxTotalTokens=123456",
                  "serve.replicas=3", "serve.numGpusPerReplica=2", "model.path=/models/qwen3-8b",
                  "model.pvc.claimName=weights", "limits.maxTokens=8192", "json:engine.regionShare=0.5",
                  "ray.workers.maxReplicas=7")
    rs = one(docs, "RayService")
    head, worker = containers(rs)
    assert head["image"] == worker["image"] == "registry.example/kvsieve-gpu:1.2.3"
    app = serve_app(rs)
    assert app["import_path"] == "kvsieve.service.scale.application:app_builder"
    args = app["args"]
    assert args["engine"] == {"model": "/models/qwen3-8b", "device": "cuda", "dtype": "auto", "max_total_tokens": 123456}
    assert args["ray"]["replicas"] == 3 and "autoscaling" not in args["ray"]
    assert args["ray"]["num_gpus_per_replica"] == 2
    assert args["limits"]["max_tokens"] == 8192
    assert app["runtime_env"]["env_vars"]["KVSIEVE_REGION_SHARE"] == "0.5"
    assert rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] == 7
    mounts = {m["name"]: m for m in worker["volumeMounts"]}
    assert mounts["model"]["readOnly"] and "/models/qwen3-8b".startswith(mounts["model"]["mountPath"])
    volumes = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["volumes"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in volumes
    # Autoscaling is the default, from values.
    auto = serve_app(one(render("serve.autoscaling.maxReplicas=9"), "RayService"))["args"]["ray"]["autoscaling"]
    assert auto == {"min_replicas": 1, "max_replicas": 9, "target_ongoing_requests": 4}


def test_store_url_comes_from_a_secret():
    docs = render("redis.password=s3cret")
    secret = one(docs, "Secret", "store")
    assert secret["stringData"]["store-url"] == "redis://:s3cret@prod-kvsieve-redis:6379/0"
    head, worker = containers(one(docs, "RayService"))
    for c in (head, worker):
        (env,) = [e for e in c["env"] if e["name"] == "KVSIEVE_STORE__URL"]
        assert env["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "store-url"}
    redis = one(docs, "Deployment", "redis")["spec"]["template"]["spec"]["containers"][0]
    assert "s3cret" not in json.dumps(redis)  # the password only from the Secret
    # External Redis: no in-chart Redis; a user's Secret: no chart Secret at all.
    docs = render("redis.enabled=false", "redis.externalUrl=rediss://cache.internal:6380/2")
    assert not [d for d in docs if "redis" in d["metadata"]["name"]]
    assert one(docs, "Secret", "store")["stringData"]["store-url"] == "rediss://cache.internal:6380/2"
    docs = render("redis.enabled=false", "redis.existingSecret=my-store")
    assert not [d for d in docs if d["kind"] == "Secret"]
    head, _ = containers(one(docs, "RayService"))
    assert head["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "my-store"
    out = helm("template", "x", str(CHART), "--set", "redis.enabled=false")
    assert out.returncode != 0 and "redis.externalUrl" in out.stderr


def test_api_keys_are_minted_into_a_secret_by_a_hook_job():
    assert not [d for d in render("auth.keys={team-a}") if d["kind"] == "Job"]  # auth off: no keys
    docs = render("auth.enabled=true", "auth.keys={team-a,team-b}")
    job = one(docs, "Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    spec = job["spec"]["template"]["spec"]
    (mint,) = spec["initContainers"]
    script = mint["command"][-1]
    assert 'for name in "team-a" "team-b"' in script and "kvsieve keys create" in script
    assert mint["env"][0]["name"] == "KVSIEVE_STORE__URL"
    (write,) = spec["containers"]
    assert "kubectl create secret generic prod-kvsieve-api-keys --from-file=/keys" in write["command"][-1]
    role = one(docs, "Role")
    assert {"resourceNames": ["prod-kvsieve-api-keys"]}.items() <= role["rules"][0].items()
    args = serve_app(one(docs, "RayService"))["args"]
    assert args["auth"]["enabled"] is True


def test_monitoring_objects_carry_the_repo_dashboards_and_rules():
    docs = render("metrics.serviceMonitor.labels.release=kps", "metrics.dashboards.namespace=monitoring")
    sm = one(docs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kps"
    assert sm["spec"]["jobLabel"] == "app.kubernetes.io/name"
    service = next(d for d in docs if d["kind"] == "Service" and "redis" not in d["metadata"]["name"])
    # The job label is the Service's app.kubernetes.io/name: "kvsieve", the job the rules and dashboards name.
    assert service["metadata"]["labels"]["app.kubernetes.io/name"] == "kvsieve"
    assert 'job="kvsieve"' in RULES.read_text()
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"

    rule = one(docs, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    maps = [d for d in docs if d["kind"] == "ConfigMap"]
    assert len(maps) == len(DASHBOARDS) >= 1
    for cm, path in zip(sorted(maps, key=lambda d: d["metadata"]["name"]), DASHBOARDS):
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["namespace"] == "monitoring"
        assert json.loads(cm["data"][path.name]) == json.loads(path.read_text())
    off = render("metrics.serviceMonitor.enabled=false", "metrics.prometheusRule.enabled=false",
                 "metrics.dashboards.enabled=false")
    assert not {"ServiceMonitor", "PrometheusRule", "ConfigMap"} & {d["kind"] for d in off}


def test_rendered_names_are_valid_kubernetes_names():
    for doc in render("auth.enabled=true", "auth.keys={a}", release="a-release-name-that-is-rather-long-for-a-cluster"):
        name = doc["metadata"]["name"]
        assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name


def test_ray_version_matches_the_image():
    """KubeRay starts the cluster at ray.version; the image has the scale part's locked Ray."""
    locked = re.search(r"^ray\[serve\]==([\d.]+)$", (CHART.parents[1] / "requirements" / "scale.lock").read_text(), re.M)
    cluster = one(render(), "RayService")["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == locked.group(1)
