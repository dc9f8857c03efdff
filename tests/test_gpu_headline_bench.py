"""bench/gpu_headline.py's vanilla part on CPU (its logic on the tiny
Llama, torch_native attention): the JSON lands in an output folder the
script makes (a device call lost a vanilla point to a missing folder on
2026-12-03), with the point's generation, requests and tokens/s."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_vanilla_part_writes_its_json_into_a_new_folder(tmp_path, tiny_llama):
    out = tmp_path / "call" / "headline"  # neither folder exists yet
    proc = subprocess.run([sys.executable, str(REPO / "bench/gpu_headline.py"), str(tiny_llama), str(out),
                           "--parts", "vanilla", "--generate", "128", "--tail", "16", "--kv-tokens", "4096",
                           "--max-running", "4", "--check-prompt", "32"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu-headline.json").read_text())
    (point,) = result["vanilla"]
    assert point["generate"] == 128 and point["context_at_window"] == 64 and point["requests"] == 4
    assert point["tokens_per_s"] > 0 and point["window_tokens"] > 0
    assert result["full_check"]["vanilla"]["tokens_per_s"] > 0
    assert result["config"]["kv_tokens"] == 4096 and "--parts vanilla" in result["command"]
