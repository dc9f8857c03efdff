"""bench/extend_profile.py: its options, and its CPU path end to end (a real
engine on the session's tiny Llama, no profiler): each policy's prefills
timed after the shared prefix went into the radix cache."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("extend_profile", REPO / "bench/extend_profile.py")


def _module():
    sys.path.insert(0, str(REPO / "bench"))
    module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(module)
    return module


def test_options_cpu_defaults_profile_nothing():
    cfg = _module().options(["x", "MODEL", "OUT", "--device", "cpu", "--policies", "full,rkv"])
    assert cfg["policies"] == ["full", "rkv"] and cfg["profile"] == 0 and cfg["private"] == [4, 24]
    gpu = _module().options(["x", "MODEL", "OUT", "--private", "16,256", "--profile", "2"])
    assert gpu["private"] == [16, 256] and gpu["profile"] == 2 and gpu["prefix"] == 512


def test_cpu_run_times_every_policys_prefills(tmp_path, tiny_llama):
    proc = subprocess.run([sys.executable, str(REPO / "bench/extend_profile.py"), str(tiny_llama), str(tmp_path),
                           "--device", "cpu", "--policies", "full,streaming,snapkv", "--repeats", "2"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "extend-profile.json").read_text())
    assert result["device"] == "cpu" and list(result["runs"]) == ["full", "streaming", "snapkv"]
    for name, run in result["runs"].items():
        assert set(run["private"]) == {"4", "24"}, name
        for timed in run["private"].values():
            assert len(timed["all_ms"]) == 2 and all(t > 0 for t in timed["all_ms"])
            assert min(timed["all_ms"]) <= timed["median_ms"] <= max(timed["all_ms"])
        assert "profile" not in run
    assert result["runs"]["streaming"]["kv_policy"]["name"] == "streaming"
    assert "full" in proc.stdout and "snapkv" in proc.stdout
