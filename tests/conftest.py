"""Shared fixtures: tiny checkpoints built here, and real `kvsieve serve`
processes (real SGLang engine on CPU) started on them."""

from __future__ import annotations

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


def start_server(log_dir: Path, *args: str, timeout: float = 600, env: dict | None = None) -> Server:
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
            raise RuntimeError(f"kvsieve serve exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                model = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
                return Server(proc, url, model, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
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
    server = start_server(tmp_path_factory.mktemp("logs"), "--model", str(tiny_llama),
                          "--presets", str(presets_file))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def qwen3_server(tiny_qwen3, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("logs"), "--model", str(tiny_qwen3))
    yield server
    server.stop()
