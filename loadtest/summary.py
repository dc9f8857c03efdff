"""Summary by policy of a load-test run, from its request log (JSON lines
written by locustfile.py): requests, client and server errors, TTFT and TPOT
quantiles (streamed requests) and generated tokens per second."""

from __future__ import annotations

import json
import math
from pathlib import Path

BAD = "bad requests"


def read_log(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def quantile(values: list[float], q: float) -> float | None:
    """Nearest-rank quantile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _group(record: dict) -> str:
    return BAD if record["scenario"] == "bad" else record["policy"]


def summarize(records: list[dict]) -> dict:
    if not records:
        return {"duration_s": 0.0, "policies": {}, "total": {}}
    t0 = min(r["start"] for r in records)
    t1 = max(r["end"] for r in records)
    duration = max(t1 - t0, 1e-9)
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(_group(r), []).append(r)
    by_policy = {name: _stats(rs, duration) for name, rs in sorted(groups.items())}
    return {"duration_s": round(duration, 1), "policies": by_policy, "total": _stats(records, duration)}


def _stats(records: list[dict], duration: float) -> dict:
    status = [r.get("status", 0) for r in records]
    # A bad request answered with its expected 4xx is a success.
    unexpected_4xx = sum(1 for r in records if 400 <= r.get("status", 0) < 500 and r.get("expected") != r["status"])
    ok = [r for r in records if r.get("status") == 200 and not r.get("error")]
    ttft = [r["ttft"] for r in ok if "ttft" in r]
    tpot = [r["tpot"] for r in ok if "tpot" in r]
    tokens = sum(r.get("tokens", 0) for r in ok)

    def ms(v):
        return None if v is None else round(v * 1000, 2)

    return {
        "requests": len(records),
        "ok": len(ok),
        "expected_4xx": sum(1 for r in records if r.get("expected") == r.get("status")),
        "unexpected_4xx": unexpected_4xx,
        "5xx": sum(1 for s in status if s >= 500),
        "transport_errors": sum(1 for s in status if s == 0),
        "broken_responses": sum(1 for r in records if r.get("status") == 200 and r.get("error")),
        # Any request that did not get what it should: the run's failures.
        "failed": sum(1 for r in records if not _as_expected(r)),
        "ttft_p50_ms": ms(quantile(ttft, 0.5)),
        "ttft_p99_ms": ms(quantile(ttft, 0.99)),
        "tpot_p50_ms": ms(quantile(tpot, 0.5)),
        "tpot_p99_ms": ms(quantile(tpot, 0.99)),
        "generated_tokens": tokens,
        "output_tokens_per_s": round(tokens / duration, 2),
    }


def _as_expected(record: dict) -> bool:
    if "expected" in record:  # a bad request: refused with its 4xx
        return record.get("status") == record["expected"] and not record.get("error")
    return record.get("status") == 200 and not record.get("error")


_COLUMNS = [
    ("requests", "requests"), ("ok", "ok"), ("failed", "failed"), ("expected_4xx", "4xx (expected)"),
    ("unexpected_4xx", "4xx (unexpected)"), ("5xx", "5xx"), ("transport_errors", "transport errors"),
    ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"),
    ("tpot_p50_ms", "TPOT p50 ms"), ("tpot_p99_ms", "TPOT p99 ms"),
    ("output_tokens_per_s", "output tok/s"),
]


def to_markdown(summary: dict) -> str:
    head = "| policy | " + " | ".join(title for _, title in _COLUMNS) + " |"
    rule = "| --- |" + " ---: |" * len(_COLUMNS)
    rows = [head, rule]
    for name, stats in [*summary["policies"].items(), ("**all**", summary["total"])]:
        cells = ["-" if stats.get(key) is None else str(stats[key]) for key, _ in _COLUMNS]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"
