"""`kvsieve serve --replicas 2` on real Ray (in-process, CPU, on loopback)
with the tiny model and two ingress replicas: kvsieve's API through the
ingress, per-replica metrics, presets and API keys from a real Redis, a rate
limit that holds across both ingress replicas, a client disconnect, a
replica killed mid-load, and the stop: drain, abort past the grace, exit 0,
no process left. One Ray start-up for the whole module."""

import json
import os
import shutil
import signal
import subprocess
import threading
import time

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import KVSIEVE, free_port, kvsieve_cli
from helpers.procs import tree_cpu_seconds
from kvsieve.service.config import load_settings
from kvsieve.service.scale.application import engine_deployment_options
from kvsieve.service.scale.hub import STALE_AFTER_S
from kvsieve.service.scale.replica import PUSH_INTERVAL_S
from kvsieve.service.sse_client import sse_lines

START_TIMEOUT_S = 600  # two engines and Ray on a shared 2-core machine


def test_the_rayservice_entry_point_builds_the_application_from_its_args():
    # What the helm chart's RayService names as its import_path.
    from ray.serve import Application

    from kvsieve.service.scale.application import app_builder

    app = app_builder({"ray": {"replicas": 2}, "limits": {"max_tokens": 64}})
    assert isinstance(app, Application)
    with pytest.raises(ValueError, match="ray"):
        app_builder({"ray": {"replicas": 0}})


