"""Load in stages: "DURATION:USERS,..." (durations as 30s, 2m or seconds),
e.g. "60s:2,150s:12,150s:2" holds 2 users for a minute, ramps to 12 for
150 s, then back down to 2. Parsing only (no locust import: loadtest/run.py
checks its --stages with it); the locust shape is stages_shape.py."""

from __future__ import annotations


STAGES_ENV = "KVSIEVE_LOADTEST_STAGES"
SPAWN_RATE_ENV = "KVSIEVE_LOADTEST_SPAWN_RATE"


def parse_duration(text: str) -> float:
    text = text.strip()
    for suffix, scale in (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def parse_stages(text: str) -> list[tuple[float, int]]:
    """[(seconds, users), ...]; ValueError naming the bad part."""
    stages = []
    for part in text.split(","):
        try:
            duration, users = part.split(":")
            stage = (parse_duration(duration), int(users))
        except ValueError:
            raise ValueError(f"bad stage {part!r}: expected DURATION:USERS, e.g. 60s:4") from None
        if stage[0] <= 0 or stage[1] < 0:
            raise ValueError(f"bad stage {part!r}: the duration must be positive, the users not negative")
        stages.append(stage)
    return stages


def users_at(stages: list[tuple[float, int]], t: float) -> int | None:
    """Users wanted t seconds into the run; None once the last stage is over."""
    end = 0.0
    for duration, users in stages:
        end += duration
        if t < end:
            return users
    return None

