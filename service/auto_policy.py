"""`kv_policy: {"name": "auto", "max_kv_fraction": X}` or
`{"name": "auto", "min_quality": Q}`: the server picks the policy and budget
for the model it serves from measured quality-vs-KV curves.

The curves are a calibration artifact in the store, kind `auto`, keyed by the
served model's name, written by `kvsieve calibrate auto --model DIR` (which
runs the accuracy grid of bench/eval through a real engine). The artifact
is a list of points, each a kv_policy the server can send as is, with its
measured KV fraction (KV held at the end of a request over the full run's)
and quality (accuracy relative to `full` on the same task, averaged over the
tasks; on a task where `full` scores 0, final-answer agreement with `full`).
`full` is always a point (fraction 1, quality 1).

Choice:
- `max_kv_fraction` X in (0, 1]: among the points with fraction <= X, the
  highest quality (ties: the smaller fraction). If no point is that small,
  the point of the smallest fraction, reported with `"met": false`.
- `min_quality` Q in [0, 1]: among the points with quality >= Q, the
  smallest fraction (ties: the higher quality); `full` always qualifies.

Where the store has no artifact for the model, one shipped with kvsieve
(service/calibrations/auto/<model>.json, the measured grid of
docs/results.md, committed as `kvsieve calibrate auto --artifact-out`
writes it) stands in; the report says which (`"origin": "store"` or
`"shipped"`). A store artifact always wins, so a calibration on the
user's own machine replaces the shipped one.

Without any artifact for the model (the documented default, reported as
`"source": "default"` with the reason):
- `max_kv_fraction` X: `{"name": "h2o", "budget_ratio": X, "compress_prompt": true}`
  (H2O needs no calibration and keeps about X of every private token);
- `min_quality` Q: `full` (the only choice known to meet a quality bar
  without measurements).

The choice is reported in the response's `kv_usage.auto`: source, the
constraint, the chosen policy and budget, and the point's measured fraction
and quality. This module resolves `auto` where the service resolves
kv_policy (service/app.py); `auto` is not a registered policy.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from kvsieve.policies import KVPolicyError

logger = logging.getLogger(__name__)

AUTO = "auto"
ARTIFACT_KIND = "auto"
ARTIFACT_VERSION = 1
CONSTRAINTS = ("max_kv_fraction", "min_quality")
DEFAULT_FRACTION_POLICY = "h2o"
SHIPPED_DIR = Path(__file__).resolve().parent / "calibrations" / "auto"


@functools.lru_cache(maxsize=8)
def shipped_artifact(model: str) -> Optional[dict]:
    """The artifact shipped with kvsieve for `model`, or None (read once)."""
    path = SHIPPED_DIR / f"{model}.json"
    if "/" in model or not path.is_file():
        return None
    return json.loads(path.read_text())


def is_auto(value: Any) -> bool:
    """Whether a request's kv_policy asks for `auto` (as an object or bare name)."""
    if value == AUTO:
        return True
    return isinstance(value, dict) and value.get("name") == AUTO


def parse_auto(value: Any, field: str = "kv_policy") -> tuple[str, float]:
    """(constraint, value) of an auto request; KVPolicyError naming the field."""
    if not isinstance(value, dict):
        raise KVPolicyError(field, 'auto needs an object: {"name": "auto", "max_kv_fraction": X} '
                                   'or {"name": "auto", "min_quality": Q}')
    for key in value:
        if key not in ("name", *CONSTRAINTS):
            raise KVPolicyError(f"{field}.{key}", "unknown field for auto (auto takes max_kv_fraction or "
                                                  "min_quality)")
    given = [k for k in CONSTRAINTS if k in value]
    if not given:
        raise KVPolicyError(f"{field}.max_kv_fraction", "auto needs max_kv_fraction or min_quality")
    if len(given) > 1:
        raise KVPolicyError(f"{field}.min_quality", "give max_kv_fraction or min_quality, not both")
    key = given[0]
    x = value[key]
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise KVPolicyError(f"{field}.{key}", "must be a number")
    if key == "max_kv_fraction" and not 0 < x <= 1:
        raise KVPolicyError(f"{field}.{key}", "must be in (0, 1]")
    if key == "min_quality" and not 0 <= x <= 1:
        raise KVPolicyError(f"{field}.{key}", "must be in [0, 1]")
    return key, float(x)


@dataclass(frozen=True)
class Point:
    kv_policy: dict
    kv_fraction: float
    quality: float


