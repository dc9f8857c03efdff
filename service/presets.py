"""Named kv_policy presets, loaded from a JSON file ({name: kv_policy object}).

A preset is checked when it is loaded, so a bad one stops start-up instead of
failing requests. (The shared Redis preset store comes with the scale-out
work; this file format stays its import/export format.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvsieve.policies import KVPolicyError, parse_kv_policy, policy_names


def validate_presets(presets: dict[str, Any]) -> dict[str, dict]:
    checked: dict[str, dict] = {}
    for name, value in presets.items():
        if name in policy_names():
            raise ValueError(f"preset {name!r} has the name of a policy")
        if not isinstance(value, dict):
            raise ValueError(f"preset {name!r} must be a kv_policy object")
        try:
            parse_kv_policy(value, field=f"presets.{name}")
        except KVPolicyError as exc:
            raise ValueError(f"invalid preset: {exc}") from None
        checked[name] = value
    return checked


def load_presets(path: str | Path | None) -> dict[str, dict]:
    if path is None:
        return {}
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: presets must be a JSON object {{name: kv_policy}}")
    return validate_presets(data)
