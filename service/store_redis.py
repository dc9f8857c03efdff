"""The store on Redis, shared by every replica and ingress of a deployment.

Layout (prefix `kvsieve:`): `presets` and `keys` are hashes of JSON values,
`artifact:<kind>:<model>` strings, `artifacts` a set of `<kind>\\n<model>`,
`version` a counter bumped in the same MULTI/EXEC as every write, so a poller
that sees the counter move reads the write too.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Optional, TypeVar

import redis

from .store import KeyRecord, Snapshot, Store, StoreUnavailable, _check_artifact_key

T = TypeVar("T")


class RedisStore(Store):
    def __init__(self, url: str, timeout_s: float = 0.5, prefix: str = "kvsieve:"):
        self.url = url
        self.prefix = prefix
        # Short timeouts: an unreachable Redis must not stall a poll for long;
        # servers keep serving from their last snapshot meanwhile.
        self._redis = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True,
        )

    def _k(self, name: str) -> str:
        return self.prefix + name

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except redis.RedisError as exc:
            raise StoreUnavailable(f"redis store: {type(exc).__name__}: {exc}") from exc

    def _write(self, *ops: Callable[[Any], None]) -> list:
        def run():
            pipe = self._redis.pipeline(transaction=True)
            for op in ops:
                op(pipe)
            pipe.incr(self._k("version"))
            return pipe.execute()

        return self._call(run)

    # presets -----------------------------------------------------------------
    def list_presets(self) -> dict[str, dict]:
        raw = self._call(lambda: self._redis.hgetall(self._k("presets")))
        return {name: json.loads(value) for name, value in raw.items()}

    def set_preset(self, name: str, value: dict) -> None:
        self._write(lambda p: p.hset(self._k("presets"), name, json.dumps(value)))

    def delete_preset(self, name: str) -> bool:
        return bool(self._write(lambda p: p.hdel(self._k("presets"), name))[0])

    # artifacts -------------------------------------------------------------
    def _artifact_key(self, kind: str, model: str) -> str:
        return self._k(f"artifact:{kind}:{model}")

    def put_artifact(self, kind: str, model: str, data: Any) -> None:
        _check_artifact_key(kind, model)
        payload = json.dumps({"data": data, "updated": time.time()})
        self._write(
            lambda p: p.set(self._artifact_key(kind, model), payload),
            lambda p: p.sadd(self._k("artifacts"), f"{kind}\n{model}"),
        )

    def get_artifact(self, kind: str, model: str) -> Optional[Any]:
        _check_artifact_key(kind, model)
        raw = self._call(lambda: self._redis.get(self._artifact_key(kind, model)))
        return None if raw is None else json.loads(raw)["data"]

    def list_artifacts(self) -> list[tuple[str, str]]:
        members = self._call(lambda: self._redis.smembers(self._k("artifacts")))
        return sorted(tuple(m.split("\n", 1)) for m in members)

    # API keys ----------------------------------------------------------------
    def put_key(self, record: KeyRecord) -> None:
        self._write(lambda p: p.hset(self._k("keys"), record.key_id, json.dumps(record.to_json())))

    def delete_key(self, key_id: str) -> bool:
        return bool(self._write(lambda p: p.hdel(self._k("keys"), key_id))[0])

    def list_keys(self) -> dict[str, KeyRecord]:
        raw = self._call(lambda: self._redis.hgetall(self._k("keys")))
        return {k: KeyRecord.from_json(json.loads(v)) for k, v in raw.items()}

    # change detection --------------------------------------------------------
    def version(self) -> int:
        return int(self._call(lambda: self._redis.get(self._k("version"))) or 0)

    def snapshot(self) -> Snapshot:
        def read():
            pipe = self._redis.pipeline(transaction=True)
            pipe.get(self._k("version"))
            pipe.hgetall(self._k("presets"))
            pipe.hgetall(self._k("keys"))
            return pipe.execute()

        version, presets, keys = self._call(read)
        return Snapshot(
            int(version or 0),
            {n: json.loads(v) for n, v in presets.items()},
            {k: KeyRecord.from_json(json.loads(v)) for k, v in keys.items()},
        )

    def close(self) -> None:
        self._redis.close()
