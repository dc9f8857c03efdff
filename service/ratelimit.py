"""Per-key token buckets: `rate` requests per second refill, up to `burst`.

`RateLimiter`: in memory in the process that admits requests (the single
server, or each ingress replica when there is no Redis: with N ingress
replicas a key then gets up to N times its rate).

`RedisRateLimiter`: one bucket per key in Redis, shared by every ingress
replica (store.url redis://...), so a key's budget holds cluster-wide. Each
take is one Lua script, atomic on the Redis server and timed by Redis's own
clock (ingress hosts need not agree on the time). Redis unreachable: each
ingress falls back to its in-memory bucket (requests keep flowing, limited
per ingress) and logs it once per outage.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

logger = logging.getLogger(__name__)


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


# KEYS[1]: the bucket (hash: tokens, stamp); ARGV: rate per s, burst.
# Returns the wait in seconds as a string ("0": granted); Lua numbers would
# come back truncated to integers.
_TAKE = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'stamp')
local tokens = tonumber(state[1])
local stamp = tonumber(state[2])
if tokens == nil or stamp == nil then
  tokens = burst
  stamp = now
end
tokens = math.min(burst, tokens + math.max(0, now - stamp) * rate)
local wait = 0
if tokens >= 1 then
  tokens = tokens - 1
else
  wait = (1 - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens), 'stamp', string.format('%.17g', now))
-- A full bucket needs no record: it expires once it would have refilled.
redis.call('EXPIRE', KEYS[1], math.ceil(burst / rate) + 1)
return string.format('%.17g', wait)
"""


class RedisRateLimiter:
    """RateLimiter's interface on buckets in Redis (see the module doc)."""

    def __init__(self, url: str, timeout_s: float = 0.5, prefix: str = "kvsieve:ratelimit:"):
        import redis

        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           decode_responses=True)
        self._take = self._redis.register_script(_TAKE)
        self._prefix = prefix
        self._local = RateLimiter()
        self._down = False

    def acquire(self, key: str, rate: float, burst: int) -> Optional[float]:
        import redis

        try:
            wait = float(self._take(keys=[self._prefix + key], args=[repr(float(rate)), int(burst)]))
        except redis.RedisError as exc:
            if not self._down:
                self._down = True
                logger.warning("rate limits: redis unreachable (%s); limiting per ingress until it is back", exc)
            return self._local.acquire(key, rate, burst)
        if self._down:
            self._down = False
            logger.warning("rate limits: redis reachable again; limits are cluster-wide again")
        return None if wait <= 0 else wait

    retry_after_header = staticmethod(RateLimiter.retry_after_header)

    def close(self) -> None:
        self._redis.close()


def rate_limiter_for(store_url: str, timeout_s: float = 0.5):
    """Buckets in Redis when the store is on Redis (shared by every ingress),
    else in this process."""
    if store_url.startswith(("redis://", "rediss://", "unix://")):
        return RedisRateLimiter(store_url, timeout_s)
    return RateLimiter()