def test_deployment_options_from_settings():
    fixed = engine_deployment_options(load_settings(ray={"replicas": 3, "graceful_shutdown_timeout_s": 12}), "/tmp/x")
    assert fixed["num_replicas"] == 3 and fixed["graceful_shutdown_timeout_s"] == 12
    assert fixed["ray_actor_options"]["runtime_env"]["env_vars"]["PROMETHEUS_MULTIPROC_DIR"] == "/tmp/x"
    auto = engine_deployment_options(load_settings(ray={"autoscaling": {
        "min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2}}), "/tmp/x")
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 1,
                                          "target_ongoing_requests": 2.0, "upscale_delay_s": 10.0,
                                          "downscale_delay_s": 60.0, "look_back_period_s": 30.0,
                                          "metrics_interval_s": 10.0}


def metric_samples(text: str, name: str) -> list:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


def replica_sum(text: str, name: str, **labels) -> float:
    """`name` summed over the engine replicas' samples that carry `labels`."""
    return sum(x.value for x in metric_samples(text, name)
               if "replica" in x.labels and all(x.labels.get(k) == v for k, v in labels.items()))


def engine_replica_procs(root: psutil.Process) -> list[psutil.Process]:
    found = []
    for proc in root.children(recursive=True):
        try:
            if "ServeReplica:kvsieve:EngineReplica" in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            pass
    return found


class RayService:
    def __init__(self, proc, url, log_path, env, key):
        self.proc, self.url, self.log_path, self.env, self.key = proc, url, log_path, env, key

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"}

    def post(self, path: str, body: dict, key: str | None = None, timeout: float = 120) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=timeout,
                          headers={"Authorization": f"Bearer {key or self.key}"})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=30).text

    def replicas_reporting(self) -> float:
        samples = metric_samples(self.metrics(), "kvsieve_engine_replicas")
        return samples[0].value if samples else 0

    def wait_for_replicas(self, n: int, timeout: float, not_before: float = 0.0, exclude: tuple = ()) -> None:
        """n engine replicas initialized (their process title no longer names
        the init call) and reporting metrics; `not_before`: a killed replica's
        last push ages out of the hub (hub.STALE_AFTER_S) before counting."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvsieve serve exited:\n{self.log()[-5000:]}")
            try:
                ready = [p for p in engine_replica_procs(psutil.Process(self.proc.pid))
                         if p.pid not in exclude and p.status() != psutil.STATUS_ZOMBIE
                         and "initialize" not in " ".join(p.cmdline())]
                if len(ready) == n and time.monotonic() >= not_before and self.replicas_reporting() == n:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise TimeoutError(f"{n} engine replicas did not report:\n{self.log()[-5000:]}")


# ray.graceful_shutdown_timeout_s: the stop's drain. Not shorter: under a
# loaded suite the refusal can take several seconds to start, and a request
# can wait in Ray's proxy for as long (CI: 6.8 s, with a 6 s grace).
GRACE_S = 12
# The drain test's long streams: far more than any CPU decodes inside the
# grace. 1,900 tokens were not: six of them on two idle cores finished inside
# 8 s, and under load the client reads a stream's chunks many seconds after
# the engine made them (CI: the streams' second chunks came ~20 s apart and
# all six ended inside the grace).
LONG_TOKENS = 8000
# Probes test_stop_drains_then_aborts sends after SIGTERM however late its thread runs.
MIN_PROBES = 3


@pytest.fixture(scope="module")
def long_llama(tiny_llama, tmp_path_factory):
    """tiny_llama with a context of 8,192 (2,048 caps a stream near 2,000
    tokens): rotary positions, no position table, so the weights are the same."""
    out = tmp_path_factory.mktemp("models") / "tiny-llama-8k"
    shutil.copytree(tiny_llama, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def ray_service(long_llama, session_redis, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ray")
    config = workdir / "kvsieve.yaml"
    config.write_text(
        f"ray:\n  replicas: 2\n  ingress_replicas: 2\n  num_cpus_per_replica: 1\n  routing: prefix\n"
        f"  graceful_shutdown_timeout_s: {GRACE_S}\n  health_check_period_s: 2\n"
        "auth:\n  enabled: true\n"
        # request_timeout_s: far past any stream here; under CI's load the drain
        # test's streams can start minutes apart, and one that reached the
        # timeout before the drain's deadline rightly ended in a 504.
        f"limits:\n  max_tokens: {LONG_TOKENS}\n  request_timeout_s: 1800\n"
        # timeout_s: a slow Redis answer on a loaded machine is not an outage here
        "store:\n  refresh_interval_s: 0.2\n  timeout_s: 5\n"
        # max_total_tokens: the drain test's seven streams, even all on one replica
        "engine:\n  max_total_tokens: 65536\n"
        # info: the ingresses' disconnect lines reach this log (Ray forwards worker output)
        "server:\n  log_level: info\n"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVSIEVE_STORE__URL": session_redis.url}
    created = kvsieve_cli("keys", "create", "ray-tests", "--rate", "1000", "--burst", "1000", env=env)
    assert created.returncode == 0, created.stderr
    for attempt in range(3):
        port = free_port()
        log_path = workdir / f"serve-{attempt}.log"
        proc = subprocess.Popen([KVSIEVE, "serve", "--model", str(long_llama), "--config", str(config),
                                 "--port", str(port)], stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        service = RayService(proc, f"http://127.0.0.1:{port}", log_path, env, created.stdout.strip())
        try:
            service.wait_for_replicas(2, START_TIMEOUT_S)
            break
        except RuntimeError:
            # free_port's port may be taken by another process before Ray's
            # proxy binds it (CI: "Address already in use"): a new port.
            _stop(proc)
            if attempt == 2 or "Address already in use" not in service.log():
                raise
    try:
        yield service
    finally:
        _stop(proc)  # the drain test stops it itself


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of its Ray processes is left
    except ProcessLookupError:
        pass
    proc.wait()


def _stream(s: RayService, body: dict, out: dict, started: threading.Event | None = None) -> None:
    """One streaming completion; records chunks, the error event if any, the end."""
    out.update(chunks=0, error=None, finish=None, kv_usage=None, done=False, status=None, ended=None)
    try:
        with httpx.stream("POST", f"{s.url}/v1/completions", json={**body, "stream": True}, timeout=300,
                          headers=s.headers) as r:
            out["status"] = r.status_code
            for line in sse_lines(r):
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = event["error"]
                    continue
                out["chunks"] += 1
                if started is not None and out["chunks"] >= 2:
                    started.set()
                choice = event["choices"][0]
                if choice["finish_reason"]:
                    out["finish"], out["kv_usage"] = choice["finish_reason"], event.get("kv_usage")
    except httpx.HTTPError as exc:
        out["error"] = {"transport": repr(exc)}
    out["ended"] = time.monotonic()


def test_api_and_metrics_per_replica(ray_service):
    s = ray_service
    assert kvsieve_cli("presets", "set", "ray-house", '{"name": "full"}', env=s.env).returncode == 0
    deadline = time.monotonic() + 15
    while True:  # the ingress sees the new preset without a restart
        r = s.post("/v1/completions", {
            "prompt": "one two three", "max_tokens": 6, "ignore_eos": True, "kv_policy": "ray-house"})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert r.status_code == 200, r.text
    assert r.json()["kv_usage"]["preset"] == "ray-house" and r.json()["usage"]["completion_tokens"] == 6

    bad = s.post("/v1/completions", {"prompt": "x", "kv_policy": {"name": "full", "budget": -1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_policy.budget"

    # Distinct prompts, each routed to its prefix's preferred replica
    # (service/scale/routing.py): 8 of them all preferred one replica once in
    # CI (probability 2 / 2^8 per run); 16 do so with probability 2 / 2^16.
    outs = [{} for _ in range(16)]
    threads = [threading.Thread(target=_stream, args=(s, {"prompt": f"the model thinks {i}", "max_tokens": 24,
                                                         "ignore_eos": True, "kv_policy": {"name": "full"}}, o))
               for i, o in enumerate(outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(o["finish"] == "length" and o["done"] and o["kv_usage"]["policy"] == "full" for o in outs), outs

    time.sleep(3)  # one metrics push interval (2 s) and some
    text = s.metrics()
    served = metric_samples(text, "kvsieve_requests_total")
    replicas = {x.labels["replica"] for x in served if x.labels.get("status") == "ok" and x.value > 0}
    assert len(replicas) == 2, served  # both replicas served, each labelled
    assert any(x.labels.get("replica") in replicas for x in metric_samples(text, "kvsieve_e2e_latency_seconds_count"))
    assert any(f.name.startswith("sglang:") and any("replica" in x.labels for x in f.samples)
               for f in text_string_to_metric_families(text))
    assert metric_samples(text, "kvsieve_engine_replicas")[0].value == 2
    assert metric_samples(text, "kvsieve_store_up")[0].value == 1


def generating(procs: list[psutil.Process], deadline: float, in_flight=lambda: True,
               busy: float = 0.2) -> psutil.Process | None:
    """The first process whose tree uses more than `busy` CPU seconds per
    second (a replica with streams in flight), the busiest of a 1 s window;
    None once `in_flight()` says the load has ended."""
    while True:
        before = [tree_cpu_seconds(p) for p in procs]
        time.sleep(1.0)
        used = [tree_cpu_seconds(p) - b for p, b in zip(procs, before)]
        if max(used) > busy:
            return procs[used.index(max(used))]
        if not in_flight():
            return None
        assert time.monotonic() < deadline, f"no engine replica is generating (CPU s/s: {used})"


def _load_and_pick_victim(s: RayService, max_tokens: int):
    """Twelve streams of `max_tokens`; once each has its first chunk (or one
    has ended), the replica that is generating. (outs, threads, victim):
    victim None when every stream ended before a replica was seen busy."""
    # A prompt per stream: prefix routing sends one prompt to one preferred
    # replica (rendezvous hashing), so a shared prompt put every stream on one
    # replica whenever Serve's cached queue lengths lagged; 12 distinct
    # prompts all prefer the same replica with probability 2 / 2^12.
    bodies = [{"prompt": f"wait let me verify step {i} of the proof", "max_tokens": max_tokens, "ignore_eos": True}
              for i in range(12)]
    outs = [{} for _ in bodies]
    threads = [threading.Thread(target=_stream, args=(s, b, o)) for b, o in zip(bodies, outs)]
    for t in threads:
        t.start()
    # Kill a replica while it generates: under load the client's chunks
    # arrive in bursts (all 12 streams had ended before 8 of them had shown
    # two chunks), so the client cannot tell which streams are in flight;
    # the replicas' CPU can.
    # Not before every stream has its first chunk: a request a replica has
    # not started yet is routed again when that replica dies (a kill right
    # after the streams were sent left every stream finishing on the other
    # replica, twice in CI).
    deadline = time.monotonic() + 300
    while not all(o.get("chunks") for o in outs) and not any(o.get("ended") for o in outs):
        assert time.monotonic() < deadline, outs
        time.sleep(0.2)
    victims = engine_replica_procs(psutil.Process(s.proc.pid))
    assert len(victims) == 2
    victim = generating(victims, time.monotonic() + 300, in_flight=lambda: any(t.is_alive() for t in threads))
    return outs, threads, victim


def test_replica_killed_mid_load(ray_service):
    s = ray_service
    # Long enough that both replicas are still generating when one is killed:
    # 500 tokens were not (CI, 2 cores: one replica's 3 streams had ended
    # 5.7 s in, before the slowest of the other's 9 had sent its second chunk),
    # and 1,200 were not either once (CI, 2026-11-29: the first chunks came in
    # bursts; at the kill the client had 707-1,152 chunks of each stream and
    # the killed replica had finished its streams, so none failed). Once (CI,
    # 2026-11-29) even 2,400 ended before a replica was seen busy: then the
    # round is run again with longer streams, and so is one where most
    # streams had ended by the time a replica was seen busy (CI, 2026-12-02:
    # 10 of 12 had, the two left were on the other replica, none failed).
    # The client's chunks lag the replicas' tokens under load (CI, 2026-12-02,
    # later: 11 streams at 1,084-2,357 of 2,400 chunks when the busy replica
    # was killed, and none failed: its streams had been generated in full),
    # so a round counts only if half the streams are short of 60% of theirs.
    for max_tokens in (2400, 4800, LONG_TOKENS - 400):
        outs, threads, victim = _load_and_pick_victim(s, max_tokens)
        behind = [o for o in outs if o.get("finish") is None and (o.get("chunks") or 0) < 0.6 * max_tokens]
        if victim is not None and len(behind) >= len(outs) // 2:
            break
        for t in threads:
            t.join(timeout=300)
        victim = None
        print(f"streams of {max_tokens} tokens (mostly) ended before a replica was seen generating; longer ones next")
    assert victim is not None, "every round's streams ended before a replica was seen generating"
    victim.kill()  # SIGKILL: no drain, no goodbye
    print("streams ended before the kill:", sum(o["finish"] is not None for o in outs),
          "chunks at the kill:", [o.get("chunks") for o in outs])
    killed_at = time.monotonic()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a request hung after its replica died"
    finished = [o for o in outs if o["finish"] == "length" and o["error"] is None]
    failed = [o for o in outs if o["error"] is not None]
    assert len(finished) + len(failed) == len(outs), outs
    assert finished and failed, outs  # both replicas had requests in flight
    for o in finished:
        assert o["kv_usage"]["prompt_tokens"] > 0 and o["done"]
    for o in failed:  # a clean error event, then the end of the stream
        assert o["error"].get("code") == "replica_failed" and o["done"], o

    # New requests go to the surviving replica.
    time.sleep(1)
    for _ in range(4):
        r = s.post("/v1/completions", {"prompt": "one", "max_tokens": 4})
        assert r.status_code == 200, r.text
    # Serve replaces the killed replica.
    s.wait_for_replicas(2, START_TIMEOUT_S, not_before=killed_at + STALE_AFTER_S + 3, exclude=(victim.pid,))
    assert victim.pid not in [p.pid for p in engine_replica_procs(psutil.Process(s.proc.pid))]
    r = s.post("/v1/completions", {"prompt": "two", "max_tokens": 4})
    assert r.status_code == 200, r.text
    print(f"replica replaced in {time.monotonic() - killed_at:.0f} s")


def test_rate_limit_holds_across_ingress_replicas(ray_service):
    s = ray_service
    # A rate that refills nothing during the test, however slow the machine.
    created = kvsieve_cli("keys", "create", "ray-limited", "--rate", "0.0001", "--burst", "6", env=s.env)
    assert created.returncode == 0, created.stderr
    headers = {"Authorization": f"Bearer {created.stdout.strip()}"}
    log_start = len(s.log())  # an earlier test's load may have timed a Redis call out
    # Each ingress loads the new key on its own store poll: until both have,
    # some answers are 401s, which take no token. Count the others.
    answers: list[httpx.Response] = []
    deadline = time.monotonic() + 120
    while len(answers) < 20:
        assert time.monotonic() < deadline, f"the new key never reached both ingresses: {answers}"
        r = httpx.get(f"{s.url}/v1/models", headers=headers, timeout=60)
        if r.status_code == 401:
            time.sleep(0.2)
            continue
        answers.append(r)
    assert "redis unreachable" not in s.log()[log_start:], "an ingress fell back to its own bucket"
    codes = [r.status_code for r in answers]
    # One bucket for both ingresses: the burst of 6 and no more; a bucket per
    # ingress would let up to 12 through.
    assert codes.count(200) == 6 and codes.count(429) == 14, codes
    assert len({r.headers["x-kvsieve-ingress"] for r in answers}) == 2  # both ingress replicas answered
    refused = next(r for r in answers if r.status_code == 429)
    assert refused.json()["error"]["code"] == "rate_limit_exceeded" and int(refused.headers["Retry-After"]) >= 1


def test_prefix_routing_keeps_a_prefix_on_one_replica(ray_service):
    s = ray_service
    # A shared "system prompt" (past the 32 routing tokens), then each user's own question.
    system = "you are a careful assistant who checks every step of the proof " * 4
    prompt_tokens, cached = [], []
    for i in range(6):
        r = s.post("/v1/completions", {"prompt": f"{system} user {i} asks about {i * 7}", "max_tokens": 2})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        prompt_tokens.append(usage["prompt_tokens"])
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    # Every request after the first finds the system prompt in its replica's
    # radix cache: they all went to the same replica (with Serve's power of
    # two choices the second one alone misses half the time).
    assert all(c >= 0.8 * min(prompt_tokens) for c in cached[1:]), (cached, prompt_tokens)


def replica_outcomes(s: RayService) -> dict:
    """The engine replicas' ended requests by outcome, SGLang's decode steps'
    tokens and running requests, as last pushed to the hub."""
    text = s.metrics()
    counts = {status: replica_sum(text, "kvsieve_requests_total", status=status)
              for status in ("ok", "aborted", "error")}
    counts["decoded"] = replica_sum(text, "sglang:realtime_tokens_total", mode="decode")
    counts["running"] = replica_sum(text, "sglang:num_running_reqs")
    return counts


def test_client_disconnect_aborts_on_the_replica(ray_service):
    s = ray_service
    # The counts once the earlier tests' last pushes are in: two equal reads
    # a push apart (each replica pushes every 2 s), nothing running.
    before, deadline = replica_outcomes(s), time.monotonic() + 120
    while True:
        time.sleep(PUSH_INTERVAL_S + 1)
        now = replica_outcomes(s)
        if now == before and now["running"] == 0:
            break
        assert time.monotonic() < deadline, (before, now)
        before = now
    log_start = len(s.log())
    with httpx.stream("POST", f"{s.url}/v1/completions", headers=s.headers, timeout=120, json={
            "prompt": "a long thought", "max_tokens": 1900, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        chunks = 0
        for line in sse_lines(r):
            chunks += line.startswith("data: {")
            if chunks >= 3:
                break  # hang up mid-stream
    gone_at = time.monotonic()
    seen = None
    while time.monotonic() - gone_at < 60:
        log = s.log()[log_start:]
        if "client disconnected: request" in log:
            seen = time.monotonic() - gone_at
            break
        time.sleep(0.2)
    assert seen is not None, log[-3000:]
    # The request ends on its replica either way, aborted or run to its end
    # (1,900 tokens: 10 s on an idle machine, minutes under load), so no time
    # limit tells the two apart (a 15 s one passed a lost abort on an idle
    # machine and failed in CI): its outcome and SGLang's decode steps do.
    # The deadline only bounds a hang.
    deadline = time.monotonic() + 600
    while True:
        now = replica_outcomes(s)
        ended = {k: now[k] - before[k] for k in ("ok", "aborted", "error")}
        if sum(ended.values()) >= 1 and now["running"] == 0:
            break
        assert time.monotonic() < deadline, ("the request neither ended nor was aborted", before, now)
        time.sleep(0.5)
    print(f"disconnect logged after {seen:.1f} s, replica idle after {time.monotonic() - gone_at:.1f} s, "
          f"{now['decoded'] - before['decoded']:.0f} tokens decoded")
    assert ended == {"ok": 0, "aborted": 1, "error": 0}, \
        ("the request was not aborted on its replica" if ended["ok"] else "outcomes", ended)
    # ...and SGLang stopped decoding it before its end (1,899 decode steps).
    assert now["decoded"] - before["decoded"] < 1899, (before, now)
    log = s.log()[log_start:]
    assert "Traceback" not in log and "aclose()" not in log, log[-3000:]


def test_stop_drains_then_aborts(ray_service):
    s = ray_service
    root = psutil.Process(s.proc.pid)
    tree = root.children(recursive=True)
    assert len(tree) > 10  # Ray's processes, the replicas, their SGLang processes
    # Six long streams (far more tokens than the grace allows on any CPU,
    # see LONG_TOKENS) and one short one that finishes within it.
    longs = [{} for _ in range(6)]
    short: dict = {}
    started = [threading.Event() for _ in range(7)]
    threads = [threading.Thread(target=_stream, args=(s, {"prompt": f"think {i}", "max_tokens": LONG_TOKENS,
                                                         "ignore_eos": True}, o, e))
               for i, (o, e) in enumerate(zip(longs, started))]
    threads.append(threading.Thread(target=_stream, args=(s, {"prompt": "short", "max_tokens": 16,
                                                              "ignore_eos": True}, short, started[-1])))
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(timeout=300)
    signalled = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    print("chunks of the long streams at SIGTERM:", [o["chunks"] for o in longs])
    # While draining, a new request is refused. Probes go out every 0.5 s,
    # each in its own thread: on a loaded machine one probe can wait many
    # seconds (CI: a probe sent at SIGTERM was answered 6.8 s later, by Ray's
    # proxy after the app was gone), and it must not hold back the next.
    # A probe sent within the window meets the drain (the server refuses
    # for GRACE_S); one sent later may meet Ray's proxy after the app is
    # gone, whose answers are Ray's own. At least MIN_PROBES go out even if
    # this thread is starved past the window (CI once recorded only the
    # probe sent at SIGTERM), so a failure says which of the two happened.
    window = GRACE_S - 1
    deadline = signalled + window
    answers = []  # (seconds after SIGTERM it was sent, status, error code): which stage a failure reached
    sent = []  # seconds after SIGTERM of every probe sent

    def probe(sent_at: float) -> None:
        try:
            r = s.post("/v1/completions", {"prompt": "late", "max_tokens": 2}, timeout=GRACE_S)
        except httpx.HTTPError as exc:
            answers.append((sent_at, type(exc).__name__, None))
            return
        try:
            code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
        except ValueError:  # not our JSON (CI, 2026-12-02: three such answers, status unrecorded)
            code = f"not JSON: {r.text[:120]!r}"
        answers.append((sent_at, r.status_code, code))

    probes = []
    while ((time.monotonic() < deadline or len(sent) < MIN_PROBES)
           and not any(a[1] == 503 and a[0] < window for a in answers)):
        sent.append(round(time.monotonic() - signalled, 1))
        probes.append(threading.Thread(target=probe, args=(sent[-1],), daemon=True))
        probes[-1].start()
        time.sleep(0.5)
    answered_by = time.monotonic() + GRACE_S + 30  # the ones still waiting are answered too, in one bound
    for t in probes:
        t.join(timeout=max(0.0, answered_by - time.monotonic()))
    print("probes (sent after SIGTERM, status, code):", sorted(answers), "sent at:", sent)
    refused = [a for a in answers if a[1] == 503 and a[0] < window]
    assert refused and all(a[2] == "server_shutting_down" for a in refused), \
        (sorted(answers), sent, [o["chunks"] for o in longs], s.log()[-3000:])
    for t in threads:
        t.join(timeout=GRACE_S + 60)
    assert not any(t.is_alive() for t in threads)
    assert short["finish"] == "length" and short["error"] is None and short["done"], short  # drained
    aborted = [o for o in longs if o["error"] is not None]
    assert aborted, longs
    for o in longs:
        assert o["done"] and (o["finish"] == "length") != (o["error"] is not None), o
    for o in aborted:  # past the grace: an error event, then [DONE]
        assert o["error"]["code"] == "server_shutting_down", (o, o.get("ended", 0) - signalled)
        assert GRACE_S - 1 <= o["ended"] - signalled <= GRACE_S + 10, o["ended"] - signalled
    assert s.proc.wait(timeout=GRACE_S + 120) == 0, s.log()[-5000:]
    print(f"kvsieve serve exited {time.monotonic() - signalled:.1f} s after SIGTERM")
    gone, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, [(p.pid, p.name()) for p in alive]
    log = s.log()
    assert "did not end within" not in log and "outlived the shutdown" not in log, log[-5000:]
