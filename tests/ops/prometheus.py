"""A real Prometheus server for tests: deploy/prometheus/prometheus.yml with its
targets pointed at a server on loopback and a fast scrape, plus its HTTP API."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import yaml

from .paths import PROMETHEUS_CONFIG, RULES, tool


def scrape_config_for(target: str, interval: str = "1s") -> dict:
    """The compose config, scraping `target` (host:port) every `interval`."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(scrape_interval=interval, evaluation_interval=interval)
    config["rule_files"] = [str(RULES)]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "kvsieve"]
    job["static_configs"] = [{"targets": [target]}]
    return config


class Prometheus:
    def __init__(self, workdir: Path, config: dict, port: int):
        self.url = f"http://127.0.0.1:{port}"
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [tool("prometheus"), f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited:\n{self.log_path.read_text()}"
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"prometheus not ready:\n{self.log_path.read_text()}")

    def api(self, path: str, **params) -> httpx.Response:
        return httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> dict:
        """The JSON answer of /api/v1/query_range (status "error" for a query that does not parse)."""
        return self.api("query_range", query=expr, start=start, end=end, step=step).json()

    def query(self, expr: str, at: float | None = None) -> dict:
        params = {"query": expr} if at is None else {"query": expr, "time": at}
        return self.api("query", **params).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def has_values(answer: dict) -> bool:
    """A query_range answer with at least one finite sample."""
    for series in answer.get("data", {}).get("result", []):
        for _, value in series["values"]:
            if value not in ("NaN", "+Inf", "-Inf"):
                return True
    return False
