"""kvsieve's Prometheus metrics (`kvsieve_*`, labelled by policy) and the
/metrics exposition that merges them with SGLang's own.

Both live in prometheus_client's multiprocess mode (SGLang's scheduler is a
separate process), so PROMETHEUS_MULTIPROC_DIR must be set before this module
is imported: service.engine.prepare_process_environment does it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# registry=None: in multiprocess mode values go to the shared directory and
# are read back by MultiProcessCollector; registering them too would duplicate.
REQUESTS = Counter(
    "kvsieve_requests_total",
    "Completed API requests by kv policy and outcome (ok, error, aborted, rejected).",
    ["policy", "status"],
    registry=None,
)
PROMPT_TOKENS = Counter(
    "kvsieve_prompt_tokens_total", "Prompt tokens of served requests.", ["policy"], registry=None
)
GENERATION_TOKENS = Counter(
    "kvsieve_generation_tokens_total", "Generated tokens of served requests.", ["policy"], registry=None
)
TTFT = Histogram(
    "kvsieve_time_to_first_token_seconds",
    "Time from request arrival to its first generated token.",
    ["policy"],
    buckets=_LATENCY_BUCKETS,
    registry=None,
)
TPOT = Histogram(
    "kvsieve_time_per_output_token_seconds",
    "Mean time per output token after the first, per request.",
    ["policy"],
    buckets=_LATENCY_BUCKETS,
    registry=None,
)
KV_TOKENS_IN_USE = Gauge(
    "kvsieve_kv_tokens_in_use",
    "KV tokens of running requests, prompt plus generated so far (what compressed "
    "requests retain is kvsieve_retained_kv_tokens).",
    ["policy"],
    multiprocess_mode="livesum",
    registry=None,
)
E2E_LATENCY = Histogram(
    "kvsieve_e2e_latency_seconds",
    "Time from request arrival to its last token, served requests.",
    ["policy"],
    buckets=_LATENCY_BUCKETS,
    registry=None,
)
COMPRESSION_RATIO = Histogram(
    "kvsieve_compression_ratio",
    "Retained over private KV tokens at a request's end (1.0: nothing evicted).",
    ["policy"],
    buckets=(0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0),
    registry=None,
)
GUARD_REJECTIONS = Counter(
    "kvsieve_guard_rejections_total",
    "Requests refused before the engine: unauthorized, rate_limited, body_too_large, timeout.",
    ["reason"],
    registry=None,
)
STORE_UP = Gauge(
    "kvsieve_store_up",
    "1 while the preset/key store answers, 0 while serving from the last snapshot.",
    ["backend"],
    multiprocess_mode="livemostrecent",
    registry=None,
)
STORE_ERRORS = Counter(
    "kvsieve_store_errors_total", "Failed polls of the preset/key store.", ["backend"], registry=None
)


def observe_kv_usage(kv_usage: dict | None) -> None:
    """A finished request's compression ratio, from its kv_usage record."""
    if not kv_usage:
        return
    private = kv_usage.get("private_tokens") or 0
    if private > 0:
        ratio = min(1.0, (kv_usage.get("retained_tokens") or 0) / private)
        COMPRESSION_RATIO.labels(str(kv_usage.get("policy", "full"))).observe(ratio)


def render_metrics() -> tuple[bytes, str]:
    """Exposition text of every process's metrics (SGLang's and ours)."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return generate_latest(registry), CONTENT_TYPE_LATEST


class RequestMetrics:
    """Per-request bookkeeping feeding the metrics above."""

    def __init__(self, policy: str, started_at: float):
        self.policy = policy
        self.started_at = started_at
        self.first_token_at: float | None = None
        self.kv_tokens_held = 0
        self.completion_tokens = 0

    def on_progress(self, now: float, kv_tokens: int, completion_tokens: int) -> None:
        if self.first_token_at is None and completion_tokens > 0:
            self.first_token_at = now
            TTFT.labels(self.policy).observe(now - self.started_at)
        KV_TOKENS_IN_USE.labels(self.policy).inc(kv_tokens - self.kv_tokens_held)
        self.kv_tokens_held = kv_tokens
        self.completion_tokens = completion_tokens

    def on_end(self, now: float, status: str, prompt_tokens: int) -> None:
        KV_TOKENS_IN_USE.labels(self.policy).dec(self.kv_tokens_held)
        self.kv_tokens_held = 0
        REQUESTS.labels(self.policy, status).inc()
        if status == "ok":
            E2E_LATENCY.labels(self.policy).observe(now - self.started_at)
            PROMPT_TOKENS.labels(self.policy).inc(prompt_tokens)
            GENERATION_TOKENS.labels(self.policy).inc(self.completion_tokens)
            if self.first_token_at is not None and self.completion_tokens > 1:
                TPOT.labels(self.policy).observe(
                    (now - self.first_token_at) / (self.completion_tokens - 1)
                )


def count_rejected(policy: str) -> None:
    REQUESTS.labels(policy, "rejected").inc()
