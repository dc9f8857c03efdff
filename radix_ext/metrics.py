"""Metrics of the compressed region, written from SGLang's scheduler process.

prometheus_client runs in multiprocess mode there too (the service sets
PROMETHEUS_MULTIPROC_DIR before the engine starts and the scheduler inherits
it), so the API's /metrics collects these with SGLang's own.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

EVICTED_TOKENS = Counter(
    "kvsieve_evicted_tokens_total",
    "KV tokens evicted by compression policies (per layer and kv head, averaged).",
    ["policy"],
    registry=None,
)
EVICTION_EVENTS = Counter(
    "kvsieve_eviction_events_total",
    "(decode step, layer) pairs in which a policy evicted something.",
    ["policy"],
    registry=None,
)
RETAINED_TOKENS = Gauge(
    "kvsieve_retained_kv_tokens",
    "KV tokens retained in the compressed region by running requests (per layer and kv head, averaged).",
    ["policy"],
    multiprocess_mode="livesum",
    registry=None,
)
RETAINED_BYTES = Gauge(
    "kvsieve_retained_kv_bytes",
    "Bytes of K and V retained in the compressed region by running requests.",
    ["policy"],
    multiprocess_mode="livesum",
    registry=None,
)
RETAINED_ELEMENTS = Gauge(
    "kvsieve_retained_kv_elements",
    "K and V elements retained in the compressed region by running requests "
    "(8 x kvsieve_retained_kv_bytes / this = average bits per element).",
    ["policy"],
    multiprocess_mode="livesum",
    registry=None,
)
BITS_PER_ELEMENT = Gauge(
    "kvsieve_retained_kv_bits_per_element",
    "Average bits per retained K or V element in the compressed region (codes and scales), per policy.",
    ["policy"],
    multiprocess_mode="livemax",
    registry=None,
)


#: policy -> [bytes, elements] this process retains: BITS_PER_ELEMENT from
#: these, not from collecting the gauges (a collect takes prometheus_client's
#: process-wide lock once per sample, on the scheduler's thread; one stalled
#: a decode step 16.8 ms on an H200, 2026-12-01).
_retained: dict[str, list[float]] = {}


def add_retained(policy: str, size: float, elements: float) -> None:
    """Bytes and K/V elements a policy's requests now retain more (or less)."""
    RETAINED_BYTES.labels(policy).inc(size)
    RETAINED_ELEMENTS.labels(policy).inc(elements)
    totals = _retained.setdefault(policy, [0.0, 0.0])
    totals[0] += size
    totals[1] += elements


def record_bits_per_element() -> None:
    """BITS_PER_ELEMENT from this process's retained bytes and elements."""
    for policy, (size, elements) in _retained.items():
        BITS_PER_ELEMENT.labels(policy).set(8 * size / elements if elements > 0 else 0.0)


REGION_PAGES = Gauge(
    "kvsieve_region_pages",
    "Pages of the compressed region by state (used, free).",
    ["state"],
    multiprocess_mode="livesum",
    registry=None,
)


REGION_RESERVED_PAGES = Gauge(
    "kvsieve_region_reserved_pages",
    "Pages of the compressed region reserved for running requests' compressed ceilings.",
    multiprocess_mode="livesum",
    registry=None,
)


TOKEN_POOL_TOKENS = Gauge(
    "kvsieve_token_pool_tokens",
    "SGLang's token pool by state (free; cached: radix-tree tokens no request holds; in_use), "
    "read from its allocator after each request's KV is released.",
    ["state"],
    multiprocess_mode="livesum",
    registry=None,
)


def record_token_pool(free: int, cached: int, total: int) -> None:
    TOKEN_POOL_TOKENS.labels("free").set(free)
    TOKEN_POOL_TOKENS.labels("cached").set(cached)
    TOKEN_POOL_TOKENS.labels("in_use").set(total - free - cached)


def record_region_reserved(pages: int) -> None:
    REGION_RESERVED_PAGES.set(pages)


QUANT_PAGES = Gauge(
    "kvsieve_region_quantized_pages",
    "Quantized (TBQ) pages of the compressed region by state (used, free).",
    ["state"],
    multiprocess_mode="livesum",
    registry=None,
)


def record_quantized_pages(used: int, free: int) -> None:
    QUANT_PAGES.labels("used").set(used)
    QUANT_PAGES.labels("free").set(free)


def record_region(pages_used: int, pages_free: int) -> None:
    REGION_PAGES.labels("used").set(pages_used)
    REGION_PAGES.labels("free").set(pages_free)


