"""The engine the harness measures: a real `kvsieve serve` process (SGLang
with the kvsieve plugin), started here on a free port or reached by URL, and
called through its OpenAI-compatible API like any client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import httpx

# The CLI as this interpreter's module: also where the package was installed
# with `pip --target` and its `kvsieve` script is on no PATH (the GPU host).
# -P: the checkout's own kvsieve/ (a stub the editable install maps) must not
# shadow an installed package from the working directory.
KVSIEVE = [sys.executable, "-P", "-m", "kvsieve.service.cli"]
ROOT = Path(__file__).resolve().parents[2]  # bench.eval's modules import from the checkout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(model_dir: Optional[str], extra_args: tuple[str, ...] = (), timeout: float = 900,
          log_path: Optional[Path] = None, env: Optional[dict] = None) -> Iterator[str]:
    """Start `kvsieve serve` on `model_dir` (None: the embedded default model),
    yield its base URL, stop it (SIGTERM) on exit."""
    port = free_port()
    log_path = Path(log_path or Path(tempfile.gettempdir()) / f"kvsieve-eval-serve-{port}.log")
    # patient_engine: SGLang's scheduler watchdog waits an hour, not 300 s (a
    # stalled forward on a loaded CPU would kill the server mid-grid).
    args = [*KVSIEVE, "serve", "--port", str(port), "--log-level", "warning",
            "--policy-module", "bench.eval.patient_engine", *extra_args]
    if model_dir:
        args += ["--model", str(model_dir)]
    with open(log_path, "wb") as log:
        # A measurement waits for slow requests rather than losing them to the
        # server's default 600 s request timeout (a shared 2-core CPU is slow).
        base = {"KVSIEVE_LIMITS__REQUEST_TIMEOUT_S": "86400", **os.environ, "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(ROOT)) if p)}
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**base, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvsieve serve exited with {proc.returncode}; log: {log_path}\n"
                                   f"{log_path.read_text(errors='replace')[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvsieve serve did not come up in {timeout:.0f} s; log: {log_path}")
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Client:
    """Chat completions against a kvsieve server, greedy, with token ids.
    One HTTP connection per thread: a shared httpx.Client under hundreds of
    threads failed reads with EBADF (the GPU grid, 512 in flight)."""

    def __init__(self, url: str, timeout: float = 1800):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._local = threading.local()
        self._clients: list[httpx.Client] = []
        self.model = self.http.get(f"{self.url}/v1/models").json()["data"][0]["id"]

    @property
    def http(self) -> httpx.Client:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = httpx.Client(timeout=self.timeout)
            self._clients.append(client)
        return client

    def chat(self, messages: list[dict], max_tokens: int, kv_policy) -> dict:
        """The response body (status 200) or {"error": ..., "status": code}."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                "kv_policy": kv_policy, "return_token_ids": True}
        started = time.monotonic()
        resp = self.http.post(f"{self.url}/v1/chat/completions", json=body)
        elapsed = time.monotonic() - started
        data = resp.json()
        if resp.status_code != 200:
            return {"status": resp.status_code, "error": data.get("error", data), "latency_s": elapsed}
        data["latency_s"] = elapsed
        return data

    def close(self) -> None:
        for client in self._clients:
            client.close()
