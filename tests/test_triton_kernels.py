"""Triton kernels on CPU: tests/interpreted/ runs in a pytest process of its
own with TRITON_INTERPRET=1, which must be on before triton.language is first
imported (this process imported it already, through SGLang)."""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_triton_kernels_match_their_references_in_the_interpreter():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(HERE / "interpreted"), "-q", "-p", "no:cacheprovider"],
        env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900, cwd=HERE.parent)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in summary and "skipped" not in summary, summary
