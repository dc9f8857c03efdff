"""`kvsieve serve --replicas 2` on real Ray (in-process, CPU) with the tiny
model: kvsieve's API through the ingress, per-replica metrics, presets from a
real Redis, a replica killed mid-load, and a graceful drain on stop."""

import json
import os
import signal
import subprocess
import threading
import time

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import KVSIEVE, free_port, kvsieve_cli
from kvsieve.service.config import load_settings
from kvsieve.service.scale.application import engine_deployment_options
from kvsieve.service.scale.hub import STALE_AFTER_S

START_TIMEOUT_S = 600  # two engines and Ray on a shared 2-core machine


def test_the_rayservice_entry_point_builds_the_application_from_its_args():
    # What the helm chart's RayService names as its import_path.
    from ray.serve import Application

    from kvsieve.service.scale.application import app_builder

    app = app_builder({"ray": {"replicas": 2}, "limits": {"max_tokens": 64}})
    assert isinstance(app, Application)
    with pytest.raises(ValueError, match="ray"):
        app_builder({"ray": {"replicas": 0}})


def test_deployment_options_from_settings():
    fixed = engine_deployment_options(load_settings(ray={"replicas": 3, "graceful_shutdown_timeout_s": 12}), "/tmp/x")
    assert fixed["num_replicas"] == 3 and fixed["graceful_shutdown_timeout_s"] == 12
    assert fixed["ray_actor_options"]["runtime_env"]["env_vars"]["PROMETHEUS_MULTIPROC_DIR"] == "/tmp/x"
    auto = engine_deployment_options(load_settings(ray={"autoscaling": {
        "min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2}}), "/tmp/x")
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 1,
                                          "target_ongoing_requests": 2.0, "upscale_delay_s": 10.0,
                                          "downscale_delay_s": 60.0}


def metric_samples(text: str, name: str) -> list:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


def engine_replica_procs(root: psutil.Process) -> list[psutil.Process]:
    found = []
    for proc in root.children(recursive=True):
        try:
            if "ServeReplica:kvsieve:EngineReplica" in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            pass
    return found


class RayService:
    def __init__(self, proc, url, log_path, env):
        self.proc, self.url, self.log_path, self.env = proc, url, log_path, env

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=30).text

    def replicas_reporting(self) -> float:
        samples = metric_samples(self.metrics(), "kvsieve_engine_replicas")
        return samples[0].value if samples else 0

    def wait_for_replicas(self, n: int, timeout: float, not_before: float = 0.0, exclude: tuple = ()) -> None:
        """n engine replicas initialized (their process title no longer names
        the init call) and reporting metrics; `not_before`: a killed replica's
        last push ages out of the hub (hub.STALE_AFTER_S) before counting."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvsieve serve exited:\n{self.log()[-5000:]}")
            try:
                ready = [p for p in engine_replica_procs(psutil.Process(self.proc.pid))
                         if p.pid not in exclude and p.status() != psutil.STATUS_ZOMBIE
                         and "initialize" not in " ".join(p.cmdline())]
                if len(ready) == n and time.monotonic() >= not_before and self.replicas_reporting() == n:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise TimeoutError(f"{n} engine replicas did not report:\n{self.log()[-5000:]}")


@pytest.fixture(scope="module")
def ray_service(tiny_llama, session_redis, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ray")
    config = workdir / "kvsieve.yaml"
    config.write_text(
        "ray:\n  replicas: 2\n  num_cpus_per_replica: 1\n  graceful_shutdown_timeout_s: 60\n"
        "  health_check_period_s: 2\n"
        "limits:\n  max_tokens: 512\n  request_timeout_s: 300\n"
        "store:\n  refresh_interval_s: 0.2\n"
        "engine:\n  max_total_tokens: 8192\n"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVSIEVE_STORE__URL": session_redis.url}
    port = free_port()
    log_path = workdir / "serve.log"
    proc = subprocess.Popen([KVSIEVE, "serve", "--model", str(tiny_llama), "--config", str(config),
                             "--port", str(port)], stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    service = RayService(proc, f"http://127.0.0.1:{port}", log_path, env)
    try:
        service.wait_for_replicas(2, START_TIMEOUT_S)
        yield service
    finally:
        if proc.poll() is None:  # the drain test stops it; otherwise stop it here
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _stream(url: str, body: dict, out: dict, started: threading.Event | None = None) -> None:
    """One streaming completion; records chunks, the error event if any, the end."""
    out.update(chunks=0, error=None, finish=None, kv_usage=None, done=False, status=None)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=300) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = event["error"]
                    continue
                out["chunks"] += 1
                if started is not None and out["chunks"] >= 2:
                    started.set()
                choice = event["choices"][0]
                if choice["finish_reason"]:
                    out["finish"], out["kv_usage"] = choice["finish_reason"], event.get("kv_usage")
    except httpx.HTTPError as exc:
        out["error"] = {"transport": repr(exc)}


def test_api_and_metrics_per_replica(ray_service):
    s = ray_service
    assert kvsieve_cli("presets", "set", "ray-house", '{"name": "full"}', env=s.env).returncode == 0
    deadline = time.monotonic() + 15
    while True:  # the ingress sees the new preset without a restart
        r = httpx.post(f"{s.url}/v1/completions", timeout=120, json={
            "prompt": "one two three", "max_tokens": 6, "ignore_eos": True, "kv_policy": "ray-house"})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert r.status_code == 200, r.text
    assert r.json()["kv_usage"]["preset"] == "ray-house" and r.json()["usage"]["completion_tokens"] == 6

    bad = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "kv_policy": {"name": "full", "budget": -1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_policy.budget"

    outs = [{} for _ in range(8)]
    threads = [threading.Thread(target=_stream, args=(s.url, {"prompt": f"the model thinks {i}", "max_tokens": 24,
                                                             "ignore_eos": True, "kv_policy": {"name": "full"}}, o))
               for i, o in enumerate(outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(o["finish"] == "length" and o["done"] and o["kv_usage"]["policy"] == "full" for o in outs), outs

    time.sleep(3)  # one metrics push interval (2 s) and some
    text = s.metrics()
    served = metric_samples(text, "kvsieve_requests_total")
    replicas = {x.labels["replica"] for x in served if x.labels.get("status") == "ok" and x.value > 0}
    assert len(replicas) == 2, served  # both replicas served, each labelled
    assert any(x.labels.get("replica") in replicas for x in metric_samples(text, "kvsieve_e2e_latency_seconds_count"))
    assert any(f.name.startswith("sglang:") and any("replica" in x.labels for x in f.samples)
               for f in text_string_to_metric_families(text))
    assert metric_samples(text, "kvsieve_engine_replicas")[0].value == 2
    assert metric_samples(text, "kvsieve_store_up")[0].value == 1


def test_replica_killed_mid_load(ray_service):
    s = ray_service
    # Long enough that both replicas are still generating when one is killed.
    body = {"prompt": "wait let me verify", "max_tokens": 500, "ignore_eos": True}
    outs = [{} for _ in range(8)]
    started = [threading.Event() for _ in outs]
    threads = [threading.Thread(target=_stream, args=(s.url, body, o, e)) for o, e in zip(outs, started)]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(timeout=300), outs
    victims = engine_replica_procs(psutil.Process(s.proc.pid))
    assert len(victims) == 2
    victims[0].kill()  # SIGKILL: no drain, no goodbye
    killed_at = time.monotonic()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a request hung after its replica died"
    finished = [o for o in outs if o["finish"] == "length" and o["error"] is None]
    failed = [o for o in outs if o["error"] is not None]
    assert len(finished) + len(failed) == len(outs), outs
    assert finished and failed, outs  # both replicas had requests in flight
    for o in finished:
        assert o["kv_usage"]["prompt_tokens"] > 0 and o["done"]
    for o in failed:  # a clean error event, then the end of the stream
        assert o["error"].get("code") == "replica_failed" and o["done"], o

    # New requests go to the surviving replica.
    time.sleep(1)
    for _ in range(4):
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "one", "max_tokens": 4}, timeout=120)
        assert r.status_code == 200, r.text
    # Serve replaces the killed replica.
    s.wait_for_replicas(2, START_TIMEOUT_S, not_before=killed_at + STALE_AFTER_S + 3, exclude=(victims[0].pid,))
    assert victims[0].pid not in [p.pid for p in engine_replica_procs(psutil.Process(s.proc.pid))]
    r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "two", "max_tokens": 4}, timeout=120)
    assert r.status_code == 200, r.text
    print(f"replica replaced in {time.monotonic() - killed_at:.0f} s")


def test_stop_drains_requests(ray_service):
    s = ray_service
    root = psutil.Process(s.proc.pid)
    tree = root.children(recursive=True)
    out: dict = {}
    started = threading.Event()
    t = threading.Thread(target=_stream, args=(s.url, {"prompt": "one two", "max_tokens": 120, "ignore_eos": True},
                                               out, started))
    t.start()
    assert started.wait(timeout=300)
    s.proc.send_signal(signal.SIGTERM)
    t.join(timeout=300)
    assert out["finish"] == "length" and out["error"] is None, out  # finished, not cut off
    assert s.proc.wait(timeout=180) == 0, s.log()[-5000:]
    gone, alive = psutil.wait_procs(tree, timeout=60)
    assert not alive, [(p.pid, p.name()) for p in alive]
