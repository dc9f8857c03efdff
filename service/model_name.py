"""The model id the API serves, by one rule for the single process and the
Ray replicas. The engine's scheduler keys calibration artifacts by it
(policies.thinkv.calibration reads $KVSIEVE_SERVED_MODEL_NAME), so every
process that starts an engine exports it first."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from .default_model import DEFAULT_MODEL_NAME

SERVED_MODEL_ENV = "KVSIEVE_SERVED_MODEL_NAME"


def served_model_name(configured: Optional[str], model: Optional[str], model_path: str) -> str:
    """`engine.served_model_name`, else the checkpoint directory's name, else
    (the embedded default model) its own name."""
    if configured:
        return configured
    return Path(model_path).name if model else DEFAULT_MODEL_NAME


def export_served_model_name(name: str) -> None:
    """For the engine processes started after this (they inherit it)."""
    os.environ[SERVED_MODEL_ENV] = name
