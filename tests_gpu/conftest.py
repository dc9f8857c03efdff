"""GPU checks: not collected by CI (pytest's testpaths is tests/). They use
tests/helpers, and fail at once without a CUDA device instead of skipping."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))


def pytest_configure(config):
    if not torch.cuda.is_available():
        raise pytest.UsageError("tests_gpu/ needs a CUDA device (see tests_gpu/README.md)")
