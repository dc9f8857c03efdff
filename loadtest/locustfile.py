"""kvsieve load-test scenarios (locust).

Users, by weight:
  ChatUser        short chats, half of them streamed, policies from the mix
  ReasoningUser   long streamed "reasoning" outputs (--long-tokens)
  BurstUser       now and then a burst of --burst-size concurrent streamed chats
  BadRequestUser  requests the server must refuse with a 4xx (a 5xx fails)

Every request is also written as one JSON line to --request-log (policy,
status, tokens, TTFT, TPOT, timestamps): loadtest/summary.py and
loadtest/plot.py read it. Run headless through loadtest/run.py.
"""

from __future__ import annotations

import json
import random
import threading
import time

import gevent.pool
from locust import HttpUser, between, events, task

from workload import BAD_REQUESTS, PolicyMix, chat_body

CHAT_URL = "/v1/chat/completions"


@events.init_command_line_parser.add_listener
def _options(parser):
    parser.add_argument("--kv-policies", default="", help='policy mix: "full=2,h2o=1" (default: every policy)')
    parser.add_argument("--request-log", default="", help="JSON lines, one per request")
    parser.add_argument("--short-tokens", type=int, default=32)
    parser.add_argument("--long-tokens", type=int, default=256)
    parser.add_argument("--burst-size", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)


class RequestLog:
    """Appends one JSON line per request (locust runs users as greenlets in one
    process; the lock keeps lines whole if a write yields)."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1) if path else None
        self._lock = threading.Lock()

    def write(self, **record) -> None:
        if self._file is not None:
            with self._lock:
                self._file.write(json.dumps(record) + "\n")


_log: RequestLog | None = None


@events.init.add_listener
def _init(environment, **_):
    global _log
    _log = RequestLog(environment.parsed_options.request_log if environment.parsed_options else "")


def _body_or_error(resp) -> str:
    """What a failed response says: its body, or (status 0: no response at
    all) the client's exception, so a transport error names its cause."""
    return resp.text[:200] if resp.status_code else repr(resp.error)[:200]


class _KvsieveUser(HttpUser):
    abstract = True

    def on_start(self):
        opts = self.environment.parsed_options
        self.mix = PolicyMix.parse(opts.kv_policies)
        self.opts = opts
        self.rng = random.Random(opts.seed * 1_000_003 + id(self))

    def chat(self, scenario: str, max_tokens: int, stream: bool, reasoning: bool = False) -> None:
        policy = self.mix.pick(self.rng)
        body = chat_body(self.rng, policy, max_tokens, stream, reasoning)
        record = {"scenario": scenario, "policy": policy, "stream": stream, "max_tokens": max_tokens}
        start = time.time()
        with self.client.post(CHAT_URL, json=body, stream=stream, catch_response=True,
                              name=f"{scenario} {policy}") as resp:
            record["status"] = resp.status_code
            try:
                if resp.status_code != 200:
                    resp.failure(f"HTTP {resp.status_code}: {_body_or_error(resp)}")
                elif stream:
                    self._read_stream(resp, start, record)
                else:
                    record["tokens"] = resp.json()["usage"]["completion_tokens"]
                if resp.status_code == 200 and record["tokens"] != max_tokens:
                    raise RuntimeError(f"expected {max_tokens} tokens (ignore_eos), got {record['tokens']}")
            except Exception as exc:  # a broken body is a failed request, not a crashed user
                record["error"] = f"{type(exc).__name__}: {exc}"
                resp.failure(record["error"])
            end = time.time()
            # Streamed: locust timed the headers only; report the whole response.
            resp.request_meta["response_time"] = (end - start) * 1000
        record.update(start=start, end=end, latency=end - start)
        _log.write(**record)

    @staticmethod
    def _read_stream(resp, start: float, record: dict) -> None:
        first = last = None
        usage = None
        for line in resp.iter_lines():
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error'].get('message')}")
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                now = time.time()
                first = first or now
                last = now
            usage = chunk.get("usage") or usage
        if usage is None:
            raise RuntimeError("stream ended without usage")
        tokens = usage["completion_tokens"]
        record["tokens"] = tokens
        if first is not None:
            record["ttft"] = first - start
            if tokens > 1 and last > first:
                record["tpot"] = (last - first) / (tokens - 1)


class ChatUser(_KvsieveUser):
    weight = 4
    wait_time = between(0.5, 2.0)

    @task
    def short_chat(self):
        self.chat("chat", self.opts.short_tokens, stream=False)

    @task
    def streamed_chat(self):
        self.chat("stream", self.opts.short_tokens * 2, stream=True)


class ReasoningUser(_KvsieveUser):
    weight = 2
    wait_time = between(1.0, 3.0)

    @task
    def long_reasoning(self):
        self.chat("reasoning", self.opts.long_tokens, stream=True, reasoning=True)


class BurstUser(_KvsieveUser):
    weight = 1
    wait_time = between(8.0, 15.0)

    @task
    def burst(self):
        group = gevent.pool.Group()
        for _ in range(self.opts.burst_size):
            group.spawn(self.chat, "burst", self.opts.short_tokens, True)
        group.join()


class BadRequestUser(_KvsieveUser):
    weight = 1
    wait_time = between(1.0, 3.0)

    def on_start(self):
        super().on_start()
        self.next_bad = self.rng.randrange(len(BAD_REQUESTS))

    @task
    def bad_request(self):
        # In turn, from a random start: every kind is sent within len(BAD_REQUESTS) requests.
        label, body, expected = BAD_REQUESTS[self.next_bad % len(BAD_REQUESTS)]
        self.next_bad += 1
        kwargs = {"data": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
        start = time.time()
        with self.client.post(CHAT_URL, catch_response=True, name=f"bad: {label}", **kwargs) as resp:
            ok = resp.status_code == expected and "error" in (resp.json() if resp.text.startswith("{") else {})
            if ok:
                resp.success()
            else:
                resp.failure(f"expected {expected}, got {resp.status_code}: {_body_or_error(resp)}")
        _log.write(scenario="bad", policy="invalid", stream=False, status=resp.status_code, expected=expected,
                   start=start, end=time.time(), latency=time.time() - start, error=None if ok else label)