def check_artifact(data: Any) -> list[Point]:
    """The artifact's points, `full` included; ValueError if malformed."""
    if not isinstance(data, dict) or not isinstance(data.get("points"), list):
        raise ValueError("an auto artifact is {model, points: [{kv_policy, kv_fraction, quality}, ...]}")
    points = []
    for i, p in enumerate(data["points"]):
        try:
            kv_policy, frac, quality = dict(p["kv_policy"]), float(p["kv_fraction"]), float(p["quality"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"points[{i}]: want kv_policy (object), kv_fraction and quality (numbers)") from None
        if not isinstance(kv_policy.get("name"), str) or kv_policy["name"] == AUTO:
            raise ValueError(f"points[{i}].kv_policy.name: a served policy name")
        if not (math.isfinite(frac) and math.isfinite(quality)):
            raise ValueError(f"points[{i}]: kv_fraction and quality must be finite")
        points.append(Point(kv_policy, frac, quality))
    if not any(p.kv_policy["name"] == "full" for p in points):
        points.append(Point({"name": "full"}, 1.0, 1.0))
    return points


def choose(points: list[Point], constraint: str, x: float) -> tuple[Point, bool]:
    """(the point, whether it meets the constraint)."""
    def key_name(p: Point) -> str:
        return repr(sorted(p.kv_policy.items()))

    if constraint == "max_kv_fraction":
        fits = [p for p in points if p.kv_fraction <= x]
        if fits:
            return min(fits, key=lambda p: (-p.quality, p.kv_fraction, key_name(p))), True
        return min(points, key=lambda p: (p.kv_fraction, -p.quality, key_name(p))), False
    fits = [p for p in points if p.quality >= x]
    if fits:
        return min(fits, key=lambda p: (p.kv_fraction, -p.quality, key_name(p))), True
    return max(points, key=lambda p: (p.quality, -p.kv_fraction)), False


def default_choice(constraint: str, x: float) -> dict:
    if constraint == "max_kv_fraction":
        return {"name": DEFAULT_FRACTION_POLICY, "budget_ratio": x, "compress_prompt": True}
    return {"name": "full"}


def _budget_report(kv_policy: dict) -> dict:
    return {k: kv_policy[k] for k in ("budget", "budget_ratio", "compress_prompt") if k in kv_policy}


class AutoPolicy:
    """Resolves auto requests for one served model; reads the artifact from
    the store once per store version (the server's StoreMirror polls it)."""

    def __init__(self, model: str, usable: Optional[Callable[[dict], bool]] = None):
        """`usable(kv_policy)`: whether this server can run a point (a point of
        a policy it does not serve, say, is left out of the choice)."""
        self.model = model
        self.usable = usable
        self._cached: tuple[Any, Optional[list[Point]], Optional[str]] = (object(), None, None)
        self.origin = "store"

    def _points(self, store, version) -> tuple[Optional[list[Point]], str]:
        """(points or None, why none); sets self.origin."""
        if self._cached[0] != version or version is None:
            data, origin = None, "store"
            if store is not None:
                try:
                    data = store.get_artifact(ARTIFACT_KIND, self.model)
                except Exception as exc:  # store down: the shipped artifact or the default, say why
                    logger.warning("auto: cannot read the %r artifact of %r: %s", ARTIFACT_KIND, self.model, exc)
                    shipped = shipped_artifact(self.model)
                    if shipped is None:
                        return None, f"the store could not be read ({type(exc).__name__})"
                    data, origin = shipped, "shipped"
            if data is None:
                data, origin = shipped_artifact(self.model), "shipped"
            self.origin = origin
            if data is None:
                points = None
                why = (f"no {ARTIFACT_KIND!r} calibration artifact for model {self.model!r}" if store is not None
                       else f"no store configured and no shipped {ARTIFACT_KIND!r} artifact for {self.model!r}")
            else:
                try:
                    points, why = check_artifact(data), None
                    if self.usable is not None:
                        points = [p for p in points if self.usable(p.kv_policy)]
                except ValueError as exc:
                    logger.warning("auto: ignoring the artifact of %r: %s", self.model, exc)
                    points, why = None, f"the artifact for {self.model!r} is malformed ({exc})"
            self._cached = (version, points, why)
        return self._cached[1], self._cached[2] or ""

    def resolve(self, value: Any, store=None, version=None, field: str = "kv_policy") -> tuple[dict, dict]:
        """(the kv_policy to run, the report for kv_usage.auto)."""
        constraint, x = parse_auto(value, field)
        points, why = self._points(store, version)
        report: dict = {constraint: x, "model": self.model}
        if points is None:
            chosen = default_choice(constraint, x)
            report.update(source="default", reason=f"{why}; run `kvsieve calibrate auto` to measure",
                          policy=chosen["name"], **_budget_report(chosen))
            return chosen, report
        point, met = choose(points, constraint, x)
        report.update(source="artifact", origin=self.origin, policy=point.kv_policy["name"],
                      **_budget_report(point.kv_policy),
                      expected_kv_fraction=round(point.kv_fraction, 4), expected_quality=round(point.quality, 4),
                      met=met)
        return dict(point.kv_policy), report


def catalog_entry() -> dict:
    """What GET /v1/kv_policies says about auto."""
    return {
        "id": AUTO, "object": "kv_policy",
        "description": "picks the policy and budget for the served model from its measured quality-vs-KV "
                       "curves (`kvsieve calibrate auto`); without them a documented default. The choice is "
                       "reported in kv_usage.auto.",
        "params": {"max_kv_fraction": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                   "min_quality": {"type": "number", "minimum": 0, "maximum": 1}},
        "one_of": list(CONSTRAINTS),
    }
