"""Named ranges of the compressed path in torch-profiler traces.

bench/step_profile.py splits a decode step into model layers, attention,
region writes, each policy's decision and host work by these names
(`kvsieve.store`, `kvsieve.attend`, `kvsieve.view`, `kvsieve.decide.<policy>`,
`kvsieve.observe.<policy>`, `kvsieve.evict`, `kvsieve.step_meta`,
`kvsieve.step_inputs.<policy>`). Off
unless KVSIEVE_PROFILE_RANGES=1: a range costs a few microseconds of host
time even with no profiler running, and a step opens about 150 of them.
"""

from __future__ import annotations

import contextlib
import os

import torch

ENABLED = os.environ.get("KVSIEVE_PROFILE_RANGES") == "1"
_OFF = contextlib.nullcontext()


def recording() -> bool:
    """Ranges are on and a torch profiler is recording now. The region's
    pass then runs eagerly: ranges inside a CUDA-graph replay are not
    recorded, so a profiled step would show no split."""
    return ENABLED and torch._C._autograd._profiler_enabled()


def span(name: str):
    """A profiler range named `name` when ranges are on, else a no-op."""
    return torch.profiler.record_function(name) if ENABLED else _OFF
