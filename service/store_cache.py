"""A server's in-memory copy of the store's presets and keys.

A daemon thread polls the store's version every `refresh_interval_s` and
reloads when it moved, so `kvsieve presets set` / `keys create` reach running
servers without a restart. When the store cannot be reached the last good
snapshot stays in use: one warning when it goes, one when it is back, and
kvsieve_store_up / kvsieve_store_errors_total meanwhile.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

from .metrics import STORE_ERRORS, STORE_UP
from .presets import validate_presets
from .store import KeyRecord, Snapshot, Store, StoreUnavailable

logger = logging.getLogger(__name__)


class StoreMirror:
    def __init__(self, store: Store, backend: str, refresh_interval_s: float = 1.0):
        self.store = store
        self.backend = backend
        self.interval = refresh_interval_s
        self._snapshot = Snapshot(version=-1, presets={}, keys={})
        self._up: Optional[bool] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # what the request path reads (a reference swap: no lock needed) ----------
    @property
    def presets(self) -> dict[str, dict]:
        return self._snapshot.presets

    @property
    def keys(self) -> dict[str, KeyRecord]:
        return self._snapshot.keys

    @property
    def version(self) -> int:
        return self._snapshot.version

    @property
    def up(self) -> bool:
        return bool(self._up)

    # polling ---------------------------------------------------------------
    def refresh(self) -> bool:
        """Poll once; True when the store answered."""
        try:
            if self._up and self.store.version() == self._snapshot.version:
                self._mark(True)
                return True
            snap = self.store.snapshot()
        except StoreUnavailable as exc:
            STORE_ERRORS.labels(self.backend).inc()
            if self._up is not False:
                logger.warning("store unreachable (%s); serving with the last known presets and keys "
                               "(version %d) until it is back", exc, self._snapshot.version)
            self._mark(False)
            return False
        if snap.version != self._snapshot.version:
            self._snapshot = Snapshot(snap.version, self._valid_presets(snap.presets), snap.keys)
        if self._up is False:
            logger.warning("store reachable again (version %d)", snap.version)
        self._mark(True)
        return True

    def _mark(self, up: bool) -> None:
        self._up = up
        STORE_UP.labels(self.backend).set(1 if up else 0)

    @staticmethod
    def _valid_presets(presets: dict) -> dict[str, dict]:
        # A bad preset written behind the CLI's back is dropped, not served.
        valid = {}
        for name, value in presets.items():
            try:
                valid.update(validate_presets({name: value}))
            except ValueError as exc:
                logger.warning("store: ignoring preset %r: %s", name, exc)
        return valid

    def start(self) -> "StoreMirror":
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="kvsieve-store-poll", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.refresh()
            except Exception:  # never let the poller die
                logger.exception("store poll failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.store.close()
