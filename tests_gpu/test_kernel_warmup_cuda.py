"""The start-up warm-up (radix_ext/kernel_warmup.py) leaves no decode
kernel variant to compile mid-serving: bench/kernel_warmup_check.py in a
process of its own (a fresh one: variants this test process compiled
earlier would hide what the warm-up missed) compiles variants in the
warm-up and none in a sweep of serving's launches (the decode attention's,
and LongFlow's select kernel's)."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_after_the_warmup_serving_launches_compile_nothing(tmp_path):
    out = tmp_path / "check.json"
    result = subprocess.run([sys.executable, str(REPO / "bench/kernel_warmup_check.py"), "--out", str(out)],
                            capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    check = json.loads(out.read_text())
    assert check["warmup_launches"] >= 8 and check["sweep_launches"] > 1000
    # The process started cold: the warm-up itself compiled (or loaded) every decode kernel.
    assert all(n > 0 for n in check["variants_after_warmup"].values()), check
    assert check["variants_before"] == {name: 0 for name in check["variants_before"]}, check
    assert check["new_in_sweep"] == {}, check
    # LongFlow's select kernel: one variant a tile, all compiled at start.
    assert check["select_warmup_launches"] == 10 and check["select_variants_after_warmup"] >= 10, check
    assert check["select_sweep_launches"] > 100 and check["select_new_in_sweep"] == 0, check
    assert result.returncode == 0, result.stderr[-3000:]
