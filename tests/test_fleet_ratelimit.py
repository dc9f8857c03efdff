"""Rate limits that hold cluster-wide: token buckets in a real redis-server,
taken by a Lua script. The HTTP side, with two ingress
replicas on Ray, is in tests/test_scale_ray.py."""

import threading
import time

from kvsieve.service.ratelimit import RateLimiter, RedisRateLimiter, rate_limiter_for


def test_two_ingresses_share_one_budget(session_redis):
    # Two limiters = two ingress processes with their own connections.
    a, b = RedisRateLimiter(session_redis.url), RedisRateLimiter(session_redis.url)
    granted = [lim.acquire("fleet-alice", 0.5, 5) is None for lim in (a, b, a, b, a, b, a)]
    assert granted == [True] * 5 + [False] * 2
    wait = b.acquire("fleet-alice", 0.5, 5)
    assert 1.0 < wait <= 2.0  # one token refills in 2 s at 0.5/s
    assert a.acquire("fleet-bob", 0.5, 5) is None  # buckets are per key
    time.sleep(wait + 0.1)
    assert a.acquire("fleet-alice", 0.5, 5) is None and b.acquire("fleet-alice", 0.5, 5) is not None


def test_concurrent_takes_are_atomic(session_redis):
    limiters = [RedisRateLimiter(session_redis.url) for _ in range(2)]
    grants = []
    lock = threading.Lock()

    def hammer(lim):
        for _ in range(30):
            ok = lim.acquire("fleet-carol", 0.001, 40) is None
            with lock:
                grants.append(ok)

    threads = [threading.Thread(target=hammer, args=(limiters[i % 2],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # 240 takes racing on two connections: exactly the burst gets through
    # (a read-modify-write without the script would grant more).
    assert sum(grants) == 40 and len(grants) == 240


def test_redis_outage_falls_back_to_the_local_bucket(redis_server, caplog):
    lim = RedisRateLimiter(redis_server.url, timeout_s=0.3)
    assert lim.acquire("dave", 0.01, 2) is None  # Redis's bucket: one token left
    redis_server.stop()  # saves the data set; the restart finds the bucket again
    with caplog.at_level("WARNING", logger="kvsieve.service.ratelimit"):
        assert lim.acquire("dave", 0.01, 2) is None  # the local bucket, full: its own burst
        assert lim.acquire("dave", 0.01, 2) is None
        assert lim.acquire("dave", 0.01, 2) is not None
    assert sum("redis unreachable" in r.message for r in caplog.records) == 1  # once per outage
    redis_server.start()
    with caplog.at_level("WARNING", logger="kvsieve.service.ratelimit"):
        # Redis's bucket again (the local one is empty for 100 s): its last token, then no more.
        assert lim.acquire("dave", 0.01, 2) is None
        assert lim.acquire("dave", 0.01, 2) is not None
    assert any("reachable again" in r.message for r in caplog.records)


def test_the_store_decides_the_limiter(tmp_path):
    assert isinstance(rate_limiter_for(f"file://{tmp_path}/s.json"), RateLimiter)
    assert isinstance(rate_limiter_for("redis://127.0.0.1:1/0"), RedisRateLimiter)
