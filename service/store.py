"""The shared store: named kv_policy presets, calibration artifacts keyed by
(kind, model), and API keys (hashed). One interface, two back-ends: a JSON
file (the embedded default) and Redis (service/store_redis.py, shared by every
replica of a deployment).

Every write bumps a version number; servers poll it (service/store_cache.py)
and reload presets and keys when it moves, so changes reach running replicas
without a restart.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional


class StoreUnavailable(ConnectionError):
    """The store cannot be reached right now (Redis down, file unreadable)."""


@dataclass(frozen=True)
class KeyRecord:
    """An API key as stored: never the key itself, only its SHA-256."""

    key_id: str
    name: str
    secret_sha256: str
    rate_per_s: Optional[float] = None  # None: the server's default
    burst: Optional[int] = None
    created: float = field(default_factory=time.time)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "KeyRecord":
        return cls(**data)


@dataclass(frozen=True)
class Snapshot:
    """What a server keeps in memory: presets and keys at one store version."""

    version: int
    presets: dict[str, dict]
    keys: dict[str, KeyRecord]


class Store(ABC):
    # presets -------------------------------------------------------------
    @abstractmethod
    def list_presets(self) -> dict[str, dict]: ...

    @abstractmethod
    def set_preset(self, name: str, value: dict) -> None: ...

    @abstractmethod
    def delete_preset(self, name: str) -> bool: ...

    def get_preset(self, name: str) -> Optional[dict]:
        return self.list_presets().get(name)

    # calibration artifacts (ThinKV thresholds, SkipKV vectors, ...) ----------
    @abstractmethod
    def put_artifact(self, kind: str, model: str, data: Any) -> None:
        """Store a JSON-serialisable artifact of `kind` for `model`, replacing any."""

    @abstractmethod
    def get_artifact(self, kind: str, model: str) -> Optional[Any]: ...

    @abstractmethod
    def list_artifacts(self) -> list[tuple[str, str]]:
        """(kind, model) pairs present."""

    # API keys --------------------------------------------------------------
    @abstractmethod
    def put_key(self, record: KeyRecord) -> None: ...

    @abstractmethod
    def delete_key(self, key_id: str) -> bool: ...

    @abstractmethod
    def list_keys(self) -> dict[str, KeyRecord]: ...

    # change detection --------------------------------------------------------
    @abstractmethod
    def version(self) -> int:
        """A number that grows with every write."""

    def snapshot(self) -> Snapshot:
        version = self.version()
        return Snapshot(version, self.list_presets(), self.list_keys())

    def close(self) -> None:
        pass


def _check_artifact_key(kind: str, model: str) -> None:
    for label, value in (("kind", kind), ("model", model)):
        if not isinstance(value, str) or not value or "\n" in value:
            raise ValueError(f"artifact {label} must be a non-empty one-line string")


class FileStore(Store):
    """A JSON file, locked with flock for each read-modify-write: enough for
    one machine (the embedded set-up), several processes included."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self._lock_path = self.path.with_name(self.path.name + ".lock")

    @contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self._lock_path, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
                try:
                    yield
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
        except OSError as exc:
            raise StoreUnavailable(f"file store {self.path}: {exc}") from exc

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            data = {}
        except (OSError, json.JSONDecodeError) as exc:
            raise StoreUnavailable(f"file store {self.path}: {exc}") from exc
        for section in ("presets", "keys", "artifacts"):
            data.setdefault(section, {})
        data.setdefault("version", 0)
        return data

    def _write(self, data: dict) -> None:
        data["version"] = int(data.get("version", 0)) + 1
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, self.path)  # readers see the old or the new file, never half

    @contextmanager
    def _update(self) -> Iterator[dict]:
        with self._locked(exclusive=True):
            data = self._read()
            yield data
            self._write(data)

    def _view(self) -> dict:
        with self._locked(exclusive=False):
            return self._read()

    def list_presets(self) -> dict[str, dict]:
        return dict(self._view()["presets"])

    def set_preset(self, name: str, value: dict) -> None:
        with self._update() as data:
            data["presets"][name] = value

    def delete_preset(self, name: str) -> bool:
        with self._locked(exclusive=True):
            data = self._read()
            if name not in data["presets"]:
                return False
            del data["presets"][name]
            self._write(data)
            return True

    def put_artifact(self, kind: str, model: str, data: Any) -> None:
        _check_artifact_key(kind, model)
        with self._update() as stored:
            stored["artifacts"][f"{kind}\n{model}"] = {"data": data, "updated": time.time()}

    def get_artifact(self, kind: str, model: str) -> Optional[Any]:
        _check_artifact_key(kind, model)
        entry = self._view()["artifacts"].get(f"{kind}\n{model}")
        return None if entry is None else entry["data"]

    def list_artifacts(self) -> list[tuple[str, str]]:
        return sorted(tuple(k.split("\n", 1)) for k in self._view()["artifacts"])

    def put_key(self, record: KeyRecord) -> None:
        with self._update() as data:
            data["keys"][record.key_id] = record.to_json()

    def delete_key(self, key_id: str) -> bool:
        with self._locked(exclusive=True):
            data = self._read()
            if key_id not in data["keys"]:
                return False
            del data["keys"][key_id]
            self._write(data)
            return True

    def list_keys(self) -> dict[str, KeyRecord]:
        return {k: KeyRecord.from_json(v) for k, v in self._view()["keys"].items()}

    def version(self) -> int:
        return int(self._view()["version"])

    def snapshot(self) -> Snapshot:
        data = self._view()  # one read: presets and keys of the same version
        keys = {k: KeyRecord.from_json(v) for k, v in data["keys"].items()}
        return Snapshot(int(data["version"]), dict(data["presets"]), keys)


def open_store(url: str, timeout_s: float = 0.5) -> Store:
    """file://PATH or redis://HOST:PORT/DB (also rediss://, unix://)."""
    if url.startswith("file://"):
        return FileStore(url[len("file://"):])
    if url.startswith(("redis://", "rediss://", "unix://")):
        from .store_redis import RedisStore

        return RedisStore(url, timeout_s=timeout_s)
    raise ValueError(f"store.url: unknown scheme in {url!r}")
