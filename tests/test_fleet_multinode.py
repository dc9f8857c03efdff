"""A real two-node Ray cluster on this machine, every address on loopback:
a head and a worker node started with `ray start` (through
service/scale/loopback.py), each offering one `kvsieve_engine`;
`kvsieve serve --ray-address auto --replicas 2` puts one engine replica on
each. The worker's raylet is killed mid-load: its streams end with an error
event and [DONE], the head keeps serving, and the replica comes back with
the node. No connection of any process involved leaves loopback."""

import ipaddress
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import KVSIEVE, free_port
from kvsieve.service.sse_client import sse_lines

START_TIMEOUT_S = 600
# Two node start-ups, four engine start-ups (one after the node returns):
# 400 s on an idle 2-core machine, more under load.
pytestmark = pytest.mark.timeout(1500)


def ray_node(port: int, head: bool, log, env: dict) -> subprocess.Popen:
    """`ray start --block` (loopback kept): the node's processes are this one's children."""
    where = ["--head", "--port", str(port), "--include-dashboard", "false"] if head else \
        ["--address", f"127.0.0.1:{port}"]
    return subprocess.Popen(
        [sys.executable, "-m", "kvsieve.service.scale.loopback", "start", *where, "--node-ip-address", "127.0.0.1",
         "--num-cpus", "1", "--resources", json.dumps({"kvsieve_engine": 1}), "--disable-usage-stats", "--block"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def tree(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        root = psutil.Process(proc.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def engine_replicas(procs: list[psutil.Process]) -> list[psutil.Process]:
    found = []
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
            if "ServeReplica:kvsieve:EngineReplica" in cmd and "initialize" not in cmd \
                    and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            pass
    return found


def loopback_only(procs: list[psutil.Process]) -> list:
    """Connections with a non-loopback end, or listeners on a non-loopback address."""
    def off(ip: str) -> bool:
        addr = ipaddress.ip_address(ip)
        if getattr(addr, "ipv4_mapped", None):
            addr = addr.ipv4_mapped
        return not (addr.is_loopback or addr.is_unspecified)

    bad = []
    for p in procs:
        try:
            for c in p.net_connections(kind="inet"):
                if (c.raddr and off(c.raddr.ip)) or (c.laddr and off(c.laddr.ip)):
                    bad.append((p.pid, p.name(), c.laddr, c.raddr))
        except psutil.Error:
            pass
    return bad


class Cluster:
    def __init__(self, workdir, env):
        self.workdir, self.env = workdir, env
        self.port = free_port()
        self.head = ray_node(self.port, True, open(workdir / "head.log", "wb"), env)
        self.worker = None
        self.started: list[psutil.Process] = []

    def wait_node(self, proc, log_name: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while "Ray runtime started" not in (self.workdir / log_name).read_text(errors="replace"):
            assert proc.poll() is None, (self.workdir / log_name).read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, f"{log_name}: node did not start"
            time.sleep(1)
        self.started += tree(proc)

    def start_worker(self, name: str) -> None:
        self.worker = ray_node(self.port, False, open(self.workdir / name, "wb"), self.env)
        self.wait_node(self.worker, name)

    def stop(self) -> None:
        for proc in (self.worker, self.head):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (self.worker, self.head):
            if proc is not None:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        everything = self.started + [p for proc in (self.head, self.worker) if proc for p in tree(proc)]
        _, alive = psutil.wait_procs(everything, timeout=20)
        for p in alive:  # what the node processes left behind (workers of a killed raylet)
            try:
                p.kill()
            except psutil.Error:
                pass


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("cluster")
    # Ray 2.60's head turns token authentication on; its nodes and drivers
    # must send the token too: this cluster's own, not ~/.ray/auth_token,
    # which a fresh machine does not have.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           # The nodes stop at the module's end only: no graceful drain (the
           # head waited out its 30 s default for the Serve controller).
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    env.pop("RAY_ADDRESS", None)
    c = Cluster(workdir, env)
    try:
        c.wait_node(c.head, "head.log")
        c.start_worker("worker-1.log")
        yield c
    finally:
        c.stop()


def replicas_reporting(url: str) -> float:
    r = httpx.get(f"{url}/metrics", timeout=30)
    if r.status_code != 200:  # Serve's proxy answers 404 until the app's route is up
        return 0
    return sum(s.value for f in text_string_to_metric_families(r.text) for s in f.samples
               if s.name == "kvsieve_engine_replicas")


def _stream(url: str, body: dict, out: dict, started: threading.Event) -> None:
    out.update(chunks=0, error=None, finish=None, done=False)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=300) as r:
            for line in sse_lines(r):
                if line == "data: [DONE]":
                    out["done"] = True
                    break
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = event["error"]
                    continue
                out["chunks"] += 1
                if out["chunks"] >= 2:
                    started.set()
                if event["choices"][0]["finish_reason"]:
                    out["finish"] = event["choices"][0]["finish_reason"]
    except httpx.HTTPError as exc:
        out["error"] = {"transport": repr(exc)}
    started.set()


def test_one_replica_per_node_and_a_node_lost_mid_load(cluster, tiny_llama, tmp_path):
    c = cluster
    config = tmp_path / "kvsieve.yaml"
    config.write_text(
        "ray:\n  replicas: 2\n  max_ongoing_requests: 3\n  num_cpus_per_replica: 1\n  engine_resources: {kvsieve_engine: 1}\n"
        "  ingress_resources: {'node:__internal_head__': 0.001}\n  graceful_shutdown_timeout_s: 5\n"
        "  health_check_period_s: 2\n"
        "engine:\n  max_total_tokens: 8192\n"
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**c.env, "RAY_ADDRESS": f"127.0.0.1:{c.port}", "KVSIEVE_STORE__URL": f"file://{tmp_path}/store.json"}
    log_path = tmp_path / "serve.log"
    serve = subprocess.Popen([KVSIEVE, "serve", "--ray-address", "auto", "--model", str(tiny_llama), "--config",
                              str(config), "--port", str(port)], stdout=open(log_path, "wb"),
                             stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        def placed(timeout: float) -> tuple[list, list]:
            deadline = time.monotonic() + timeout
            while True:
                assert serve.poll() is None, log_path.read_text(errors="replace")[-5000:]
                on_head, on_worker = engine_replicas(tree(c.head)), engine_replicas(tree(c.worker))
                try:
                    reporting = replicas_reporting(url)
                except httpx.HTTPError:
                    reporting = 0
                if len(on_head) == 1 and len(on_worker) == 1 and reporting == 2:
                    return on_head, on_worker
                assert time.monotonic() < deadline, (on_head, on_worker, log_path.read_text(errors="replace")[-5000:])
                time.sleep(2)

        on_head, on_worker = placed(START_TIMEOUT_S)  # one engine replica on each node
        everything = tree(c.head) + tree(c.worker) + tree(serve)
        assert not loopback_only(everything), loopback_only(everything)

        # Six streams, at most three on a replica (max_ongoing_requests): each node holds three.
        outs = [{} for _ in range(6)]
        started = [threading.Event() for _ in outs]
        threads = [threading.Thread(target=_stream, args=(url, {"prompt": f"node {i}", "max_tokens": 600,
                                                                "ignore_eos": True}, o, e))
                   for i, (o, e) in enumerate(zip(outs, started))]
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(300)
        raylet = [p for p in tree(c.worker) if p.name() == "raylet"]
        assert len(raylet) == 1
        raylet[0].kill()  # the worker node is lost
        lost_at = time.monotonic()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads)
        lost = [o for o in outs if o["error"] is not None]
        kept = [o for o in outs if o["error"] is None]
        assert lost and kept, outs  # both nodes had streams
        for o in lost:
            assert o["error"].get("code") == "replica_failed" and o["done"], o
        for o in kept:
            assert o["finish"] == "length" and o["done"], o

        # The head keeps serving (after at most a few requests that still
        # reached the lost replica).
        deadline = time.monotonic() + 60
        ok = 0
        while ok < 4:
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-5000:]
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "still here", "max_tokens": 4}, timeout=120)
            ok = ok + 1 if r.status_code == 200 else 0
        assert engine_replicas(tree(c.head)) == on_head
        c.worker.wait(60)  # `ray start --block` ends with its raylet

        # The node returns; Serve puts the second replica back on it.
        c.start_worker("worker-2.log")
        placed(START_TIMEOUT_S)
        print(f"replica back on the returned node {time.monotonic() - lost_at:.0f} s after the node was lost")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "both", "max_tokens": 4}, timeout=120)
        assert r.status_code == 200, r.text
        everything = tree(c.head) + tree(c.worker) + tree(serve)
        assert not loopback_only(everything), loopback_only(everything)

        # Joined, not started: the stop deletes the app and leaves the cluster up.
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=180) == 0, log_path.read_text(errors="replace")[-5000:]
        deadline = time.monotonic() + 60
        while engine_replicas(tree(c.head)) or engine_replicas(tree(c.worker)):
            assert time.monotonic() < deadline, "engine replicas outlived the app"
            time.sleep(1)
        assert c.head.poll() is None and c.worker.poll() is None
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
