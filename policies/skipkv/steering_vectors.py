"""SkipKV's steering vectors (skipkv-slides.txt, "Calibrate (offline)"): per
decoder layer l, s_l = mean hidden state of execution sentences minus the
mean of the other (reflection, transition) sentences, from calibration
traces (`kvsieve calibrate skipkv`, service/calibrate_skipkv.py). Layer l is
the output of decoder layer l (the residual stream the next layer reads),
the place the engine adds α·s_l.

Stored as an artifact of kind "skipkv" keyed by the served model's id, with
the vectors of every layer, so a request may pick its layer; the default
layer is DEFAULT_LAYER_FRACTION of the depth. There is no fallback vector: a
request that asks for steering on a model without an artifact gets a 400
naming `kv_policy.params.steering` and the command that makes one.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

logger = logging.getLogger(__name__)

ARTIFACT_KIND = "skipkv"
ARTIFACT_VERSION = 1
#: `kvsieve serve` exports the id the API serves under this name (as for thinkv).
SERVED_MODEL_ENV = "KVSIEVE_SERVED_MODEL_NAME"
#: Default layer: about two thirds of the depth **(decision: SkipKV's public
#: code steers the input of layer 20 of 28 in R1-Distill-Qwen-7B, 20 of 32 in
#: Llama-8B, 35 of 48 in Qwen-14B)**; 30 layers -> layer 20.
DEFAULT_LAYER_FRACTION = 2 / 3


def default_layer(num_layers: int) -> int:
    return min(num_layers - 1, max(0, round(DEFAULT_LAYER_FRACTION * num_layers)))


@dataclass(frozen=True)
class SteeringVectors:
    model: str
    vectors: torch.Tensor  # [num_layers, hidden] float32
    default_layer: int
    counts: dict  # sentences per class the means came from

    @property
    def num_layers(self) -> int:
        return self.vectors.shape[0]

    def to_artifact(self, **extra) -> dict:
        return {"model": self.model, "version": ARTIFACT_VERSION, "num_layers": self.num_layers,
                "hidden_size": self.vectors.shape[1], "default_layer": self.default_layer,
                "layer_meaning": "output of decoder layer l (the residual stream)",
                "counts": dict(self.counts), "norms": [round(float(n), 5) for n in self.vectors.norm(dim=-1)],
                "vectors": [[float(f"{x:.6g}") for x in row] for row in self.vectors.tolist()], **extra}

    @classmethod
    def from_artifact(cls, data: dict) -> "SteeringVectors":
        vectors = torch.tensor(data["vectors"], dtype=torch.float32)
        if vectors.dim() != 2 or vectors.shape[0] < 1 or not torch.isfinite(vectors).all():
            raise ValueError(f"vectors must be a finite [layers, hidden] array, not {tuple(vectors.shape)}")
        layer = int(data["default_layer"])
        if not 0 <= layer < vectors.shape[0]:
            raise ValueError(f"default_layer {layer} is not one of its {vectors.shape[0]} layers")
        return cls(model=str(data["model"]), vectors=vectors, default_layer=layer, counts=dict(data.get("counts", {})))


def class_mean_difference(features: Sequence[torch.Tensor], execution: Sequence[bool]) -> torch.Tensor:
    """s = mean of the execution sentences' features minus the mean of the
    others; features: one [num_layers, hidden] tensor per sentence."""
    ex = [f for f, e in zip(features, execution) if e]
    rest = [f for f, e in zip(features, execution) if not e]
    if not ex or not rest:
        raise ValueError(f"both classes are needed: {len(ex)} execution and {len(rest)} other sentences")
    return torch.stack(ex).float().mean(0) - torch.stack(rest).float().mean(0)


def artifact_key(model_name_or_path: str) -> str:
    """The served model id (`kvsieve serve` exports it), else the checkpoint directory's name."""
    return os.environ.get(SERVED_MODEL_ENV) or Path(model_name_or_path.rstrip("/")).name


def lookup(model_name_or_path: str, num_layers: int, store=None) -> tuple[Optional[SteeringVectors], str]:
    """(the model's vectors, "") or (None, why not) from the settings' store."""
    key = artifact_key(model_name_or_path)
    try:
        if store is None:
            from kvsieve.service.config import load_settings
            from kvsieve.service.store import open_store

            settings = load_settings()
            store = open_store(settings.store.url, settings.store.timeout_s)
        data = store.get_artifact(ARTIFACT_KIND, key)
    except Exception as exc:  # unreachable store, bad settings
        return None, f"the calibration store could not be read ({type(exc).__name__}: {exc})"
    if data is None:
        return None, (f"no {ARTIFACT_KIND!r} steering vectors for model {key!r} in the calibration store; "
                      f"run `kvsieve calibrate skipkv --model <checkpoint>`")
    try:
        vectors = SteeringVectors.from_artifact(data)
    except (KeyError, TypeError, ValueError) as exc:
        return None, f"the {ARTIFACT_KIND!r} artifact of {key!r} is malformed ({exc})"
    if vectors.num_layers != num_layers:
        return None, (f"the {ARTIFACT_KIND!r} artifact of {key!r} has {vectors.num_layers} layers, "
                      f"the model {num_layers}")
    return vectors, ""
