"""Shared fixtures: tiny checkpoints built here, and real `kvsieve serve`
processes (real SGLang engine on CPU) started on them.

A server start costs 30-60 s on a 2-core machine, so a test that can share a
server takes one of these session fixtures instead of starting its own:

    llama_server    tiny Llama, default settings, presets file ("lossless")
    qwen3_server    tiny Qwen3, default settings
    chunked_server  tiny Llama, --chunked-prefill-size 16, the test policy
                    tests/policies_extra/recording_policy.py loaded
    guarded_server  tiny Llama, API keys on, store in a real Redis, small caps

Each is started by the first test that asks for it and stopped (and checked
to exit 0) at the end of the session. Shared means shared state: the radix
cache holds earlier tests' prompts and the counters are cumulative, so a test
reads `kv_usage.prefix_cache_hit_tokens` instead of assuming none, starts
its prompts with ids no other test uses where it needs no hit, and compares
counters before and after. A test whose server settings differ from all of
these starts its own, module-scoped (`start_server`), so it is stopped when
its module ends.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import build_tiny_model  # noqa: E402

KVSIEVE = str(Path(sys.executable).with_name("kvsieve"))

# tests/interpreted/ needs Triton's interpreter on from the process start:
# tests/test_triton_kernels.py runs it in a process of its own.
if os.environ.get("TRITON_INTERPRET") != "1":
    collect_ignore = ["interpreted"]


# ----- parallel runs: ./dev.sh test runs two pytest-xdist workers -----
# Each worker has its own session fixtures, so the scheduler below hands out
# whole groups: every file that names one of the shared servers goes to one
# worker (each server starts once), so do the Ray files (a second cluster
# beside the first would only slow both), and any other file stays whole on
# one worker (its module-scoped server starts once).
SHARED_SERVERS = ("llama_server", "qwen3_server", "chunked_server", "guarded_server")
RAY_FILES = frozenset({"test_scale_ray.py", "test_fleet_multinode.py", "test_fleet_autoscale.py"})


@functools.lru_cache(maxsize=None)
def worker_group(path: Path) -> str:
    if path.name in RAY_FILES:
        return "ray"
    text = path.read_text(errors="replace") if path.is_file() else ""
    return "shared-servers" if any(name in text for name in SHARED_SERVERS) else str(path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkerGroup(LoadScopeScheduling):
        """LoadScopeScheduling with worker_group as the scope; largest groups first."""

        def _split_scope(self, nodeid: str) -> str:
            return worker_group(config.rootpath / nodeid.split("::", 1)[0])

    return ByWorkerGroup(config, log)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    model: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a server and its SGLang children: killed alone, the main
    process leaves its scheduler behind, holding memory and CPU for the rest
    of the session."""
    import psutil

    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


#: Tries of start_server when its port was taken while the engine started.
PORT_TRIES = 3


class PortTaken(RuntimeError):
    """The server's port was free when chosen and taken by another process
    before the server bound it (the engine starts for ~20 s first)."""


def start_server(log_dir: Path, *args: str, timeout: float = 600, env: dict | None = None) -> Server:
    for attempt in range(PORT_TRIES):
        try:
            return _start_server_once(log_dir, *args, timeout=timeout, env=env)
        except PortTaken:
            if attempt == PORT_TRIES - 1:
                raise


