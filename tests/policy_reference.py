"""Plain-Python reference implementations of the wired policies, written from
docs/design/policies.md, one head (or one layer) at a time. The vectorized
policies in kvsieve.policies must retain exactly what these retain."""

from __future__ import annotations


def streaming_keep(positions: list[int], budget: int, sinks: int) -> set[int]:
    ordered = sorted(positions)
    if len(ordered) <= budget:
        return set(ordered)
    sinks = min(sinks, budget)
    return set(ordered[:sinks]) | set(ordered[len(ordered) - (budget - sinks):])


def streaming_step(held: set[int], new: int, step: int, budget: int, sinks: int, buffer: int) -> set[int]:
    """A streaming head after decode step `step` stored token `new`: every
    `buffer` steps (the first at step buffer - 1) it cuts back to the budget."""
    held = held | {new}
    return streaming_keep(list(held), budget, sinks) if (step + 1) % buffer == 0 else held


def h2o_keep(scores: dict[int, float], budget: int) -> set[int]:
    ordered = sorted(scores)
    if len(ordered) <= budget:
        return set(ordered)
    recent = set(ordered[len(ordered) - budget // 2:]) if budget // 2 else set()
    rest = sorted((p for p in ordered if p not in recent), key=lambda p: -scores[p])
    return recent | set(rest[: budget - len(recent)])


def snapkv_keep(attention: dict[int, float], budget: int, window: int, kernel: int) -> set[int]:
    ordered = sorted(attention)
    window_set = set(ordered[len(ordered) - window:])
    half = kernel // 2
    pooled = {}
    for i, p in enumerate(ordered):
        pooled[p] = max(attention[q] for q in ordered[max(0, i - half): i + half + 1])
    rest = sorted((p for p in ordered if p not in window_set), key=lambda p: -pooled[p])
    return window_set | set(rest[:budget])


def longflow_evict(pv_sum: dict[int, float], budget: int, newest: int) -> int | None:
    """Position evicted from the whole layer this step, or None."""
    if len(pv_sum) <= budget:
        return None
    return min((p for p in pv_sum if p != newest), key=lambda p: pv_sum[p])
