"""bench/longflow_fused.py --quick: the GPU benchmark's own code end to end on
CPU (Triton's interpreter, tiny sizes, in a process of its own since the
script turns TRITON_INTERPRET on before importing Triton): every variant
runs, picks the reference's victims, and the JSON says where and how it
was made."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[1]


def test_quick_mode_writes_a_complete_report(tmp_path):
    out = tmp_path / "longflow-fused.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "bench/longflow_fused.py", "--quick", "--rows", "2,3",
                             "--configs", "16:4:fp32,32:4:fp16:3", "--out", str(out)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"].startswith("cpu") and report["date"] and report["versions"]["triton"]
    assert report["command"].startswith("python3 bench/longflow_fused.py --quick")
    assert [s["rows"] for s in report["sizes"]] == [2, 3]
    for size in report["sizes"]:
        variants = size["variants"]
        names = {"today", "attention_only", "fused_observed[block16_warps4_fp32_stages2]",
                 "fused_one_kernel[block16_warps4_fp32_stages2]", "fused_observed[block32_warps4_fp16_stages3]",
                 "fused_one_kernel[block32_warps4_fp16_stages3]"}
        assert set(variants) == names
        for name, v in variants.items():
            assert "error" not in v and v["eager_ms"] > 0, (name, v)
            if name != "attention_only":
                assert v["victims_vs_reference"]["rows_differing"] == 0, (name, v)
                assert v["evicts_one_slot_per_head"] and v["output_max_abs_error"] < 1e-4
            if name.startswith("fused"):
                assert v["victims_equal_today"] == size["rows"]
        assert size["best"]["eager_ms"]["fused_observed"]["today_ms"] == variants["today"]["eager_ms"]
        assert "today: decision in PyTorch (pass 3)" in size["passes"]
