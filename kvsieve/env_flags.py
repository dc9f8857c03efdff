"""On/off switches read from the environment (KVSIEVE_* = "0" or "1"): one
parser, so every switch rejects a typo the same way instead of reading it
as "off"."""

from __future__ import annotations

import os


def flag(name: str, default: bool = True) -> bool:
    """The switch `name`: "1" on, "0" off, unset `default`; anything else
    is a ValueError naming the variable."""
    value = os.environ.get(name)
    if value is None:
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, not {value!r}")
    return value == "1"
