"""Triton kernels compiled for a GPU target (sm_90) on this CPU: Triton's
interpreter (tests/interpreted/) runs a kernel's arithmetic but not the GPU
compiler's type checks; a loop-carried variable whose type changes compiled
nowhere but on the device (2026-11-29, kernels/region_store.py)."""

import sys
from pathlib import Path

from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

import kernel_compile_check  # noqa: E402


def test_the_region_store_kernel_compiles_for_an_h100():
    lines = kernel_compile_check.compile_store(GPUTarget("cuda", 90, 32))
    assert [line.split(":")[0] for line in lines] == ["store bf16", "store fp16"]
    assert all("REG:" in line for line in lines), lines