def _start_server_once(log_dir: Path, *args: str, timeout: float, env: dict | None) -> Server:
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [KVSIEVE, "serve", "--port", str(port), "--log-level", "warning", *args],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = log_path.read_text()
            kill_tree(proc)  # its SGLang children may outlive it
            if "address already in use" in text:
                raise PortTaken(f"port {port} taken before kvsieve serve bound it:\n{text[-2000:]}")
            raise RuntimeError(f"kvsieve serve exited with {proc.returncode}:\n{text}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                model = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
                return Server(proc, url, model, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    kill_tree(proc)
    raise TimeoutError(f"kvsieve serve did not come up:\n{log_path.read_text()}")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3", "qwen3")


@pytest.fixture(scope="session")
def presets_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("presets") / "presets.json"
    path.write_text('{"lossless": {"name": "full"}}')
    return path


@pytest.fixture(scope="session")
def llama_server(tiny_llama, presets_file, tmp_path_factory):
    """Tiny Llama with SGLang's defaults and a presets file ({"lossless": full})."""
    server = start_server(tmp_path_factory.mktemp("logs"), "--model", str(tiny_llama),
                          "--presets", str(presets_file))
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="session")
def qwen3_server(tiny_qwen3, tmp_path_factory):
    """Tiny Qwen3 with SGLang's defaults."""
    server = start_server(tmp_path_factory.mktemp("logs"), "--model", str(tiny_qwen3))
    yield server
    assert server.stop() == 0, server.log()


EXTRA_POLICIES = Path(__file__).parent / "policies_extra"


@pytest.fixture(scope="session")
def chunked_server(tiny_llama, tmp_path_factory):
    """Tiny Llama with 16-token prefill chunks: a longer prompt is prefilled
    (and stored in the region) over several extend passes. It also serves
    the test policy `test_recording` (tests/policies_extra), which only the
    requests that name it use."""
    server = start_server(tmp_path_factory.mktemp("chunked"), "--model", str(tiny_llama),
                          "--chunked-prefill-size", "16", "--policy-module", "recording_policy",
                          env={"PYTHONPATH": str(EXTRA_POLICIES)})
    yield server
    assert server.stop() == 0, server.log()


# ----- scale-out: a real redis-server, and a guarded server -----

@dataclass
class RedisServer:
    """A redis-server of the test's own (Debian package), restartable on the
    same port to test outages."""

    port: int
    workdir: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20) -> None:
        import redis

        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=self.port, socket_timeout=1).ping():
                    return
            except redis.RedisError:
                time.sleep(0.1)
        raise TimeoutError("redis-server did not come up")

    def stop(self) -> None:
        """Shut down, saving the data set to disk: a restart finds it again,
        as a production Redis with persistence would."""
        import redis

        if self.proc is not None and self.proc.poll() is None:
            try:
                redis.Redis(port=self.port, socket_timeout=5).shutdown(save=True)
            except redis.ConnectionError:
                pass  # the connection drops as the server exits
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(free_port(), tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def session_redis(tmp_path_factory):
    server = RedisServer(free_port(), tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


def kvsieve_cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([KVSIEVE, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@dataclass
class GuardedServer:
    server: Server
    redis: RedisServer
    env: dict
    key: str  # an API key with a generous rate limit

    @property
    def url(self) -> str:
        return self.server.url

    def headers(self, key: str | None = None) -> dict:
        return {"Authorization": f"Bearer {key or self.key}"}


@pytest.fixture(scope="session")
def guarded_server(tiny_llama, session_redis, tmp_path_factory):
    """`kvsieve serve` (one process) with API keys on, presets and keys in a
    real Redis, and small caps (settings from a YAML file and the environment)."""
    workdir = tmp_path_factory.mktemp("guarded")
    config = workdir / "kvsieve.yaml"
    config.write_text(
        "auth:\n  enabled: true\n"
        "limits:\n  max_tokens: 16\n  max_prompt_tokens: 256\n  max_kv_budget: 512\n"
        "  max_body_bytes: 65536\n  request_timeout_s: 60\n"
        "store:\n  refresh_interval_s: 0.2\n  timeout_s: 0.3\n"
    )
    env = {"KVSIEVE_STORE__URL": session_redis.url, "KVSIEVE_CONFIG": str(config)}
    created = kvsieve_cli("keys", "create", "fuzzer", "--rate", "1000", "--burst", "1000", env=env)
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    server = start_keyed_server(workdir, key, "--model", str(tiny_llama), "--config", str(config), env=env)
    yield GuardedServer(server, session_redis, env, key)
    assert server.stop() == 0, server.log()


def start_keyed_server(log_dir: Path, key: str, *args: str, timeout: float = 600, env: dict | None = None) -> Server:
    """start_server for a server that wants an API key on /v1/*."""
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    proc = subprocess.Popen(
        [KVSIEVE, "serve", "--port", str(port), "--log-level", "warning", *args],
        stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvsieve serve exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5)
                return Server(proc, url, models.json()["data"][0]["id"], log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    kill_tree(proc)
    raise TimeoutError(f"kvsieve serve did not come up:\n{log_path.read_text()}")