COMPRESSED_REQUESTS_LIVE = Gauge(
    "kvsieve_compressed_requests_live",
    "Compressed requests the scheduler holds state for (queued or running); 0 when idle.",
    multiprocess_mode="livesum",
    registry=None,
)


def record_compressed_requests_live(count: int) -> None:
    COMPRESSED_REQUESTS_LIVE.set(count)


POLICY_FALLBACKS = Counter(
    "kvsieve_policy_fallback_total",
    "Requests a policy ran with a documented fallback (e.g. thinkv on a model without a calibration artifact).",
    ["policy", "reason"],
    registry=None,
)


GRAPH_CAPTURES = Counter(
    "kvsieve_decode_graph_captures",
    "Decode-step shapes captured as CUDA graphs: graph=region (the compressed pass, per layer) "
    "or forward (the whole decoder stack, radix_ext/forward_graphs.py)",
    ["graph"],
)
GRAPH_REPLAYS = Counter(
    "kvsieve_decode_graph_replays",
    "Decode steps of compressed rows replayed from CUDA graphs, by graph (region or forward)",
    ["graph"],
)


def record_graph_capture(graph: str) -> None:
    GRAPH_CAPTURES.labels(graph=graph).inc()


def record_graph_replay(graph: str) -> None:
    GRAPH_REPLAYS.labels(graph=graph).inc()


PADDED_ROWS = Counter(
    "kvsieve_decode_padded_rows",
    "Rows of no request added to decode steps' policy groups to keep their graphs' shapes "
    "(step_meta.row_bucket): work spent so that replays go on while requests join and end",
)


def record_padded_rows(rows: int) -> None:
    PADDED_ROWS.inc(rows)


POOL_ONLY_ROWS = Counter(
    "kvsieve_decode_pool_only_rows",
    "Rows of `full` (or no kv_policy) requests that ran a decode step in kvsieve's pass, reading their KV "
    "from the token pool, instead of SGLang's backend, so that a batch with compressed rows replays its "
    "whole decoder stack (step_meta.StepBuilder.fold_pool_rows)",
)


def record_pool_only_rows(rows: int) -> None:
    POOL_ONLY_ROWS.inc(rows)


REQUEST_ERRORS = Counter(
    "kvsieve_request_errors_total",
    "Requests ended with an error because their policy's code failed (radix_ext/faults.py), by policy and "
    "stage (admit, step_inputs, budgets, tbq_format, probe, prefill, decide, observe, tokens, usage), or "
    "because the model's logits for them were not finite (stage logits, radix_ext/logit_guard.py); the "
    "scheduler and every other request go on.",
    ["policy", "stage"],
    registry=None,
)


def init_request_errors(policies, stages) -> None:
    """A zero series for every compressing policy and stage: the series
    exists before the first fault, so that fault is an increase
    (KvsievePolicyFault) and dashboards find the metric on a healthy server."""
    for policy in policies:
        for stage in stages:
            REQUEST_ERRORS.labels(policy, stage)


DECISION_RETRIES = Counter(
    "kvsieve_decision_oom_retries_total",
    "Decisions that ran out of GPU memory and were retried in smaller row chunks, by policy.",
    ["policy"],
    registry=None,
)
GRAPH_CAPTURE_FAILURES = Counter(
    "kvsieve_decode_graph_capture_failures_total",
    "Decode-step shapes whose CUDA-graph capture failed (out of memory, a policy fault): they run eagerly.",
    ["graph"],
    registry=None,
)


PLANNED_BYTES = Gauge(
    "kvsieve_planned_bytes",
    "GPU memory kvsieve planned at start-up beyond SGLang's own (radix_ext/memory_plan.py), by part: "
    "page_table, decision_scratch, pass_scratch, forward_graph, tbq_staging.",
    ["part"],
    multiprocess_mode="livemax",
    registry=None,
)
GPU_MEMORY = Gauge(
    "kvsieve_scheduler_gpu_memory_bytes",
    "The scheduler process's GPU memory (torch's caching allocator): reserved, allocated, and their peaks.",
    ["kind"],
    multiprocess_mode="livemax",
    registry=None,
)


def record_planned_bytes(parts: dict) -> None:
    for part, value in parts.items():
        PLANNED_BYTES.labels(part).set(value)


def record_gpu_memory() -> None:
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    GPU_MEMORY.labels("reserved").set(torch.cuda.memory_reserved())
    GPU_MEMORY.labels("allocated").set(torch.cuda.memory_allocated())
    GPU_MEMORY.labels("peak_reserved").set(torch.cuda.max_memory_reserved())
    GPU_MEMORY.labels("peak_allocated").set(torch.cuda.max_memory_allocated())
