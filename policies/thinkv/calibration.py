"""ThinKV's calibration (appendix D.1, Algorithm 1): from per-step attention
sparsity traces of a few prompts, the layers L* whose sparsity shows the
three thought modes in every prompt, and the two thresholds between the
modes. Stored as an artifact {model, layers, thresholds} in kvsieve's store
(kind "thinkv"); the policy looks it up once per process (bind_model).

A model without an artifact runs with FALLBACK_* below **(decision)**, and
says so in the logs and in kvsieve_policy_fallback_total{policy="thinkv"}.
A request may override the layers and the thresholds (thinkv's `layers`,
`thresholds`): `overridden` gives its own Calibration; a request that
overrides both uses no fallback.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

logger = logging.getLogger(__name__)

ARTIFACT_KIND = "thinkv"
#: Set by `kvsieve serve`: the model id the API serves, the artifact's key.
SERVED_MODEL_ENV = "KVSIEVE_SERVED_MODEL_NAME"
#: Thresholds of an uncalibrated model **(decision)**: in SmolLM2-135M's
#: layers past the first third, a decode step's sparsity has a median of
#: about 0.75-0.9 (prompts of service/calibrate.py, under 400 tokens of
#: context; it grows with the context). Typical steps type as R, markedly
#: sparser ones as T, markedly denser ones as E.
FALLBACK_THRESHOLDS = (0.75, 0.9)
#: Layers of an uncalibrated model **(decision)**: the 4 around two thirds of
#: the depth, where attention is neither local (early) nor diffuse (late).
FALLBACK_LAYER_COUNT = 4
THOUGHT_TYPES = 3  # R, E, T: three modes, two thresholds
KDE_GRID = 1024


@dataclass(frozen=True)
class Calibration:
    model: str
    layers: tuple[int, ...]
    thresholds: tuple[float, float]
    #: None when it came from an artifact; else why the fallback runs.
    fallback: Optional[str] = None
    #: What a request set itself ("layers", "thresholds").
    overrides: tuple[str, ...] = ()

    def to_artifact(self) -> dict:
        return {"model": self.model, "layers": list(self.layers), "thresholds": list(self.thresholds)}

    @classmethod
    def from_artifact(cls, data: dict) -> "Calibration":
        layers = tuple(int(x) for x in data["layers"])
        low, high = (float(x) for x in data["thresholds"])
        if not layers or not 0.0 <= low < high <= 1.0:
            raise ValueError(f"bad thinkv artifact: layers {layers}, thresholds {(low, high)}")
        return cls(model=str(data["model"]), layers=layers, thresholds=(low, high))


def fallback(model: str, num_layers: int, reason: str) -> Calibration:
    centre = (2 * num_layers) // 3
    first = max(0, min(centre - FALLBACK_LAYER_COUNT // 2, num_layers - FALLBACK_LAYER_COUNT))
    layers = tuple(range(first, min(num_layers, first + FALLBACK_LAYER_COUNT)))
    return Calibration(model=model, layers=layers, thresholds=FALLBACK_THRESHOLDS, fallback=reason)


def overridden(base: Calibration, num_layers: int, layers: Optional[Sequence[int]] = None,
               thresholds: Optional[Sequence[float]] = None) -> Calibration:
    """`base` with a request's own layers and/or thresholds. ValueError for
    a layer the model does not have (the params' bounds cannot know it)."""
    if layers is None and thresholds is None:
        return base
    if layers is not None and max(layers) >= num_layers:
        raise ValueError(f"layer {max(layers)} is past the model's {num_layers} layers")
    parts = tuple(name for name, value in (("layers", layers), ("thresholds", thresholds)) if value is not None)
    return Calibration(
        model=base.model,
        layers=tuple(sorted(layers)) if layers is not None else base.layers,
        thresholds=(float(thresholds[0]), float(thresholds[1])) if thresholds is not None else base.thresholds,
        fallback=None if len(parts) == 2 else base.fallback,
        overrides=parts,
    )


def artifact_key(model_name_or_path: str) -> str:
    """The model id artifacts are stored under: the served name `kvsieve
    serve` exports, else the checkpoint directory's name (serve's default id)."""
    return os.environ.get(SERVED_MODEL_ENV) or Path(model_name_or_path.rstrip("/")).name


def lookup(model_name_or_path: str, num_layers: int, store=None) -> Calibration:
    """The model's artifact from the store (the settings' store when none is
    given), or the fallback with the reason."""
    key = artifact_key(model_name_or_path)
    try:
        if store is None:
            from kvsieve.service.config import load_settings
            from kvsieve.service.store import open_store

            settings = load_settings()
            store = open_store(settings.store.url, settings.store.timeout_s)
        data = store.get_artifact(ARTIFACT_KIND, key)
    except Exception as exc:  # unreachable store, bad settings: serve anyway, on the fallback
        return fallback(key, num_layers, f"store_unavailable: {exc}")
    if data is None:
        return fallback(key, num_layers, "uncalibrated")
    try:
        calibration = Calibration.from_artifact(data)
    except (KeyError, TypeError, ValueError) as exc:
        return fallback(key, num_layers, f"bad_artifact: {exc}")
    if max(calibration.layers) >= num_layers:
        return fallback(key, num_layers, f"bad_artifact: layers {calibration.layers} past {num_layers}")
    return calibration


# ----- the KDE analysis (offline) -------------------------------------------
@dataclass(frozen=True)
class Density:
    """A Gaussian KDE of one (prompt, layer) sparsity trace on a grid over [0, 1]."""

    modes: tuple[float, ...]  # local maxima, ascending
    minima: tuple[float, ...]  # the lowest point between each two consecutive modes
    depth: float  # how far the minima dip below their neighbouring modes (0..1, mean)


def density_of(values: Sequence[float], grid: int = KDE_GRID, floor: float = 1e-3) -> Density:
    """Modes and inter-mode minima of a Gaussian KDE (Scott's bandwidth).
    Bumps under `floor` of the peak are numerical tails, not modes."""
    from scipy.stats import gaussian_kde

    x = np.asarray(values, dtype=np.float64)
    xs = np.linspace(0.0, 1.0, grid)
    if x.size < 2 or np.ptp(x) == 0:
        return Density(modes=(float(x.mean()) if x.size else 0.0,), minima=(), depth=0.0)
    f = gaussian_kde(x)(xs)
    cut = floor * f.max()
    inner = f[1:-1]
    peak = (inner > f[:-2]) & (inner >= f[2:]) & (inner > cut)
    idx = np.flatnonzero(peak) + 1
    modes = tuple(float(xs[i]) for i in idx)
    minima, depths = [], []
    for a, b in zip(idx[:-1], idx[1:]):
        m = a + int(np.argmin(f[a:b + 1]))
        minima.append(float(xs[m]))
        depths.append(1.0 - f[m] / min(f[a], f[b]))
    return Density(modes=modes, minima=tuple(minima), depth=float(np.mean(depths)) if depths else 0.0)


def calibrate(traces: Sequence[np.ndarray], max_layers: int = 4) -> tuple[list[int], tuple[float, float]]:
    """Algorithm 1 on per-prompt traces [steps, layers] of sparsity: L* =
    layers with exactly three modes in every prompt, at most `max_layers`
    of them, those with the deepest minima **(decision)**; thresholds = the
    two minima averaged over prompts and L*. Raises ValueError when no
    layer qualifies."""
    if not traces:
        raise ValueError("no traces")
    num_layers = traces[0].shape[1]
    per_layer: dict[int, list[Density]] = {}
    for layer in range(num_layers):
        densities = [density_of(t[:, layer]) for t in traces]
        if all(len(d.modes) == THOUGHT_TYPES for d in densities):
            per_layer[layer] = densities
    if not per_layer:
        raise ValueError(f"no layer shows {THOUGHT_TYPES} sparsity modes in every prompt "
                         f"({len(traces)} prompts, {num_layers} layers)")
    ranked = sorted(per_layer, key=lambda l: (-np.mean([d.depth for d in per_layer[l]]), l))
    layers = sorted(ranked[:max_layers])
    minima = np.array([d.minima for l in layers for d in per_layer[l]])  # [|L*| * P, 2]
    low, high = minima.mean(axis=0)
    return layers, (float(low), float(high))
