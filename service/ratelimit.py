"""Per-key token buckets: `rate` requests per second refill, up to `burst`.

In memory in the process that admits requests (the single server, or each
ingress replica: with N ingress replicas a key gets up to N times its rate).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class _Bucket:
    tokens: float
    stamp: float
    rate: float
    burst: int


class RateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic, max_keys: int = 100_000):
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._max_keys = max_keys

    def acquire(self, key: str, rate: float, burst: int) -> Optional[float]:
        """Take one token; None if granted, else seconds until one is available."""
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None or bucket.rate != rate or bucket.burst != burst:
            if len(self._buckets) >= self._max_keys:
                self._buckets.clear()  # bounded memory; a reset only ever grants more
            bucket = self._buckets[key] = _Bucket(float(burst), now, rate, burst)
        bucket.tokens = min(float(bucket.burst), bucket.tokens + (now - bucket.stamp) * bucket.rate)
        bucket.stamp = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return None
        return (1.0 - bucket.tokens) / bucket.rate

    @staticmethod
    def retry_after_header(wait_s: float) -> str:
        return str(max(1, math.ceil(wait_s)))
