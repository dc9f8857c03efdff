"""The engine replica count over a load-test run, scraped from kvsieve's
/metrics (Ray Serve mode) every few seconds into JSON lines:

    {"t": epoch s, "reporting": kvsieve_engine_replicas,
     "serve": {state: n} from kvsieve_serve_engine_replicas{state},
     "running_requests": sum of sglang:num_running_reqs over the replicas}

A failed scrape is a line with "error" (the run goes on)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path


def sample(host: str, timeout: float = 10.0) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{host}/metrics", timeout=timeout).read().decode()
    row: dict = {"reporting": None, "serve": {}, "running_requests": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvsieve_engine_replicas":
                row["reporting"] = s.value
            elif s.name == "kvsieve_serve_engine_replicas":
                row["serve"][s.labels["state"]] = s.value
            elif s.name == "sglang:num_running_reqs":
                row["running_requests"] += s.value
    return row


class ReplicaWatch:
    """Scrapes in a thread of its own from start() until stop()."""

    def __init__(self, host: str, out: Path, every_s: float = 2.0):
        self.host, self.out, self.every_s = host, out, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-watch", daemon=True)

    def start(self) -> "ReplicaWatch":
        self.out.unlink(missing_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        with open(self.out, "a", buffering=1) as f:
            while True:
                t = time.time()
                try:
                    row = {"t": t, **sample(self.host)}
                except Exception as exc:  # noqa: BLE001 - a lost scrape is recorded, the run goes on
                    row = {"t": t, "error": f"{type(exc).__name__}: {exc}"}
                f.write(json.dumps(row) + "\n")
                if self._stop.wait(max(0.0, self.every_s - (time.time() - t))):
                    return


def read_watch(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def replica_changes(rows: list[dict], t0: float) -> list[dict]:
    """Each change of Serve's RUNNING count (else the reporting count):
    [{"t_s": seconds from t0, "replicas": n}, ...], the first row included."""
    changes: list[dict] = []
    for row in rows:
        if "error" in row:
            continue
        n = row["serve"].get("RUNNING", row["reporting"]) if row["serve"] else row["reporting"]
        if not changes or changes[-1]["replicas"] != n:
            changes.append({"t_s": round(row["t"] - t0, 1), "replicas": n})
    return changes
